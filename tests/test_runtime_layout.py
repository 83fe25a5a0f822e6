"""Layouts and comm maps in one process: every rank of a plan simulated one after another
(ring-flash-attention's trick), against the dense float64 reference and the planner's
own comm figures. The distributed tests run the same maps over real collectives."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner_service.core.model import ModelSpec
from planner_service.core.plan import Plan
from planner_service.core.request import PlanRequest
from planner_service.solvers.registry import solve, strategy_names
from worker_runtime import (
    GATHER_MODES,
    ContextParallelAttention,
    build_comm_map,
    build_layout,
    expand_ranges,
    planned_recv_tokens,
    reference_attention,
)
from worker_runtime.comm import returned_gradients
from worker_runtime.dispatch import dispatch, undispatch
from worker_runtime.simulate import peer_block, simulate_plan

MODEL = ModelSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype_bytes=8)
FAST_STRATEGIES = [s for s in strategy_names() if s not in ("ilp", "auto")]
"""ilp and auto run a solver with a time limit; the distributed test covers them."""

doc_lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=9)


def make_plan(lengths: list[int], cp_size: int, strategy: str) -> Plan:
    return solve(PlanRequest(doc_lengths=lengths, cp_size=cp_size, strategy=strategy, model=MODEL))


@given(st.lists(st.tuples(st.integers(-50, 50), st.integers(0, 6)), max_size=12))
def test_expand_ranges_equals_concatenated_aranges(ranges: list[tuple[int, int]]) -> None:
    starts = np.array([s for s, _ in ranges], dtype=np.int64)
    lengths = np.array([n for _, n in ranges], dtype=np.int64)
    want = np.concatenate([np.arange(s, s + n) for s, n in ranges] + [np.zeros(0, dtype=np.int64)])
    np.testing.assert_array_equal(expand_ranges(starts, lengths), want)


@settings(max_examples=30, deadline=None)
@given(doc_lengths_st, st.integers(1, 5), st.sampled_from(FAST_STRATEGIES))
def test_layouts_place_every_token_once_with_doc_positions(lengths, cp_size, strategy) -> None:
    plan = make_plan(lengths, cp_size, strategy)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    seen = []
    for rank in range(cp_size):
        lay = build_layout(plan, rank)
        real = lay.global_index[: lay.num_real]
        assert (lay.global_index[lay.num_real :] == -1).all() and (lay.doc_ids[lay.num_real :] == -1).all()
        np.testing.assert_array_equal(real, offsets[lay.doc_ids[: lay.num_real]] + lay.positions[: lay.num_real])
        assert lay.num_real == sum(s.end - s.start for s in plan.rank_shards(rank))
        np.testing.assert_array_equal(np.diff(lay.cu_seqlens_k), [s.end for s in lay.shards])
        seen.append(real)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(sum(lengths)))


@settings(max_examples=30, deadline=None)
@given(doc_lengths_st, st.integers(1, 5), st.sampled_from(FAST_STRATEGIES), st.sampled_from(GATHER_MODES))
def test_simulated_runtime_matches_reference_and_plan_figures(lengths, cp_size, strategy, mode) -> None:
    plan = make_plan(lengths, cp_size, strategy)
    gen = torch.Generator().manual_seed(len(lengths))
    s = sum(lengths)
    q, k, v = (torch.randn(s, h, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    w = torch.randn(s, 4, 8, generator=gen, dtype=torch.float64)
    ref = reference_attention(q, k, v, lengths)
    sim = simulate_plan(plan, mode, q, k, v)
    assert (sim.output - ref).abs().max().item() <= 1e-12
    got = torch.autograd.grad((sim.output * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, r in zip(got, want, strict=True):
        assert (g - r).abs().max().item() <= 1e-12
    assert sim.recv_tokens == tuple(planned_recv_tokens(plan, r, mode) for r in range(cp_size))
    for group in plan.groups:
        lay = build_layout(plan, group.ranks[0])
        assert tuple(lay.arrays.compact_total) == group.rank_stats.allgather_send


def backward_route(plan: Plan, mode: str, d_recv: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """What Exchanger.backward does, in one process: send each receive-buffer gradient
    block to its owner and add it into the owner's local gradient."""
    layouts = [build_layout(plan, r) for r in range(plan.cp_size)]
    maps = [build_comm_map(lay, mode) for lay in layouts]
    d_local = [torch.zeros(lay.num_tokens, rows, dtype=torch.float64) for lay in layouts]

    def peers(lay):  # peers in collective order
        order = np.argsort(np.argsort(lay.group_ranks))
        return [lay.group_ranks[s] for s in np.argsort(order) if lay.group_ranks[s] != lay.rank]

    blocks = {}  # (sender of the gradient, owner) -> rows
    for lay, comm in zip(layouts, maps, strict=True):
        if comm.collective == "none":
            continue
        sizes = [comm.buffer_rows] * len(peers(lay)) if comm.collective == "all_gather" else [
            comm.recv_splits[int(np.argsort(np.argsort(lay.group_ranks))[lay.group_ranks.index(p)])]
            for p in peers(lay)
        ]
        for p, part in zip(peers(lay), torch.split(d_recv[lay.rank], sizes), strict=True):
            blocks[(lay.rank, p)] = part
    for lay, comm in zip(layouts, maps, strict=True):
        if comm.collective == "none":
            continue
        out = torch.cat([blocks[(p, lay.rank)] for p in peers(lay)])
        d_local[lay.rank].index_add_(0, torch.from_numpy(comm.send_index), returned_gradients(comm, out))
    return d_local


@settings(max_examples=30, deadline=None)
@given(doc_lengths_st, st.integers(2, 5), st.sampled_from(FAST_STRATEGIES), st.sampled_from(GATHER_MODES))
def test_backward_maps_are_the_adjoint_of_the_forward_exchange(lengths, cp_size, strategy, mode) -> None:
    """sum_r <recv_r(x), g_r> == sum_r <x_r, back_r(g)>: backward returns every gradient row
    to exactly the local row its forward row came from."""
    plan = make_plan(lengths, cp_size, strategy)
    gen = torch.Generator().manual_seed(cp_size)
    layouts = [build_layout(plan, r) for r in range(cp_size)]
    maps = tuple(build_comm_map(lay, mode) for lay in layouts)
    x = [torch.randn(lay.num_tokens, 3, generator=gen, dtype=torch.float64) for lay in layouts]
    g = [torch.randn(m.recv_rows, 3, generator=gen, dtype=torch.float64) for m in maps]
    lhs = 0.0
    for lay, comm in zip(layouts, maps, strict=True):
        if comm.collective == "none":
            continue
        order = np.argsort(np.argsort(lay.group_ranks))
        senders = [lay.group_ranks[s] for s in np.argsort(order) if lay.group_ranks[s] != lay.rank]
        recv = torch.cat([peer_block(maps, layouts[p], lay, x[p]) for p in senders])
        lhs += float((recv * g[lay.rank]).sum())
    back = backward_route(plan, mode, g, 3)
    rhs = sum(float((xi * bi).sum()) for xi, bi in zip(x, back, strict=True))
    assert abs(lhs - rhs) <= 1e-9 * max(1.0, abs(lhs))


def test_dispatch_then_undispatch_over_all_ranks_restores_the_tensor() -> None:
    plan = make_plan([5, 1, 17, 3, 9], 3, "per_doc")
    x = torch.arange(35.0).reshape(35, 1)
    total = sum(undispatch(build_layout(plan, r), dispatch(build_layout(plan, r), x, pad_value=-1.0))
                for r in range(3))
    torch.testing.assert_close(total, x, rtol=0, atol=0)
    lay = build_layout(plan, 0)
    assert (dispatch(lay, x, pad_value=-1.0)[lay.num_real :] == -1.0).all()


def test_rejects_rank_outside_plan_and_unknown_mode_and_bad_order() -> None:
    plan = make_plan([5, 7], 2, "flashcp")
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 2\)"):
        build_layout(plan, 2)
    with pytest.raises(ValueError, match="comm_mode must be one of"):
        build_comm_map(build_layout(plan, 0), "p2p_ring")
    with pytest.raises(ValueError, match="order must be a permutation"):
        build_comm_map(build_layout(plan, 0), "full", order=[0, 0])
    with pytest.raises(ValueError, match="x must have the plan's 12 tokens"):
        dispatch(build_layout(plan, 0), torch.zeros(11))


def test_index_maps_for_a_128k_plan_at_8_ranks_build_in_milliseconds() -> None:
    """Generous bound (shared CPU); bench/runtime_bench.py reports the real figure."""
    lengths = [40000, 1, 17, 25000, 8191, *([1023] * 40), 3001, 12000]
    lengths.append(131072 - sum(lengths))
    plan = make_plan(lengths, 8, "per_doc")
    for mode in GATHER_MODES:
        best = min(_timed(lambda mode=mode: build_comm_map(build_layout(plan, 7), mode)) for _ in range(5))
        assert best < 0.1, f"{mode}: {best * 1e3:.1f} ms"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_single_rank_plan_runs_without_torch_distributed() -> None:
    lengths = [7, 1, 12]
    plan = make_plan(lengths, 1, "flashcp")
    cp = ContextParallelAttention(plan)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(20, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    out = cp(cp.dispatch(q), cp.dispatch(k), cp.dispatch(v))
    torch.testing.assert_close(cp.undispatch(out), reference_attention(q, k, v, lengths), rtol=0, atol=1e-12)
    assert cp.counter.forward_bytes == 0 and cp.planned_recv_tokens() == 0
