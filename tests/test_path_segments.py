"""The flash path (segments): its decomposition (brute force), the segment kernels, one-process
simulation of whole plans, the fallback when flash-attn's private API is unusable, and the
path on spawned gloo worlds of 3, 5 and 8 ranks with the exact reference kernel in float64
(outputs, gradients, bytes and the KV counter against the plan). GPU: flash-attn's adapter
against the reference in bf16.
"""

from __future__ import annotations

import inspect
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from runtime_cases import (
    KV_ROW_ELEMS,
    MULTI_GROUPS,
    bf16_against_reference,
    covered_pairs,
    flash_standin,
    flash_standin_backward,
    install_flash,
    max_abs,
    multi_group_plan,
    needs_flash,
    random_doc_lengths,
    random_plan,
    rank_path_state,
    reference_case,
    run_against_reference,
    solve_any,
)
from timing import scaled

from planner_service.core.model import ModelSpec
from planner_service.core.plan import Plan
from planner_service.core.request import PlanRequest
from planner_service.solvers.registry import solve, strategy_names
from worker_runtime import (
    GATHER_MODES,
    ContextParallelAttention,
    build_comm_map,
    build_layout,
    planned_kv_tokens_peak,
    planned_recv_tokens,
    reference_attention,
)
from worker_runtime.paths import PATHS
from worker_runtime.paths import segment_kernels as segkernels
from worker_runtime.paths.pieces import build_segment_plan
from worker_runtime.paths.segment_kernels import (
    FlashApiError,
    ReferenceSegments,
    check_params,
    flash_segments,
    load_flash_api,
    probe,
)
from worker_runtime.simulate import simulate_segments
from worker_runtime.testing import run_distributed

MODEL = ModelSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype_bytes=8)
TOL = 1e-10
TE_BF16_TOL = 2.5e-2


# -- the decomposition ---------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 4))
def test_calls_cover_every_document_mask_pair_exactly_once(seed: int, cp_size: int) -> None:
    plan = random_plan(seed, cp_size)
    for rank in range(cp_size):
        lay = build_layout(plan, rank)
        comm = build_comm_map(lay, "alltoallv")
        seg = build_segment_plan(lay, comm)
        want = sorted((d, p, kp) for d, s, e in lay.shards for p in range(s, e) for kp in range(p + 1))
        assert sorted(covered_pairs(lay, comm, seg)) == want
        # Every key row in exactly one buffer: own tokens plus the distinct remote KV.
        assert sorted(seg.local_rows.tolist()) == list(range(lay.num_real))
        assert sorted(seg.remote_order.tolist()) == list(range(len(comm.remote_index)))
        counts: dict[int, int] = {}
        for d, _, _ in lay.shards:
            counts[d] = counts.get(d, 0) + 1
        m = max(counts.values(), default=0)
        assert seg.num_local_calls == m * (m + 1) // 2
        assert len(seg.calls) <= m * (m + 1)
        assert seg.in_place or m > 1


# -- segment kernels -----------------------------------------------------------------------


def dense_segments(q, k, v, lq, lk, causal, scale):
    """Each segment alone, the obvious way: ``(out, lse [H, T])``; NaN/-inf without keys."""
    outs, lses, q0, k0 = [], [], 0, 0
    r = q.shape[1] // k.shape[1]
    for nq, nk in zip(lq, lk, strict=True):
        qs, ks, vs = q[q0 : q0 + nq], k[k0 : k0 + nk], v[k0 : k0 + nk]
        s = torch.einsum("qhd,khd->hqk", qs, ks.repeat_interleave(r, 1)) * scale
        allowed = torch.ones(nq, nk, dtype=torch.bool)
        if causal:
            allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
        s = s.masked_fill(~allowed, -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vs.repeat_interleave(r, 1)))
        lses.append(torch.logsumexp(s, dim=-1))
        q0, k0 = q0 + nq, k0 + nk
    return torch.cat(outs), torch.cat(lses, dim=1)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=5),
       st.booleans(), st.sampled_from([(2, 1), (4, 2), (3, 3)]))
def test_reference_segments_equal_dense_segments_with_lse_and_part_gradients(segments, causal, heads) -> None:
    """Segments of any size: zero-query ones (their keys get zero gradients) and hollow ones
    (no keys: -inf lse) included."""
    lq = [a for a, _ in segments]
    assume(sum(lq) > 0)
    lk = [a + b for a, b in segments] if causal else [b for _, b in segments]
    h, g = heads
    gen = torch.Generator().manual_seed(sum(lq) + 7 * sum(lk))
    q = torch.randn(sum(lq), h, 4, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(sum(lk), g, 4, generator=gen, dtype=torch.float64) for _ in "kv")
    kern = ReferenceSegments()
    meta = kern.meta(np.cumsum([0, *lq]), np.cumsum([0, *lk]), causal, torch.device("cpu"))
    out, lse = kern.forward(q, k, v, meta, 0.3)
    want_out, want_lse = dense_segments(q, k, v, lq, lk, causal, 0.3)
    seen = torch.from_numpy(np.repeat(np.array(lk) > 0, lq))
    assert max_abs(out[seen] - want_out[seen]) <= 1e-12
    assert max_abs(lse[:, seen] - want_lse[:, seen]) <= 1e-12
    assert torch.isneginf(lse[:, ~seen]).all()
    # A single part is the whole attention: its backward is autograd's.
    if seen.all():
        dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o2, _ = dense_segments(*leaves, lq, lk, causal, 0.3)
        want = torch.autograd.grad((o2 * dout).sum(), leaves)
        got = kern.backward(dout, q, k, v, out, lse, meta, 0.3)
        for a, b in zip(got, want, strict=True):
            assert (a - b).abs().max().item() <= 1e-12


FAST_STRATEGIES = [s for s in strategy_names() if s not in ("ilp", "auto")]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.integers(1, 5),
       st.sampled_from(FAST_STRATEGIES))
def test_simulated_segments_equal_reference_for_whole_plans(lengths, cp_size, strategy) -> None:
    plan = solve(PlanRequest(doc_lengths=lengths, cp_size=cp_size, strategy=strategy, model=MODEL))
    gen = torch.Generator().manual_seed(len(lengths))
    s = sum(lengths)
    q, k, v = (torch.randn(s, h, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    w = torch.randn(s, 4, 8, generator=gen, dtype=torch.float64)
    ref = reference_attention(q, k, v, lengths)
    out = simulate_segments(plan, q, k, v, ReferenceSegments())
    assert (out - ref).abs().max().item() <= 1e-12
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max().item() <= 1e-12


# -- flash-attn's adapter on CPU (a stand-in API) and the fallback ----------------------------


def test_flash_adapter_passes_the_probe_and_runs_plans_with_flash_conventions(monkeypatch) -> None:
    """The adapter's calls (keywords, lse layout, in-place gradients, +inf for queries
    without keys) through a stand-in with flash-attn's contract, float32 on CPU."""
    install_flash(monkeypatch, flash_standin, flash_standin_backward)
    kern = flash_segments(torch.device("cpu"), torch.float32, 8)
    assert kern is not None and kern.name == "flash"
    lengths = [1, 30, 7, 52, 3, 19]
    plan = solve(PlanRequest(doc_lengths=lengths, cp_size=3, strategy="llama3", model=MODEL))
    layouts = [build_layout(plan, r) for r in range(3)]
    calls = [c for lay in layouts for c in build_segment_plan(lay, build_comm_map(lay, "full")).calls]
    assert any(len(c.empty) for c in calls), "a remote call has queries without keys"
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(112, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    w = torch.randn(112, 4, 8, generator=gen, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*leaves, lengths)
    want = torch.autograd.grad((ref * w).sum(), leaves)
    low = [x.float().requires_grad_() for x in (q, k, v)]
    out = simulate_segments(plan, *low, kern)
    got = torch.autograd.grad((out.double() * w).sum(), low)
    assert max_abs(out.double() - ref) <= 1e-5
    assert max(max_abs(a.double() - b) for a, b in zip(got, want, strict=True)) <= 1e-4


def test_flash_segments_fall_back_with_one_warning(monkeypatch) -> None:
    def old_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                    softmax_scale, causal, window_size=(-1, -1)):
        raise AssertionError("never called: the signature check fails first")

    install_flash(monkeypatch, old_forward, old_forward)
    with pytest.raises(FlashApiError, match="lacks parameters"):
        load_flash_api()
    with pytest.warns(RuntimeWarning, match="falling back to the gathered path") as record:
        assert flash_segments(torch.device("cpu"), torch.bfloat16, 64) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert flash_segments(torch.device("cpu"), torch.float16, 64) is None  # no second warning
    assert len(record) == 1
    plan = solve(PlanRequest(doc_lengths=[5, 3], cp_size=1, strategy="flashcp", model=MODEL))
    attn = ContextParallelAttention(plan, kernel="flash")
    q = torch.zeros(attn.num_tokens, 4, 64, dtype=torch.bfloat16)
    assert attn.execution_path(q) == ("gathered", None)
    assert ContextParallelAttention(plan).execution_path(q.float()) == ("lean", None)
    kern = ReferenceSegments()
    assert ContextParallelAttention(plan, segment_kernel=kern).execution_path(q) == ("segments", kern)


def test_probe_refuses_a_kernel_with_another_lse_layout(monkeypatch) -> None:
    def padded_lse(*args, **kwargs):  # older flash-attn: lse [batch, H, max_seqlen_q]
        out, lse, s, rng = flash_standin(*args, **kwargs)
        return out, torch.zeros(2, lse.shape[0], kwargs["max_seqlen_q"]), s, rng

    padded_lse.__signature__ = inspect.signature(flash_standin)
    install_flash(monkeypatch, padded_lse, flash_standin_backward)
    with pytest.warns(RuntimeWarning, match=r"forward returned out \(5, 2, 16\), lse \(2, 2, 3\)"):
        assert flash_segments(torch.device("cpu"), torch.float32, 16) is None
    probe(ReferenceSegments(), torch.device("cpu"), torch.bfloat16, 16)  # the reference passes


def test_rejects_unknown_flash_path_and_bad_signatures() -> None:
    plan = solve(PlanRequest(doc_lengths=[5, 3], cp_size=1, strategy="flashcp", model=MODEL))
    with pytest.raises(ValueError, match="flash_path must be one of segments, gathered"):
        ContextParallelAttention(plan, flash_path="blocks")
    with pytest.raises(FlashApiError, match=r"lacks parameters \['softmax_lse'"):
        check_params(lambda dout, q, k, v, out: None, segkernels.BACKWARD_PARAMS[:6], "bwd")


# -- spawned gloo worlds ---------------------------------------------------------------------

STRATEGIES = ("flashcp", "per_doc", "zigzag", "llama3")
CASES = [(mode, overlap) for mode in GATHER_MODES for overlap in (True, False)] + [("p2p_ring", True)]
"""(comm mode, overlap); a ring plan runs as the segment ring (test_path_segment_ring.py)."""


def plans_for(world_size: int) -> list[Plan]:
    lengths = random_doc_lengths(200 + world_size, world_size)
    plans = [solve_any(lengths, world_size, s) for s in STRATEGIES]
    if world_size in MULTI_GROUPS:
        plans.append(multi_group_plan(lengths, MULTI_GROUPS[world_size], world_size))
    return plans


def worker(rank: int, world_size: int, plan_jsons: list[str]) -> dict:
    results = {}
    kern = ReferenceSegments()
    for ci, text in enumerate(plan_jsons):
        plan = Plan.from_json(text)
        case = reference_case(plan, ci)
        for mode, overlap in CASES:
            attn = ContextParallelAttention(plan, comm_mode=mode, overlap=overlap, segment_kernel=kern)
            _, errors = run_against_reference(attn, case)
            c = attn.counter
            results[(ci, mode, overlap)] = {
                "errors": errors, "bytes": (c.forward_bytes, c.backward_bytes), "peak": c.kv_tokens_peak,
                "path": attn.execution_path(attn.dispatch(case.q))[0],
            }
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 5, 8])
def test_segments_path_is_exact_with_plan_bytes_and_kv_peak(world_size: int) -> None:
    plans = plans_for(world_size)
    per_rank = run_distributed(worker, world_size, [p.to_json() for p in plans], timeout_s=scaled(240.0))
    row_bytes = KV_ROW_ELEMS * 8
    for ci, plan in enumerate(plans):
        for mode, overlap in CASES:
            ring = mode == "p2p_ring"
            for rank, res in enumerate(per_rank):
                got = res[(ci, mode, overlap)]
                where = f"{plan.strategy} {mode} overlap={overlap} rank {rank}"
                assert got["path"] == ("segment_ring" if ring else "segments"), where
                assert max(got["errors"]) <= TOL, f"{where}: errors {got['errors']}"
                want = planned_recv_tokens(plan, rank, "full" if ring else mode) * row_bytes
                assert got["bytes"] == (want, 2 * want if ring else want), f"{where}: {got['bytes']} != {want}"
                assert got["peak"] == planned_kv_tokens_peak(plan, rank, mode), where
        if plan.comm_mode in GATHER_MODES:
            for group in plan.groups:
                for slot, rank in enumerate(group.ranks):
                    got = per_rank[rank][(ci, plan.comm_mode, True)]["peak"]
                    assert got == group.rank_stats.kv_tokens_peak[slot], f"{plan.strategy} rank {rank}"


# -- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("causal", [True, False])
def test_flash_segments_match_reference_in_bf16(causal: bool) -> None:
    """The adapter per call: out, lse (query rows with keys) and the part gradients given
    a merged (out, lse), against the reference in float32 on the same bf16 inputs."""
    dev = torch.device("cuda")
    kern = flash_segments(dev, torch.bfloat16, 128)
    assert kern is not None, "flash-attn installed but its private varlen API was refused"
    lq = [1, 300, 77, 513]
    lk = [q + e for q, e in zip(lq, [0, 129, 3, 700], strict=True)] if causal else [5, 0, 1000, 64]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(sum(lq), 8, 128, generator=gen, device=dev).to(torch.bfloat16) for _ in "qd")
    k, v = (torch.randn(sum(lk), 2, 128, generator=gen, device=dev).to(torch.bfloat16) for _ in "kv")
    cu_q, cu_k = np.cumsum([0, *lq]), np.cumsum([0, *lk])
    ref = ReferenceSegments()
    meta, ref_meta = kern.meta(cu_q, cu_k, causal, dev), ref.meta(cu_q, cu_k, causal, dev)
    out, lse = kern.forward(q, k, v, meta, 0.09)
    want_out, want_lse = ref.forward(q.float(), k.float(), v.float(), ref_meta, 0.09)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (8, sum(lq))
    seen = torch.from_numpy(np.repeat(np.array(lk) > 0, lq)).to(dev)
    torch.testing.assert_close(out[seen].float(), want_out[seen], atol=TE_BF16_TOL, rtol=TE_BF16_TOL)
    torch.testing.assert_close(lse[:, seen], want_lse[:, seen], atol=TE_BF16_TOL, rtol=TE_BF16_TOL)
    out = torch.where(seen[:, None, None], out, torch.zeros_like(out))
    lse = torch.where(seen[None, :], lse, torch.full_like(lse, -math.inf))
    got = kern.backward(do, q, k, v, out, lse, meta, 0.09)
    want = ref.backward(do.float(), q.float(), k.float(), v.float(), out.float(), lse, ref_meta, 0.09)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        a = a[seen] if name == "dq" else a
        b = b[seen] if name == "dq" else b
        torch.testing.assert_close(a.float(), b, atol=TE_BF16_TOL, rtol=TE_BF16_TOL, msg=name)


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("strategy", ["per_doc", "flashcp", "llama3", "zigzag"])
def test_segments_path_with_flash_matches_reference_in_bf16(strategy: str) -> None:
    """A 4-rank plan, ranks one after another on one GPU, the flash adapter in every call,
    against the float64 reference on the same bf16 inputs (TransformerEngine's CP tolerance)."""
    kern = flash_segments(torch.device("cuda"), torch.bfloat16, 128)
    assert kern is not None
    bf16_against_reference(strategy, lambda plan, *qkv: simulate_segments(plan, *qkv, kern),
                           strategy)


@pytest.mark.parametrize("seed", range(8))
def test_planned_calls_are_the_piece_calls_on_their_buffers(seed: int) -> None:
    """The path lists every piece call (local ones on the local buffer, remote ones on the
    distinct remote KV) and the split exchange of the comm map."""
    plan = random_plan(seed, 4)
    for rank in range(plan.cp_size):
        lay = build_layout(plan, rank)
        comm = build_comm_map(lay, "alltoallv")
        state = rank_path_state(plan, rank, "segments", "alltoallv", ReferenceSegments())
        pieces = build_segment_plan(lay, comm).calls
        calls = PATHS["segments"].planned_calls(state)
        assert [c[2:] for c in calls] == [("remote" if c.remote else "local", c.q_lo, c.q_hi, c.k_lo, c.k_hi)
                                          for c in pieces]
        assert all(c.kind == "segment" for c in calls)
        assert PATHS["segments"].buffers(state) == {"queries": lay.num_real, "local": lay.num_real,
                                                    "remote": len(comm.remote_index)}
        assert [tuple(t) for t in PATHS["segments"].planned_transfers(state)] == [("split", comm.recv_rows, 1)]
