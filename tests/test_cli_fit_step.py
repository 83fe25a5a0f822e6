"""``planner fit-step-profile``: model-check records in, a step profile out; bad files end
with one line, exit 2."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from planner_service.cli import app
from planner_service.core.profile_fit import RECORDS_FORMAT, load_step_profile
from planner_service.core.profiles import KERNEL_PROFILES, LINK_PROFILES
from planner_service.core.request import PlanRequest
from planner_service.core.step_time import plan_rank_terms
from planner_service.solvers.registry import solve

runner = CliRunner()
KERNEL, LINK = KERNEL_PROFILES["cpu-torch"], LINK_PROFILES["gloo-local"]


def tiny_records() -> list[dict]:
    """Records of a few small plans whose 'measured' times are the model's own terms."""
    out = []
    for n, lengths in ((2, (700, 300, 24)), (3, (512, 512, 128, 7)), (4, (900, 30) * 2)):
        for strategy in ("flashcp", "per_doc", "zigzag"):
            plan = solve(PlanRequest(doc_lengths=lengths, cp_size=n, strategy=strategy,
                                     kernel="cpu-torch", link="gloo-local"))
            for t in plan_rank_terms(plan, KERNEL, LINK):
                out.append({
                    "fwd_flops": t.fwd_flops, "tiles": t.work.tiles, "row_blocks": t.work.row_blocks,
                    "segments": t.work.segments, "calls": t.work.calls, "copy_bytes": t.copy_bytes,
                    "copy_ops": t.copy_ops, "comm_bytes": t.comm_bytes, "passes": t.passes,
                    "peer_steps": t.peer_steps, "kernel_ms": t.estimate.kernel_ms,
                    "copy_ms": t.estimate.copy_ms, "exchange_ms": t.transfer_ms,
                })
    return out


def one_line_error(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_fits_a_records_file_and_writes_the_profile(tmp_path):
    records = tmp_path / "records.json"
    records.write_text(json.dumps({"format": RECORDS_FORMAT, "records": tiny_records()}))
    out = tmp_path / "cpu-fit.json"
    result = runner.invoke(app, ["fit-step-profile", str(records), "--out", str(out)])
    assert result.exit_code == 0, result.output
    kernel, link = load_step_profile(out)
    assert kernel.name == link.name == "cpu-fit"
    for field in ("fwd_tflops", "copy_gbps", "op_overhead_us", "call_overhead_us"):
        assert getattr(kernel, field) == pytest.approx(getattr(KERNEL, field), rel=1e-6), field
    assert link.bandwidth_gbps == pytest.approx(LINK.bandwidth_gbps, rel=1e-6)
    assert "fitted step profile cpu-fit" in result.stdout


def test_reads_v1_records(tmp_path):
    v1 = [{k: v for k, v in r.items() if k not in ("calls", "copy_ops")} for r in tiny_records()]
    records = tmp_path / "old.json"
    records.write_text(json.dumps({"format": "cp-planner-step-records/v1", "records": v1}))
    out = tmp_path / "p.json"
    result = runner.invoke(app, ["fit-step-profile", str(records), "--out", str(out), "--name", "v1"])
    assert result.exit_code == 0, result.output
    assert load_step_profile(out)[0].name == "v1"


@pytest.mark.parametrize(("content", "names"), [
    (None, "No such file"),
    ("{not json", "records file"),
    (json.dumps({"format": "something/else", "records": []}), "format must be one of"),
    (json.dumps({"format": RECORDS_FORMAT, "records": []}), "records must be a non-empty list"),
    (json.dumps({"format": RECORDS_FORMAT, "records": [{"fwd_flops": -1}]}),
     "records[0].fwd_flops must be a finite number >= 0"),
    (json.dumps([1, 2]), "format must be one of"),
])
def test_a_bad_records_file_is_one_line(tmp_path, content, names):
    records = tmp_path / "records.json"
    if content is not None:
        records.write_text(content)
    line = one_line_error(["fit-step-profile", str(records), "--out", str(tmp_path / "p.json")])
    assert names in line and str(records) in line
    assert not (tmp_path / "p.json").exists()


def test_an_unknown_base_profile_is_one_line(tmp_path):
    records = tmp_path / "records.json"
    records.write_text(json.dumps({"format": RECORDS_FORMAT, "records": tiny_records()[:4]}))
    line = one_line_error(["fit-step-profile", str(records), "--out", str(tmp_path / "p.json"),
                           "--base-kernel", "nope"])
    assert "kernel profile 'nope' is unknown" in line
