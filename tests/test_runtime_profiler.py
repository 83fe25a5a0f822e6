"""The profiler writes exactly the ``cp-planner-timings/v1`` format, with comm bytes equal
to the plan's figures."""

from __future__ import annotations

import json

import pytest
import torch
from timing import scaled

from planner_service.core.model import ModelSpec
from planner_service.core.plan import Plan
from planner_service.core.request import PlanRequest
from planner_service.solvers.registry import solve
from worker_runtime import ContextParallelAttention
from worker_runtime.profiler import (
    TIMINGS_FORMAT,
    attention_records,
    comm_record,
    read_timings,
    timings_document,
    write_timings,
)
from worker_runtime.testing import run_distributed

pytestmark = pytest.mark.slow  # long: starts first under xdist (tests/conftest.py)

MODEL = ModelSpec(num_heads=2, num_kv_heads=1, head_dim=8, dtype_bytes=4)


def small_plan(strategy: str = "flashcp") -> Plan:
    return solve(PlanRequest(doc_lengths=[300, 1, 45, 97, 211, 12], cp_size=2, strategy=strategy,
                             model=MODEL))


def comm_worker(rank: int, world_size: int, plan_json: str) -> dict:
    plan = Plan.from_json(plan_json)
    records = {}
    for mode in ("full", "compact_allgather", "alltoallv"):
        attn = ContextParallelAttention(plan, comm_mode=mode)
        records[mode] = comm_record(attn, MODEL, repeats=2).to_dict()
        records[mode]["planned"] = attn.planned_recv_tokens() * MODEL.kv_bytes_per_token
    return records


def test_timings_file_has_the_fitting_format(tmp_path) -> None:
    plan = small_plan()
    records = attention_records(plan, repeats=1)
    per_rank = run_distributed(comm_worker, 2, plan.to_json(), timeout_s=scaled(60.0))
    comm = []
    for res in per_rank:
        for rec in res.values():
            assert rec.pop("planned") == rec["bytes"]
            comm.append(rec)
    doc = timings_document(records, device="cpu", dtype=torch.float32, model=MODEL)
    doc["records"] += comm
    path = write_timings(tmp_path / "timings.json", doc)
    data = read_timings(path)
    assert data["format"] == TIMINGS_FORMAT and data["dtype"] == "float32"
    assert data["model"] == MODEL.to_dict()
    attn = [r for r in data["records"] if r["op"] == "attention"]
    assert len(attn) == 2 and all(r["ms"] > 0 and r["causal"] is True for r in attn)
    assert {(r["seq_tokens"], r["degree"], r["num_docs"]) for r in attn} == {(666, 2, 6)}
    assert {r["op"] for r in data["records"]} == {"attention", "comm"}
    assert set(data) == {"format", "device", "dtype", "model", "records"}


def test_read_timings_rejects_other_formats_and_extra_fields(tmp_path) -> None:
    path = tmp_path / "t.json"
    good = timings_document([], device="cpu", dtype=torch.float32, model=MODEL)
    path.write_text(json.dumps({**good, "format": "v0"}))
    with pytest.raises(ValueError, match="timings format must be"):
        read_timings(path)
    bad = {**good, "records": [{"op": "comm", "seq_tokens": 1, "degree": 2, "bytes": 3, "ms": 1.0, "x": 1}]}
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"records\[0\] must have exactly the fields"):
        read_timings(path)
    with pytest.raises(ValueError, match="dtype must be one of"):
        timings_document([], device="cpu", dtype=torch.float64, model=MODEL)
