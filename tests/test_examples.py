"""The training examples run under torchrun on 2 gloo ranks: finite losses, the same plan
on every rank every step, and step 0's outputs equal one process's on the whole sequence."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from timing import scaled

from planner_service.service.testing import ServerProcess

pytestmark = pytest.mark.slow  # long: starts first under xdist (tests/conftest.py)

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
RANKS = 2
TINY = ["--hidden", "32", "--vocab", "64", "--dataset", "pile", "--check-reference"]
TOLERANCE = 1e-4
"""float32 logits of a 2-layer model: the CP runtime and one process agree to ~1e-7."""


def run_example(script: str, tmp: Path, *args: str) -> tuple[list[list[dict[str, Any]]], dict]:
    """Run ``examples/<script>`` under torchrun; (per-rank step records, summary)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PLANNER_LOG_LEVEL": "warning"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(RANKS), str(ROOT / "examples" / script),
           "--log-dir", str(tmp), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=scaled(240))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "summary " in done.stdout
    if "--check-reference" in args:  # printed without --log-dir too
        assert "reference: max |logits - one process|" in done.stdout, done.stdout[-2000:]
    records = [[json.loads(line) for line in (tmp / f"rank{r}.jsonl").read_text().splitlines()]
               for r in range(RANKS)]
    return records, json.loads((tmp / "summary.json").read_text())


def check_llama_run(records: list[list[dict[str, Any]]], summary: dict, steps: int) -> None:
    assert summary["steps"] == steps and summary["fallbacks"] >= 0
    for rank_records in records:
        assert [r["step"] for r in rank_records] == list(range(steps))
        assert all(math.isfinite(r["loss"]) for r in rank_records)
    plan_ids = [[r["plan_id"] for r in rank_records] for rank_records in records]
    assert all(ids == plan_ids[0] for ids in plan_ids), plan_ids
    first = records[0][0]
    assert first["num_docs"] > 1, "step 0 should pack several documents"
    assert first["reference_max_abs_diff"] < TOLERANCE
    assert first["reference_loss_diff"] < TOLERANCE


def test_train_llama_with_the_embedded_planner(tmp_path):
    records, summary = run_example("train_llama.py", tmp_path, "--steps", "3",
                                   "--seq-len", "1024", "--seed", "4", *TINY)
    check_llama_run(records, summary, 3)
    assert {r["source"] for r in records[0]} <= {"embedded", "local"}


def test_train_llama_against_a_served_planner(tmp_path):
    with ServerProcess(workers=1, grpc=False) as server:
        records, summary = run_example("train_llama.py", tmp_path, "--steps", "3",
                                       "--seq-len", "1024", "--seed", "4",
                                       "--planner-url", server.http_url, *TINY)
    check_llama_run(records, summary, 3)
    # Step 0 may wait START_TIMEOUT_S for the service: it answers it.
    assert records[0][0]["source"] == "http" and not records[0][0]["fallback"]


def test_train_fcp_schedules_mixed_cp_groups(tmp_path):
    records, summary = run_example("train_fcp.py", tmp_path, "--steps", "2",
                                   "--max-seq-len", "2048", "--batch-size", "8", *TINY)
    assert summary["steps"] == 2
    for rank_records in records:
        assert all(math.isfinite(r["loss"]) for r in rank_records)
        assert rank_records[0]["reference_max_abs_diff"] < TOLERANCE
    ids = [[(r["schedule_id"], r["plan_ids"]) for r in rank_records] for rank_records in records]
    assert ids[0] == ids[1]
    degrees = {d for mb in records[0][0]["degrees"] for d in mb}
    assert len(degrees) > 1, f"CP groups of one size only: {records[0][0]['degrees']}"
