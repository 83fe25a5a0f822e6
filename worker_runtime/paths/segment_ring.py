"""The segment ring (``ExecutionPath.SEGMENT_RING``): ``p2p_ring`` plans on segment
kernels, the ring's N - 1 point-to-point steps with every step's attention as varlen
segment calls (any segment kernel, ``segment_kernels.py``).

Blocks and steps are the ring's (the same step loops, ``ring_steps.ring_forward`` and
``ring_steps.ring_backward``): a block is a slot's whole local K/V, ``T`` rows in plan order,
padding at the end; at step s (1 <= s <= N - 1) the rank holds the block of slot ``i - s``.

Decomposition (numpy, built once per plan; the step-time model prices the same calls):

- step 0: the local buffer, query groups and local calls ``A(j, i)`` of ``pieces.py``
  (own keys), run while the first transfer is in flight;
- step s: plans keep each rank's shards sorted by (doc, start), so a block's real rows are
  sorted by (doc, position) and one document's tokens form one contiguous *run* of the
  block. Shards of one document on different ranks are disjoint, so a local shard
  ``[s, e)`` of document d sees exactly the block's doc-d tokens below ``s``: the first
  ``seen`` rows of d's run, a full rectangle. Per query group j, its documents (buffer
  order: shard count descending, then doc id) split into *classes*, maximal runs of
  documents with the same shard count here; inside a class doc ids ascend, as the
  block's runs do. One full (non-causal) call per (j, class) where some document sees a
  key: the class's documents from the first to the last that see one. Document b's key
  segment is the first ``seen_b`` rows of its run; a document inside the call that sees
  none is *hollow* (key length 0, its rows masked as in ``pieces.py``); where a key
  segment does not start where the previous one ended, a *zero-query* segment (``cu_q``
  repeats) takes the rows in between. So a call reads block rows ``[k_lo, k_hi)`` in
  place: the received block is never copied. Calls of a step: j ascending, then class
  order.

Forward: the local calls give the out/lse accumulators (as the segments path), each step's
calls merge into them by log-sum-exp (hollow rows masked). Backward re-circulates the
blocks as the ring does: per step the calls' backward adds dQ into the dQ accumulator
and dK/dV of block rows ``[k_lo, k_hi)`` (zero-query rows get 0) into a ``T``-row dK/dV
accumulator that travels with the block; the previous step's accumulator is waited for
after this step's kernels. Bytes per step, the counter's history and ``kv_tokens_peak``
(own + T x (2 if s < N - 1 else 1)) are the ring's; nothing remote is kept between passes.
Copies: the local buffer only, as on the segments path (one ``index_select`` of q, k, v
when some document has several shards here).

A sliding-window layer on a kernel with positional masks (``window_pieces.py``): every
call on its windowed mask, calls with no key in any window dropped, and the ring runs
steps 1 .. ``steps_run`` only (``window_map.ring_steps``), as the ring does (flash
kernels take the gathered form instead, ``paths.windowed_path``).

Calls per pass: ``M (M + 1) / 2`` local and at most ``(N - 1) sum_j C_j`` ring calls, with
M the most shards of one document on the rank and ``C_j <= min(M, D_j)`` the classes of
query group j (``D_j`` its documents).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from worker_runtime.layout import RankLayout, expand_ranges
from worker_runtime.paths.base import PathContext, PlannedCall, PlannedTransfer
from worker_runtime.paths.piece_calls import (
    Part,
    SegmentState,
    backward_calls,
    backward_parts,
    build_segment_state,
    call_parts,
    forward_local,
    forward_parts,
    from_buffer,
    to_buffer,
)
from worker_runtime.paths.pieces import PieceCall, SegmentPlan, build_segment_plan
from worker_runtime.paths.ring_steps import (
    Block,
    RingLink,
    ring_backward,
    ring_forward,
    ring_link,
    slot_rows,
)
from worker_runtime.paths.segment_kernels import SegmentKernel
from worker_runtime.paths.window_pieces import windowed_parts, windowed_state
from worker_runtime.sinks import merge_sink_, row_delta, sink_grad
from worker_runtime.window_map import ring_steps


class QueryGroup(NamedTuple):
    """Query group j of the local buffer, one query segment per document."""

    q_lo: int
    """First local-buffer row of the group."""
    cu_q: np.ndarray
    """int64 segment boundaries, relative to ``q_lo``."""
    docs: np.ndarray
    starts: np.ndarray
    """Document and shard start of every segment."""
    classes: np.ndarray
    """Class c is segments ``[classes[c], classes[c + 1])``: equal shard counts here."""


class SegmentRingPlan(NamedTuple):
    """One rank's ring calls (see the module docstring)."""

    local: SegmentPlan
    """Local buffer, query groups and local calls (``build_segment_plan(layout, None)``)."""
    steps: tuple[tuple[PieceCall, ...], ...]
    """Step s (1 .. N - 1) at index s - 1: the calls on the block of slot ``slot - s``
    (``remote=True``, ``causal=False``, ``piece``: the class index within the group; keys
    are block rows)."""


def _cumsum0(x: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(x))).astype(np.int64)


def query_groups(layout: RankLayout, local: SegmentPlan) -> list[QueryGroup]:
    """The query groups of ``local`` (the rank's local calls), with each document's shard
    start and class. O(M D) numpy for M groups of at most D documents."""
    diagonal = sorted((c for c in local.calls if c.causal), key=lambda c: c.group)
    sizes = np.array([len(c.cu_q) - 1 for c in diagonal], dtype=np.int64)
    counts = (sizes[:, None] > np.arange(len(local.docs))[None, :]).sum(axis=0)
    positions = layout.positions[: layout.num_real]
    groups = []
    for c, n in zip(diagonal, sizes, strict=True):
        cu_q = c.cu_q.astype(np.int64)
        rows = local.local_rows[c.q_lo + cu_q[:-1]]
        change = np.flatnonzero(np.diff(counts[:n])) + 1
        groups.append(QueryGroup(c.q_lo, cu_q, local.docs[:n], positions[rows],
                                 np.concatenate(([0], change, [n])).astype(np.int64)))
    return groups


def step_calls(groups: list[QueryGroup], key_doc: np.ndarray, key_pos: np.ndarray,
               stride: int) -> tuple[PieceCall, ...]:
    """The calls of one ring step on a block with rows ``(key_doc, key_pos)`` (real rows
    sorted by (doc, position), then padding with doc -1); ``stride`` exceeds every
    position. O(T + M D log T) numpy, one Python iteration per (group, class)."""
    real = int((key_doc >= 0).sum())
    assert (key_doc[real:] < 0).all(), "a block's padding rows follow its real rows"
    key = key_doc[:real] * stride + key_pos[:real]
    assert (np.diff(key) > 0).all(), "a block's real rows are sorted by (doc, position)"
    calls = []
    for j, g in enumerate(groups):
        run = np.searchsorted(key, g.docs * stride)
        seen = np.searchsorted(key, g.docs * stride + g.starts) - run
        for c in range(len(g.classes) - 1):
            lo, hi = int(g.classes[c]), int(g.classes[c + 1])
            assert (np.diff(g.docs[lo:hi]) > 0).all(), "doc ids ascend within a class"
            used = np.flatnonzero(seen[lo:hi]) + lo
            if len(used):
                calls.append(_call(j, c, g, int(used[0]), int(used[-1]) + 1, run, seen))
    return tuple(calls)


def _call(j: int, c: int, g: QueryGroup, first: int, last: int, run: np.ndarray,
          seen: np.ndarray) -> PieceCall:
    """Documents ``[first, last)`` of group ``g`` against their seen rows of the block:
    hollow segments for documents that see none, zero-query segments over the holes."""
    lq = np.diff(g.cu_q)[first:last]
    sn, ks = seen[first:last], run[first:last]
    used = np.flatnonzero(sn)
    gap = np.zeros(len(sn), dtype=np.int64)
    gap[used[1:]] = ks[used[1:]] - (ks + sn)[used[:-1]]
    assert (gap >= 0).all(), "the key segments of a call ascend in the block"
    # Per document: the zero-query segment over the hole before it (kept where there is
    # one), then its own segment.
    keep = np.stack((gap > 0, np.ones(len(sn), dtype=bool)), axis=1).ravel()
    cu_q = _cumsum0(np.stack((np.zeros_like(lq), lq), axis=1).ravel()[keep])
    cu_k = _cumsum0(np.stack((gap, sn), axis=1).ravel()[keep])
    row = _cumsum0(lq)[:-1]
    hollow = np.flatnonzero(sn == 0)
    k_lo = int(ks[0])
    assert k_lo + int(cu_k[-1]) == int(ks[used[-1]] + sn[used[-1]])
    return PieceCall(True, False, j, c, g.q_lo + int(g.cu_q[first]), g.q_lo + int(g.cu_q[last]),
                       k_lo, k_lo + int(cu_k[-1]), cu_q.astype(np.int32), cu_k.astype(np.int32),
                       expand_ranges(row[hollow], lq[hollow]))


def build_segment_ring_plan(layout: RankLayout) -> SegmentRingPlan:
    """The local calls and every step's calls of ``layout``'s rank.

    O(S log S + M S) for the local calls (``pieces.py``), then per step O(T + M D log T)
    numpy and one Python iteration per (group, class): O(N (T + M D log T)) in all, for S
    shards, M groups, D documents on the rank, T rows per rank and N ranks.
    """
    local = build_segment_plan(layout, None)
    a = layout.arrays
    if a is None:
        return SegmentRingPlan(local, ())
    groups = query_groups(layout, local)
    n, i = layout.num_ranks, layout.slot
    steps = tuple(step_calls(groups, *slot_rows(layout, (i - s) % n), a.key_stride)
                  for s in range(1, n))
    return SegmentRingPlan(local, steps)


class SegmentRingState(NamedTuple):
    """One rank's ring calls on one device with one kernel (built once per plan)."""

    segments: SegmentState
    """The local buffer and the local calls."""
    steps: tuple[tuple[Part, ...], ...]
    """Per step s at index s - 1: its calls with their metadata."""
    num_ranks: int
    link: RingLink
    block_rows: int = 0
    """``T``: rows of every block (a slot's whole local buffer)."""
    num_steps: int | None = None
    """Steps the ring runs (None: N - 1; a windowed layer: its last useful step)."""
    back: RingLink | None = None
    """Where the last backward accumulator goes when the ring stops early (its owner)."""


def build_segment_ring_state(layout: RankLayout, kernel: SegmentKernel, link: RingLink,
                             device: torch.device, window: int | None = None,
                             order: Any = None) -> SegmentRingState:
    """Plan (``build_segment_ring_plan``) and every call's ``kernel.meta`` on ``device``.

    ``window`` (a kernel with positional masks, ``window_pieces.py``): every call on its
    windowed mask, calls with no key inside a window dropped, and the ring stops after
    the group's last useful step (``window_map.ring_steps``), the last backward
    accumulator going straight to its owner (``order``: slot ranks, as ``ring_link``)."""
    plan = build_segment_ring_plan(layout)
    segments = build_segment_state(layout, None, kernel, device, plan=plan.local)
    if window is None:
        steps = tuple(call_parts(kernel, calls, device) for calls in plan.steps)
        return SegmentRingState(segments, steps, layout.num_ranks, link, layout.num_tokens)
    n, i = layout.num_ranks, layout.slot
    pos = layout.positions[plan.local.local_rows]
    segments = windowed_state(segments, layout, None, window, device)
    num_steps = ring_steps(layout, window)[1]
    steps = tuple(windowed_parts(kernel, calls, pos, slot_rows(layout, (i - s) % n)[1], window,
                                 device)
                  for s, calls in enumerate(plan.steps[:num_steps], start=1))
    back = None
    if num_steps < n - 1:
        ranks = list(order) if order is not None else list(range(n))
        back = RingLink(link.group, ranks[(i - num_steps) % n], ranks[(i + num_steps) % n],
                        link.counter)
    return SegmentRingState(segments, steps, n, link, layout.num_tokens, num_steps, back)


class SegmentRingAttention(torch.autograd.Function):
    """``out [T, H, D]`` of the local queries around the ring; see the module docstring.
    ``sink``: None or one logit per query head ``[H]`` (``sinks.py``), merged after the
    last step."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                state: SegmentRingState, scale: float, overlap: bool,
                sink: torch.Tensor | None = None) -> torch.Tensor:
        seg = state.segments
        q_loc = to_buffer(q, seg)
        found: list[torch.Tensor] = []

        def local() -> None:
            found.extend(forward_local(seg, q_loc, to_buffer(k, seg), to_buffer(v, seg), scale))

        def step(s: int, block: Block) -> None:
            forward_parts(seg.kernel, state.steps[s - 1], q_loc, block[0], block[1], found[0],
                          found[1], scale)

        ring_forward(state.link, state.num_ranks, seg.num_real, (k, v), overlap, local, step,
                     state.num_steps)
        out, lse = found
        merge_sink_(out, lse.t(), sink)
        result = from_buffer(out, seg, q.shape[0], q.dtype)
        ctx.save_for_backward(q_loc, k, v, result, lse, sink)
        ctx.state, ctx.scale, ctx.overlap = state, scale, overlap
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # type: ignore[override]
        q_loc, k, v, result, lse, sink = ctx.saved_tensors
        state, scale = ctx.state, ctx.scale
        seg = state.segments
        t, acc = result.shape[0], lse.dtype
        do_loc = to_buffer(dout, seg).contiguous()
        out_loc = to_buffer(result, seg)
        dq = torch.zeros(q_loc.shape, dtype=acc, device=q_loc.device)
        own: list[torch.Tensor] = []

        def local() -> None:
            k_loc, v_loc = to_buffer(k, seg), to_buffer(v, seg)
            own.extend(torch.zeros(x.shape, dtype=acc, device=x.device) for x in (k_loc, v_loc))
            backward_calls(seg, False, do_loc, q_loc, k_loc, v_loc, out_loc, lse, scale, dq, *own)

        def step(s: int, block: Block) -> Block | None:
            parts = state.steps[s - 1]
            if not parts:
                return None
            dk_b, dv_b = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in block)
            backward_parts(seg.kernel, parts, do_loc, q_loc, block[0], block[1], out_loc, lse,
                           scale, dq, dk_b, dv_b)
            return dk_b, dv_b

        carry = ring_backward(state.link, state.num_ranks, (k, v), ctx.overlap, local, step,
                              state.num_steps, state.back)
        dq_full = from_buffer(dq, seg, t, q_loc.dtype)
        dk = from_buffer(own[0], seg, t, k.dtype)
        dv = from_buffer(own[1], seg, t, v.dtype)
        if carry is not None:
            peer_k, peer_v = carry.wait()
            dk, dv = dk + peer_k, dv + peer_v
        d_sink = sink_grad(lse.t(), row_delta(do_loc, out_loc, acc), sink)
        return dq_full, dk, dv, None, None, None, d_sink


class LocalSegmentRingAttention(torch.autograd.Function):
    """The same calls on blocks given directly: ``out [T, H, D]`` of the caller's ``q``
    against ``k_blocks``/``v_blocks`` ``[N, T, G, D]`` (index s: the block of step s, 0
    the own); differentiable in all three. No transfer (one-process simulation)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,  # type: ignore[override]
                state: SegmentRingState, scale: float) -> torch.Tensor:
        seg = state.segments
        q_loc = to_buffer(q, seg)
        out, lse = forward_local(seg, q_loc, to_buffer(k_blocks[0], seg), to_buffer(v_blocks[0], seg), scale)
        for s, parts in enumerate(state.steps, start=1):
            forward_parts(seg.kernel, parts, q_loc, k_blocks[s], v_blocks[s], out, lse, scale)
        result = from_buffer(out, seg, q.shape[0], q.dtype)
        ctx.save_for_backward(q_loc, k_blocks, v_blocks, result, lse)
        ctx.state, ctx.scale = state, scale
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # type: ignore[override]
        q_loc, k_blocks, v_blocks, result, lse = ctx.saved_tensors
        state, scale = ctx.state, ctx.scale
        seg = state.segments
        t, acc = result.shape[0], lse.dtype
        do_loc = to_buffer(dout, seg).contiguous()
        out_loc = to_buffer(result, seg)
        dq = torch.zeros(q_loc.shape, dtype=acc, device=q_loc.device)
        dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (k_blocks, v_blocks))
        k_loc, v_loc = to_buffer(k_blocks[0], seg), to_buffer(v_blocks[0], seg)
        dk_loc, dv_loc = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (k_loc, v_loc))
        backward_calls(seg, False, do_loc, q_loc, k_loc, v_loc, out_loc, lse, scale, dq, dk_loc, dv_loc)
        dk[0], dv[0] = from_buffer(dk_loc, seg, t, acc), from_buffer(dv_loc, seg, t, acc)
        for s, parts in enumerate(state.steps, start=1):
            backward_parts(seg.kernel, parts, do_loc, q_loc, k_blocks[s], v_blocks[s], out_loc, lse,
                           scale, dq, dk[s], dv[s])
        return (from_buffer(dq, seg, t, q_loc.dtype), dk.to(k_blocks.dtype), dv.to(v_blocks.dtype),
                None, None)


def build(ctx: PathContext) -> SegmentRingState:
    assert ctx.kernel is not None, "the segment ring runs a segment kernel"
    link = ring_link(ctx.layout, ctx.group, ctx.order, ctx.counter)
    return build_segment_ring_state(ctx.layout, ctx.kernel, link, ctx.device, ctx.window, ctx.order)


def run(state: SegmentRingState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        overlap: bool, sink: torch.Tensor | None) -> torch.Tensor:
    return SegmentRingAttention.apply(q, k, v, state, scale, overlap, sink)  # type: ignore[no-any-return]


def planned_calls(state: SegmentRingState) -> tuple[PlannedCall, ...]:
    """The local calls on the local buffer, then every step's calls on its ``T``-row block."""
    seg = state.segments
    local = [PlannedCall("segment", meta, "local", c.q_lo, c.q_hi, c.k_lo, c.k_hi)
             for c, meta in zip(seg.plan.calls, seg.metas, strict=True)]
    ring = [PlannedCall("segment", meta, "block", c.q_lo, c.q_hi, c.k_lo, c.k_hi)
            for parts in state.steps for c, meta, _ in parts]
    return tuple(local + ring)


def buffers(state: SegmentRingState) -> dict[str, int]:
    r = state.segments.num_real
    return {"queries": r, "local": r, "block": state.block_rows}


def planned_transfers(state: SegmentRingState) -> tuple[PlannedTransfer, ...]:
    """3 shifts per step of a ``T``-row block: forward K/V, backward K/V and dK/dV."""
    last = state.num_ranks - 1 if state.num_steps is None else state.num_steps
    return (PlannedTransfer("shift", state.block_rows, 3 * last),)
