"""The segments path and the segment ring under a sliding window, natively
(``worker_runtime/paths/window_pieces.py``): which path a windowed call takes, the calls
dropped and the ring steps skipped, and one process's windowed piece calls against a dense
masked float64 reference. The gloo worlds (exactness, bytes and KV peak against
``core/window_work.py``) are tests/test_runtime_windows.py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_cases import max_abs, random_plan, solve_any

from planner_service.core.paths import ExecutionPath
from worker_runtime import build_layout
from worker_runtime.aten_flash import AtenSegments
from worker_runtime.paths import PATHS, windowed_path
from worker_runtime.paths.base import standalone_context
from worker_runtime.paths.segment_kernels import ReferenceSegments
from worker_runtime.window_map import ring_steps

CPU = torch.device("cpu")


def test_windowed_path_native_on_positional_kernels_only() -> None:
    ref = ReferenceSegments()
    assert windowed_path(ExecutionPath.SEGMENTS, ref) == ExecutionPath.SEGMENTS
    assert windowed_path(ExecutionPath.SEGMENT_RING, ref) == ExecutionPath.SEGMENT_RING
    for kernel in (None, AtenSegments.__new__(AtenSegments)):
        for path in (ExecutionPath.SEGMENTS, ExecutionPath.SEGMENT_RING):
            assert windowed_path(path, kernel) == ExecutionPath.GATHERED
    assert windowed_path(ExecutionPath.LEAN, ref) == ExecutionPath.LEAN
    assert windowed_path(ExecutionPath.RING, None) == ExecutionPath.RING


def _state(plan, rank: int, mode: str, path: ExecutionPath, window: int | None):
    ctx = standalone_context(build_layout(plan, rank), mode, CPU, ReferenceSegments())
    return PATHS[path].build(ctx._replace(window=window)), ctx.layout


@pytest.mark.parametrize("window", [1, 3, 7, 10_000])
def test_segment_ring_stops_after_steps_run(window: int) -> None:
    plan = random_plan(5, 5)
    for rank in range(plan.cp_size):
        state, layout = _state(plan, rank, "p2p_ring", ExecutionPath.SEGMENT_RING, window)
        causal, _ = _state(plan, rank, "p2p_ring", ExecutionPath.SEGMENT_RING, None)
        useful, last = ring_steps(layout, window)
        assert state.num_steps == last and len(state.steps) == last
        shifts = PATHS[ExecutionPath.SEGMENT_RING].planned_transfers(state)[0].times
        assert shifts == 3 * last
        for s, parts in enumerate(state.steps, start=1):
            # A step with no key inside this rank's windows runs no call.
            assert bool(parts) == bool(useful[layout.slot, s]), (rank, s)
            assert len(parts) <= len(causal.steps[s - 1])
        if window == 1:
            assert last == 0 and all(c.causal for c in state.segments.plan.calls)
    assert causal.num_steps is None and len(causal.steps) == plan.cp_size - 1


@pytest.mark.parametrize("mode", ["alltoallv", "compact_allgather"])
def test_segments_path_keeps_only_halo_gaps(mode: str) -> None:
    """W = 1: no remote key and no local full call is in any window; a wider window keeps
    the remote buffer to the halo (what all-to-all-v receives), never more calls than causal."""
    plan = random_plan(4, 4)
    for rank in range(plan.cp_size):
        one, _ = _state(plan, rank, mode, ExecutionPath.SEGMENTS, 1)
        assert len(one.select) == 0 and all(c.causal for c in one.plan.calls)
        seven, layout = _state(plan, rank, mode, ExecutionPath.SEGMENTS, 7)
        halo, _ = _state(plan, rank, "alltoallv", ExecutionPath.SEGMENTS, 7)
        causal, _ = _state(plan, rank, mode, ExecutionPath.SEGMENTS, None)
        assert len(seven.select) == len(halo.select) <= len(causal.select)
        assert len(seven.plan.calls) <= len(causal.plan.calls)


def _dense(q, k, v, q_doc, q_pos, k_doc, k_pos, window):
    h, g = q.shape[1], k.shape[1]
    kk, vv = (x.repeat_interleave(h // g, dim=1) for x in (k, v))
    mask = ((q_doc[:, None] == k_doc[None, :]) & (k_pos[None, :] <= q_pos[:, None])
            & (k_pos[None, :] > q_pos[:, None] - window))
    s = torch.einsum("qhd,khd->hqk", q, kk) / q.shape[-1] ** 0.5
    p = torch.softmax(s.masked_fill(~torch.as_tensor(mask), -torch.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, vv)


@pytest.mark.parametrize(("window", "seed"), [(1, 0), (2, 1), (7, 2), (128, 3), (7, 4)])
def test_local_segment_ring_matches_dense(window: int, seed: int) -> None:
    """The windowed segment ring's calls on every block of one process (no transfer,
    ``LocalSegmentRingAttention``) against the dense windowed mask: forward and backward
    within 1e-10, GQA."""
    from worker_runtime.paths.ring_steps import slot_rows
    from worker_runtime.paths.segment_ring import LocalSegmentRingAttention

    plan = random_plan(3, 3 + seed) if seed % 2 else solve_any([40, 9, 25, 3], 3, "flashcp")
    gen = torch.Generator().manual_seed(seed)
    for rank in range(plan.cp_size):
        state, layout = _state(plan, rank, "p2p_ring", ExecutionPath.SEGMENT_RING, window)
        t, r, n = layout.num_tokens, layout.num_real, layout.num_ranks
        blocks = [slot_rows(layout, (layout.slot - s) % n) for s in range(n)]
        q = torch.randn(t, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        kb = torch.randn(n, t, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        vb = torch.randn(n, t, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        w = torch.randn(t, 4, 8, generator=gen, dtype=torch.float64)
        out = LocalSegmentRingAttention.apply(q, kb, vb, state, 8 ** -0.5)
        used = len(state.steps) + 1  # blocks past steps_run hold no key in any window
        k_doc = np.concatenate([b[0] for b in blocks[:used]])
        k_pos = np.concatenate([b[1] for b in blocks[:used]])
        ref = _dense(q[:r], kb[:used].reshape(-1, 2, 8), vb[:used].reshape(-1, 2, 8),
                     layout.doc_ids[:r], layout.positions[:r], k_doc, k_pos, window)
        assert max_abs(out[:r] - ref) < 1e-10
        got = torch.autograd.grad((out[:r] * w[:r]).sum(), (q, kb, vb))
        want = torch.autograd.grad((ref * w[:r]).sum(), (q, kb, vb), allow_unused=True)
        for a, b in zip(got, want, strict=True):
            assert max_abs(a - (torch.zeros_like(a) if b is None else b)) < 1e-10


@pytest.mark.parametrize("mode", ["full", "alltoallv", "compact_allgather"])
@pytest.mark.parametrize(("window", "seed"), [(1, 0), (3, 1), (7, 2), (128, 3)])
def test_local_segments_matches_dense(mode: str, window: int, seed: int) -> None:
    """The windowed segments path's calls in one process (``LocalSegmentAttention`` on the
    local buffer and the remote buffer of the window's exchange) against the dense
    windowed mask over the same keys: forward and backward within 1e-10, GQA."""
    from worker_runtime.paths.segments import LocalSegmentAttention

    plan = random_plan(4, 4 + seed) if seed % 2 else solve_any([40, 9, 25, 3, 60], 4, "flashcp")
    gen = torch.Generator().manual_seed(seed)
    for rank in range(plan.cp_size):
        state, layout = _state(plan, rank, mode, ExecutionPath.SEGMENTS, window)
        comm, p = state.exchanger.comm, state.plan
        doc = np.concatenate((layout.doc_ids[p.local_rows], comm.remote_doc[p.remote_order]))
        pos = np.concatenate((layout.positions[p.local_rows], comm.remote_pos[p.remote_order]))
        r, far = len(p.local_rows), len(p.remote_order)
        q = torch.randn(r, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(r + far, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
                for _ in range(2))
        w = torch.randn(r, 4, 8, generator=gen, dtype=torch.float64)
        out = LocalSegmentAttention.apply(q, k[:r], v[:r], k[r:], v[r:], state, 8 ** -0.5)
        ref = _dense(q, k, v, doc[:r], pos[:r], doc, pos, window)
        assert max_abs(out - ref) < 1e-10
        got = torch.autograd.grad((out * w).sum(), (q, k, v))
        want = torch.autograd.grad((ref * w).sum(), (q, k, v))
        for a, b in zip(got, want, strict=True):
            assert max_abs(a - b) < 1e-10, (rank, mode, window)


MASK_LAYERS = [{"window": 7, "count": 2}, {"window": 64, "count": 1}, {"window": None, "count": 1}]
"""A mixed mask: the runtime's forward tokens per layer type, summed over its layers, must
be the plan's ``mask_figures_of`` per rank."""


def mask_worker(rank: int, world_size: int, plan_json: str) -> dict:
    from planner_service.core.mask import parse_layers
    from planner_service.core.plan import Plan
    from worker_runtime import ContextParallelAttention

    plan, mask = Plan.from_json(plan_json), parse_layers(MASK_LAYERS)
    gen = torch.Generator().manual_seed(0)
    total = sum(plan.doc_lengths)
    glob = [torch.randn(total, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2)]
    got = {}
    for mode in ("alltoallv", "compact_allgather", "p2p_ring"):
        attn = ContextParallelAttention(plan, comm_mode=mode, segment_kernel=ReferenceSegments())
        tokens = 0
        for group in mask.groups:
            attn.counter.reset()
            local = [attn.dispatch(t).requires_grad_() for t in glob]
            attn(*local, window=group.window).sum().backward()
            tokens += group.layers * attn.counter.forward_tokens
        got[mode] = (attn.layout.slot, tokens, attn.num_tokens)
    return got


def test_mask_tokens_equal_the_plans_figures() -> None:
    from planner_service.core import cost
    from planner_service.core import window_work as ww
    from planner_service.core.mask import parse_layers
    from worker_runtime.testing import run_distributed

    plan = solve_any([150, 31, 7, 90, 12], 3, "contiguous_halo")
    arrays = cost.shard_arrays(plan.groups[0].shards)
    for got in run_distributed(mask_worker, 3, plan.to_json(), timeout_s=120):
        for mode, (slot, tokens, t) in got.items():
            figures = ww.mask_figures_of(arrays, parse_layers(MASK_LAYERS), comm_mode=mode,
                                         tokens_per_rank=t, skip_ring_steps=True)
            assert tokens == figures.recv[slot], (mode, slot, tokens, figures.recv)
