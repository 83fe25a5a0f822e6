"""FCP cost model (eq. 7-10), named profiles and the least-squares profile fit."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from planner_service.core.model import ModelSpec
from planner_service.core.profiles import get_kernel_profile, get_link_profile
from planner_service.core.step_time import PATH_MODELS, forward_share
from planner_service.fcp.cost_model import (
    PROFILES,
    FcpProfile,
    attention_units,
    derive_profile,
    get_profile,
    group_time,
    load_profile,
    profile_path,
    time_table,
)
from planner_service.fcp.fit import (
    TIMINGS_FORMAT,
    fit_profile,
    load_timings,
    record_units,
    synthetic_timings,
)

FITTED = ("alpha1", "eta_full", "alpha2", "beta1", "alpha3", "bandwidth_gbps", "beta2")


def _toy(**changes) -> FcpProfile:
    base = FcpProfile(
        name="toy", alpha1=1e-3, eta_full=1.0, alpha2=0.5, beta1=2.0, alpha3=1e6,
        bandwidth_gbps=1.0, inter_node_bandwidth_gbps=0.5, ranks_per_node=4, beta2=3.0,
        source="hand-made for tests",
    )
    return dataclasses.replace(base, **changes)


def test_group_time_matches_hand_computed_terms():
    p = _toy()
    # S = 100 tokens, W = 10_000 units, d = 2 (one node): attn = 1e-3 * 1e4 / 2 = 5,
    # compute = 5 + 0.5 * 100 / 2 + 2 = 32, wire = 1e6 * 100 * (1/2) / (1.0 * 1e6) = 50,
    # comm = 53; overlap "none" (flash-attn blocks): nothing hidden, total = 85.
    t = group_time(100, 10_000, 2, p)
    assert (t.compute_ms, t.comm_ms, t.overlap_ms, t.total_ms) == pytest.approx((32, 53, 0, 85))
    # The PyTorch kernel's ring: the backward K/V third hides beside the accumulators, the
    # forward third behind phi x attention of d - 1 of d steps: 50/3 + min(50/3, 0.25 * 5 / 2).
    ring = group_time(100, 10_000, 2, _toy(overlap="ring", forward_share=0.25))
    assert ring.overlap_ms == pytest.approx(50 / 3 + 0.625)
    assert ring.total_ms == pytest.approx(85 - 50 / 3 - 0.625)
    # d = 1: no comm at all.
    assert group_time(100, 10_000, 1, p).total_ms == pytest.approx(10 + 50 + 2)
    # d = 8 > ranks_per_node: inter-node bandwidth 0.5 GB/s doubles the wire time.
    t8 = group_time(100, 10_000, 8, p)
    assert t8.comm_ms == pytest.approx(1e6 * 100 * 7 / 8 / 0.5e6 + 3)


def test_the_ring_hides_at_most_two_thirds_of_the_wire():
    p = _toy(alpha3=1.0, overlap="ring", forward_share=0.5)  # tiny wire: attention covers it
    t = group_time(100, 10_000, 2, p)
    wire = 100 * 0.5 / 1e6
    assert t.overlap_ms == pytest.approx(2 * wire / 3)
    assert t.total_ms == pytest.approx(t.compute_ms + p.beta2 + wire / 3)


def test_the_ring_hides_all_but_the_last_accumulator_when_attention_covers_it():
    p = _toy(alpha3=1.0, overlap="ring", forward_share=0.5)  # d = 4: 3 accumulators, 2 hidden
    t = group_time(100, 10_000, 4, p)
    wire = 100 * 3 / 4 / 1e6
    assert t.overlap_ms == pytest.approx(wire / 3 + wire / 3 + (wire / 3) * 2 / 3)
    assert t.total_ms == pytest.approx(t.compute_ms + p.beta2 + wire / 9)


def test_the_segments_path_hides_behind_the_attention_on_own_keys():
    # "local": the backward K/V third is not on the wire; forward K/V hides behind
    # phi x attn / d (the rank's own keys), dK/dV behind (1 - phi) x attn / d.
    p = _toy(overlap="local", forward_share=0.25)
    # attn = 1e-3 * 1e4 / 2 = 5, own = 2.5; wire = 50: 50/3 + min(50/3, 0.625) + min(50/3, 1.875).
    t = group_time(100, 10_000, 2, p)
    assert t.overlap_ms == pytest.approx(50 / 3 + 0.625 + 1.875)
    assert t.total_ms == pytest.approx(32 + 53 - 50 / 3 - 2.5)
    # A tiny wire hides whole behind the attention: only the latency is left.
    small = group_time(100, 10_000, 4, _toy(alpha3=1.0, overlap="local", forward_share=0.5))
    assert small.total_ms == pytest.approx(small.compute_ms + 3.0)
    # d = 8: own keys are 1/8 of attn = 1e-3 * 1e4 / 8 = 1.25.
    t8 = group_time(100, 10_000, 8, _toy(overlap="local", forward_share=0.5))
    third = 1e6 * 100 * 7 / 8 / 0.5e6 / 3
    assert t8.overlap_ms == pytest.approx(third + 2 * min(third, 0.5 * 1.25 / 8))


def test_overlap_follows_the_runtime_kernel():
    # flash-attn (the H100 profiles) runs the segments path, overlapped with the attention
    # on the rank's own keys; the PyTorch kernel a ring.
    assert {n: p.overlap for n, p in PROFILES.items()} == {
        "h100-llama3-8b": "local", "h100-llama3-8b-fa2": "local", "h100-llama3-8b-ib": "local",
        "h100-llama3-8b-aten-fa2": "local", "h200-llama3-8b-aten-fa2": "local", "cpu-gloo": "ring"}
    assert 0 < PROFILES["cpu-gloo"].forward_share < 1
    assert PROFILES["h100-llama3-8b"].forward_share == pytest.approx(
        forward_share(get_kernel_profile("h100-fa3")))
    # Each path's rule; the gathered flash path (opt-out) hides nothing; both rings the ring's.
    assert {p: m.hides for p, m in PATH_MODELS.items()} == {
        "segments": "local", "gathered": "none", "lean": "local", "ring": "ring",
        "segment_ring": "ring"}
    # A derived profile takes the path FCP's own (gather) exchange runs on under flash-attn,
    # not the segment ring a p2p_ring plan runs as; the PyTorch kernel's ring.
    assert [profile_path(get_kernel_profile(k)) for k in ("h100-fa3", "h100-fa2", "cpu-torch")] == [
        "segments", "segments", "ring"]
    derived = derive_profile("x", kernel=get_kernel_profile("h100-fa2"), link=get_link_profile("nvlink"),
                             inter_link=get_link_profile("infiniband"), model=ModelSpec(),
                             ranks_per_node=8)
    assert derived == dataclasses.replace(PROFILES["h100-llama3-8b-fa2"], name="x",
                                          source=derived.source)
    with pytest.raises(ValueError, match="profile.overlap"):
        _toy(overlap="full")
    with pytest.raises(ValueError, match="profile.forward_share"):
        _toy(forward_share=1.5)
    # A profile written without the fields reads as nothing hidden.
    data = {k: v for k, v in PROFILES["cpu-gloo"].to_dict().items()
            if k not in ("overlap", "forward_share")}
    assert FcpProfile.from_dict(data).overlap == "none"


@pytest.mark.parametrize("name", ["h100-llama3-8b", "cpu-gloo"])
def test_time_table_equals_the_scalar_reference_and_enforces_memory(name):
    p = PROFILES[name]
    rng = np.random.default_rng(0)
    tokens = rng.integers(1000, 200_000, size=6)
    units = tokens.astype(float) ** 2 * rng.uniform(0.1, 1.0, size=6)
    table = time_table(tokens, units, 16, 32768, p)
    for i in range(6):
        for d in range(1, 17):
            if tokens[i] > d * 32768:
                assert np.isinf(table[i, d])
            else:
                assert table[i, d] == pytest.approx(group_time(tokens[i], units[i], d, p).total_ms)
    assert np.isinf(table[:, 0]).all()


def test_full_attention_counts_one_plus_eta_times_the_squares():
    p = PROFILES["h100-llama3-8b"]
    assert attention_units([3, 4], full=False, profile=p) == 25.0
    assert attention_units([3, 4], full=True, profile=p) == 25.0 * (1 + p.eta_full)


def test_h100_profile_derivation():
    p = PROFILES["h100-llama3-8b"]
    # 0.5 * 4 * 32 heads * 128 dim * (1/650e12 + 2.5/450e12) s, in ms.
    assert p.alpha1 == pytest.approx(0.5 * 4 * 32 * 128 * (1 / 650e12 + 2.5 / 450e12) * 1e3)
    assert p.alpha3 == 3 * 2 * 8 * 128 * 2  # fwd KV + bwd KV and dKV, bf16, 8 KV heads
    assert p.bandwidth_for(8) == 370.0 and p.bandwidth_for(9) == 45.0


def test_rejects_unknown_profile_names_listing_the_valid_ones():
    with pytest.raises(ValueError, match="h100-llama3-8b"):
        get_profile("nope")


def test_rejects_negative_coefficients_naming_the_field():
    with pytest.raises(ValueError, match="profile.alpha2"):
        _toy(alpha2=-1.0)
    with pytest.raises(ValueError, match="profile.bandwidth_gbps"):
        _toy(bandwidth_gbps=0.0)


def test_profile_json_round_trip_through_a_file(tmp_path):
    p = PROFILES["h100-llama3-8b-ib"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**p.to_dict(), "fit": {"anything": 1}}))
    assert load_profile(path) == p
    assert get_profile(f"file:{path}") == p
    path.write_text("{}")
    with pytest.raises(ValueError, match="missing fields"):
        load_profile(path)


@pytest.mark.parametrize("name", sorted(PROFILES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_known_coefficients_within_5_percent(name, seed):
    truth = PROFILES[name]
    report = fit_profile(synthetic_timings(truth, seed=seed, noise=0.05), name="fit", base=truth)
    for key in FITTED:
        assert getattr(report.profile, key) == pytest.approx(getattr(truth, key), rel=0.05), key
    # The reported standard errors agree (alpha2's attention share is a small part of
    # alpha2 and is not separately identifiable on every profile).
    assert all(t.rel_error < 0.05 for t in report.terms
               if t.rel_error is not None and t.name != "alpha2_attn")


def test_fit_keeps_base_terms_without_records_and_says_so():
    truth = PROFILES["h100-llama3-8b"]
    data = synthetic_timings(truth, seed=0)
    data["records"] = [r for r in data["records"] if r["op"] == "attention" and r["causal"]]
    report = fit_profile(data, name="fit", base=PROFILES["cpu-gloo"])
    how = {t.name: t.how for t in report.terms}
    assert "kept from cpu-gloo" in how["eta_full"] and "kept from cpu-gloo" in how["beta2"]
    assert "not fitted" in how["alpha2_linear"]
    assert report.profile.alpha1 == pytest.approx(truth.alpha1, rel=0.05)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(format="v0"), "timings.format"),
        (lambda d: d.update(records=[]), "timings.records"),
        (lambda d: d["records"][0].update(op="matmul"), r"records\[0\].op"),
        (lambda d: d["records"][0].pop("ms"), r"records\[0\].ms"),
        (lambda d: d["records"][0].update(degree=0), r"records\[0\].degree"),
        (lambda d: d["records"][0].update(causal="yes"), r"records\[0\].causal"),
    ],
)
def test_rejects_malformed_timings_naming_the_field(change, message, tmp_path):
    data = synthetic_timings(PROFILES["cpu-gloo"], seed=0)
    change(data)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        load_timings(path)


def test_record_units_split_docs_evenly_unless_listed():
    assert record_units({"seq_tokens": 10, "num_docs": 3}) == 4**2 + 3**2 + 3**2
    assert record_units({"seq_tokens": 10, "num_docs": 3, "doc_lengths": [8, 1, 1]}) == 66


def test_fits_timings_written_by_the_worker_runtime_profiler():
    """Real (tiny) CPU timings from worker_runtime.profiler in its own file format."""
    torch = pytest.importorskip("torch")
    profiler = pytest.importorskip("worker_runtime.profiler")
    from planner_service import PlanRequest, solve
    from planner_service.fcp.cost_model import DEBUG_MODEL

    records = []
    for length, docs in ((64, 1), (128, 1), (256, 2)):
        for degree in (1, 2):
            plan = solve(PlanRequest(doc_lengths=(length // docs,) * docs, cp_size=degree,
                                     model=DEBUG_MODEL))
            records += profiler.attention_records(plan, model=DEBUG_MODEL, repeats=1)
    doc = profiler.timings_document(records, device="cpu", dtype=torch.float32, model=DEBUG_MODEL)
    assert doc["format"] == TIMINGS_FORMAT
    report = fit_profile(doc, name="cpu-real", base=PROFILES["cpu-gloo"])
    assert report.terms[0].how == f"fitted ({len(records)} attention records)"
    assert np.isfinite(report.residual_pct["attention"])
