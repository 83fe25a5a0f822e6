"""The model-check harness runs end to end (no timing asserted) and its fit is exact."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.model_check import main, spearman
from planner_service.core.profile_fit import fit_step_profile, nnls_relative
from planner_service.core.profiles import KERNEL_PROFILES, LINK_PROFILES
from planner_service.core.request import PlanRequest
from planner_service.core.step_time import plan_rank_terms
from planner_service.solvers.registry import solve


def synthetic_records(kernel, link):
    """Rank records whose 'measured' times are the model's own terms under the profiles
    (the exchange measured alone: every transfer in full), on the lean path and the ring."""
    records = []
    for n, lengths in ((2, (3000, 1000, 96)), (3, (2048, 2048, 512, 7)), (4, (9000, 300) * 3)):
        for strategy in ("flashcp", "per_doc", "llama3", "zigzag"):
            plan = solve(PlanRequest(doc_lengths=lengths, cp_size=n, strategy=strategy, kernel="cpu-torch",
                                     link="gloo-local"))
            for t in plan_rank_terms(plan, kernel, link):
                records.append({
                    "fwd_flops": t.fwd_flops, "tiles": t.work.tiles, "row_blocks": t.work.row_blocks,
                    "segments": t.work.segments, "calls": t.work.calls, "copy_bytes": t.copy_bytes,
                    "copy_ops": t.copy_ops, "comm_bytes": t.comm_bytes, "passes": t.passes,
                    "peer_steps": t.peer_steps, "kernel_ms": t.estimate.kernel_ms,
                    "copy_ms": t.estimate.copy_ms, "exchange_ms": t.transfer_ms,
                })
    return records


def test_fit_recovers_the_profile_that_generated_the_times():
    kernel, link = KERNEL_PROFILES["cpu-torch"], LINK_PROFILES["gloo-local"]
    fitted = fit_step_profile(synthetic_records(kernel, link), base_kernel=kernel, base_link=link, name="x")
    for field in ("fwd_tflops", "bwd_tflops", "copy_gbps", "op_overhead_us", "per_tile_us",
                  "call_overhead_us"):
        assert getattr(fitted.kernel, field) == pytest.approx(getattr(kernel, field), rel=1e-6), field
    assert fitted.link.bandwidth_gbps == pytest.approx(link.bandwidth_gbps, rel=1e-6)
    assert fitted.link.latency_us + fitted.link.per_peer_us == pytest.approx(link.latency_us, rel=1e-6)


def test_nnls_keeps_coefficients_non_negative():
    x = np.array([[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]])
    coef, _ = nnls_relative(x, np.array([1.0, 1.5, 2.0]) * -1 + 4)  # slope < 0 in a free fit
    assert (coef >= 0).all()


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_bad_record_is_named():
    kernel, link = KERNEL_PROFILES["cpu-torch"], LINK_PROFILES["gloo-local"]
    record = {**synthetic_records(kernel, link)[0], "copy_bytes": -1}
    with pytest.raises(ValueError, match=r"records\[0\].copy_bytes must be a finite number >= 0"):
        fit_step_profile([record], base_kernel=kernel, base_link=link, name="x")


def test_cpu_smoke_runs_end_to_end(tmp_path):
    assert main(["--cpu-smoke", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "model_check.json").read_text())
    assert doc["records"] and doc["plans"]
    assert {"kernel_ms", "copy_ms", "exchange_ms", "layer_ms", "pred_layer_ms"} <= set(doc["records"][0])
    assert any(p["held_out"] for p in doc["plans"])
    for name in ("model_check.md", "model_check.png", "model_check_profile.json"):
        assert (tmp_path / name).stat().st_size > 0
