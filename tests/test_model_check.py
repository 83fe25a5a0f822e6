"""The model-check harness runs end to end (no timing asserted) and its fit is exact."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.model_check import main, measure_kernel_only, rank_records, spearman
from planner_service.core.model import ModelSpec
from planner_service.core.profile_fit import fit_step_profile, nnls_relative
from planner_service.core.profiles import KERNEL_PROFILES, LINK_PROFILES
from planner_service.core.request import PlanRequest
from planner_service.core.step_time import KernelWork, copy_ms, kernel_ms, plan_rank_terms
from planner_service.solvers.registry import solve


def synthetic_records(kernel, link, flash_path="segments"):
    """Rank records whose 'measured' times are the model's own terms under the profiles
    (the exchange measured alone: every transfer in full): on the lean path and the ring
    for the PyTorch kernel, on ``flash_path`` for a flash profile."""
    records = []
    for n, lengths in ((2, (3000, 1000, 96)), (3, (2048, 2048, 512, 7)), (4, (9000, 300) * 3)):
        for strategy in ("flashcp", "per_doc", "llama3", "zigzag"):
            plan = solve(PlanRequest(doc_lengths=lengths, cp_size=n, strategy=strategy, kernel="cpu-torch",
                                     link="gloo-local"))
            for t in plan_rank_terms(plan, kernel, link, flash_path=flash_path):
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


@pytest.mark.parametrize("flash_path", ["segments", "gathered"])
def test_fit_reproduces_the_flash_paths_terms(flash_path):
    # Segment tiling counts pairs as tiles x tile_q x tile_k, so the FLOP and tile
    # coefficients share one direction; the fitted profile must still give every term back.
    kernel, link = KERNEL_PROFILES["h100-fa2"], LINK_PROFILES["nvlink"]
    records = synthetic_records(kernel, link, flash_path)
    fitted = fit_step_profile(records, base_kernel=kernel, base_link=link, name="x")
    model = ModelSpec()
    for r in records:
        work = KernelWork(r["fwd_flops"] / (4.0 * model.head_dim * model.num_heads), r["tiles"],
                          r["segments"], r["row_blocks"], r["calls"])
        assert kernel_ms(work, model, fitted.kernel) == pytest.approx(r["kernel_ms"], rel=1e-6)
        assert copy_ms(r["copy_bytes"], fitted.kernel, r["copy_ops"]) == pytest.approx(
            r["copy_ms"], rel=1e-6)
    assert fitted.link.bandwidth_gbps == pytest.approx(link.bandwidth_gbps, rel=1e-6)


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


def test_cpu_smoke_on_the_segments_path(tmp_path):
    # The flash path's harness on CPU: the exact PyTorch segment kernel stands in for flash-attn.
    assert main(["--cpu-smoke", str(tmp_path), "--reference-segments"]) == 0
    doc = json.loads((tmp_path / "model_check.json").read_text())
    # Ring plans (ring, zigzag) run as the segment ring, the others on the segments path.
    assert {r["path"] for r in doc["records"]} == {"segments", "segment_ring"}
    assert all(r["calls"] >= 1 and "pred_layer_ms" in r for r in doc["records"])
    runs = (tmp_path / "model_check.md").read_text().split("paths run (plans): ")[1].split(" (")[0]
    assert {run.split()[0] for run in runs.split(", ")} == {"segments", "segment_ring"}


@pytest.mark.parametrize(("strategy", "path"), [("flashcp", "segments"), ("zigzag", "segment_ring")])
def test_kernel_only_runs_the_segments_calls(strategy: str, path: str):
    import torch

    model = ModelSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype_bytes=4)
    plan = solve(PlanRequest(doc_lengths=(300, 200, 90), cp_size=3, strategy=strategy, model=model,
                             kernel="h100-fa2"))
    out = measure_kernel_only(plan, model, 1, torch.device("cpu"), torch.float32, "torch",
                              reference_segments=True)
    assert [m["path"] for m in out] == [path] * 3
    assert all(m["kernel_ms"] > 0 and m["layer_ms"] is None for m in out)


def test_a_run_the_profile_prices_on_another_path_is_an_error():
    plan = solve(PlanRequest(doc_lengths=(300, 200), cp_size=2, kernel="cpu-torch"))
    batches = [{"n": 2, "dataset": "x", "plans": {"flashcp": plan}, "held_out": False}]
    measured = {(0, "flashcp"): [{"path": "segments", "layer_ms": 1.0, "kernel_ms": 0.5,
                                  "exchange_ms": 0.1}] * 2}
    kernel, link = KERNEL_PROFILES["cpu-torch"], LINK_PROFILES["gloo-local"]
    with pytest.raises(ValueError, match="ran on the segments path but kernel profile cpu-torch "
                                         "prices it on the lean path"):
        rank_records(batches, measured, kernel, link, False)
    records = rank_records(batches, measured, KERNEL_PROFILES["h100-fa2"], link, False)
    assert {r["path"] for r in records} == {"segments"} and batches[0]["paths"] == {"flashcp": "segments"}


def test_plans_with_the_same_layout_share_one_run():
    from bench.model_check import distinct_layouts
    from planner_service.core.request import PlanRequest
    from planner_service.solvers.registry import solve

    lengths = (700, 300, 250, 100)
    a = solve(PlanRequest(doc_lengths=lengths, cp_size=2, strategy="per_doc"))
    b = solve(PlanRequest(doc_lengths=lengths, cp_size=2, strategy="flashcp"))
    batches = [{"plans": {"per_doc": a, "same": a, "flashcp": b}}]
    runs, same = distinct_layouts([(0, "per_doc"), (0, "same"), (0, "flashcp")], batches)
    assert runs == [(0, "per_doc"), (0, "flashcp")]
    assert same == {(0, "per_doc"): (0, "per_doc"), (0, "same"): (0, "per_doc"),
                    (0, "flashcp"): (0, "flashcp")}


def test_every_data_set_with_two_batches_is_in_both_halves():
    from bench.model_check import CPU_MODEL, make_batches

    datasets = ("one doc", "8-token docs", "wlbllm")
    batches = make_batches(datasets, (2, 3), 1, 64, CPU_MODEL, ("flashcp",), "cpu-torch", "gloo-local")
    for ds in datasets:
        assert {b["held_out"] for b in batches if b["dataset"] == ds} == {True, False}, ds
