"""The ring (``ExecutionPath.RING``): ``p2p_ring`` plans on the PyTorch kernel, N - 1 point-to-point steps, doc-masked, exact.

Forward: each rank's K and V blocks (its whole local buffer, padding included, as the
plan's full-exchange figure counts) travel around the group ring. Step 0 attends the own
block while the first transfer is in flight; at step s (1 <= s <= N - 1) the rank holds the
block of slot ``i - s`` (from slot ``i - 1``), forwards it to slot ``i + 1`` (not after the
last step) and attends it, merging with the running output through the log-sum-exp.
Queries that see no key of a block skip it.

Backward re-circulates the blocks the same way (nothing remote is kept between the
passes) and sends a dK/dV accumulator along with each: the accumulator of block b starts
empty at slot ``b + 1``, collects every non-owner's part and reaches slot b after N - 1
transfers, where it is added to the owner's own gradient. So backward moves twice the
forward's bytes (K/V, then dK/dV); every step is counted on the counter's history.
Transfers overlap the current block's kernel (a step waits for the accumulator the
previous step sent only after its own gradient kernel); ``overlap=False`` waits for each transfer
right after starting it.

K/V held at once: own tokens, the block being attended and the one in flight
(``cost.kv_tokens_peak`` for ``p2p_ring``). The dK/dV accumulators travel in the input
dtype (their bytes equal the K/V blocks').

The step loops (``ring_steps.ring_forward``, ``ring_backward``: shifts, waits, counter) take
the kernels as callbacks; ``RingAttention`` runs them with the PyTorch kernel, the segment
ring (``segment_ring.py``) with segment kernels.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from planner_service.core.seeing import rows_seeing
from worker_runtime.comm import CommCounter
from worker_runtime.kernels import (
    VarlenMeta,
    attention_backward,
    attention_forward,
    build_masked_meta,
    rows_in_window,
)
from worker_runtime.layout import RankLayout
from worker_runtime.paths.base import PathContext, PlannedCall, PlannedTransfer
from worker_runtime.paths.merge import merge_rows_
from worker_runtime.paths.ring_steps import (
    Block,
    RingLink,
    ring_backward,
    ring_forward,
    ring_link,
    slot_rows,
)
from worker_runtime.sinks import merge_sink_, sink_grad
from worker_runtime.window_map import ring_steps


class RingStep(NamedTuple):
    rows: torch.Tensor
    """Local query rows that see a key of the step's block."""
    meta: VarlenMeta


class RingState(NamedTuple):
    num_real: int
    num_ranks: int
    local_meta: VarlenMeta
    steps: tuple[RingStep, ...]
    """Step s (1..N-1) at index s - 1: the block of slot ``slot - s``."""
    link: RingLink
    num_steps: int | None = None
    """Steps the ring runs (None: N - 1; a windowed layer: its last useful step)."""
    back: RingLink | None = None
    """Where the last backward accumulator goes when the ring stops early (its owner)."""
    block_rows: int = 0
    """``T``: rows of every block (a slot's whole local buffer)."""


def build_ring_state(layout: RankLayout, group: Any, order: Any, counter: CommCounter,
                     device: torch.device, window: int | None = None) -> RingState:
    """Per-step query rows and kernel metadata of one rank (``order[slot]``: the slot's rank
    inside ``group``; ``window``: a sliding-window layer's masks, a step's queries being
    those with a key of the block in their window)."""
    r, n, i = layout.num_real, layout.num_ranks, layout.slot
    doc, pos = layout.doc_ids[:r], layout.positions[:r]
    steps = []
    for s in range(1, n):
        key_doc, key_pos = slot_rows(layout, (i - s) % n)
        if window is None:
            rows = rows_seeing(doc, pos, key_doc, key_pos)
        else:
            rows = rows_in_window(doc, pos, key_doc, key_pos, window)
        meta = build_masked_meta(doc[rows], pos[rows], key_doc, key_pos, device, window=window)
        steps.append(RingStep(torch.from_numpy(rows).to(device), meta))
    link = ring_link(layout, group, order, counter)
    num_steps, back = None, None
    if window is not None:
        num_steps = ring_steps(layout, window)[1]
        if num_steps < n - 1:
            ranks = list(order) if order is not None else list(range(n))
            back = RingLink(group, ranks[(i - num_steps) % n], ranks[(i + num_steps) % n], counter)
    return RingState(
        num_real=r, num_ranks=n, local_meta=build_masked_meta(doc, pos, doc, pos, device, window=window),
        steps=tuple(steps), link=link, num_steps=num_steps, back=back, block_rows=layout.num_tokens,
    )


class RingAttention(torch.autograd.Function):
    """``out [T, H, D]`` of the local queries; see the module docstring. ``sink``: None or
    one logit per query head ``[H]`` (``sinks.py``), merged after the last step."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                state: RingState, scale: float, overlap: bool,
                sink: torch.Tensor | None = None) -> torch.Tensor:
        r = state.num_real
        t, h, d = q.shape
        found: list[torch.Tensor] = []

        def local() -> None:
            found.extend(attention_forward(q[:r], k[:r], v[:r], state.local_meta, scale))

        def step(s: int, block: Block) -> None:
            rows, meta = state.steps[s - 1]
            if len(rows):
                out2, lse2 = attention_forward(q.index_select(0, rows), block[0], block[1], meta, scale)
                merge_rows_(found[0], found[1], rows, out2, lse2)

        ring_forward(state.link, state.num_ranks, r, (k, v), overlap, local, step, state.num_steps)
        out, lse = found
        merge_sink_(out.view(r, h, d), lse.view(r, h), sink)
        result = torch.cat((out.view(r, h, d).to(q.dtype), q.new_zeros((t - r, h, d))))
        ctx.save_for_backward(q, k, v, result, lse, sink)
        ctx.state, ctx.scale, ctx.overlap = state, scale, overlap
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # type: ignore[override]
        q, k, v, result, lse, sink = ctx.saved_tensors
        state, scale, overlap = ctx.state, ctx.scale, ctx.overlap
        r = state.num_real
        t, h, d = q.shape
        g = k.shape[1]
        cd = lse.dtype
        do = dout[:r].reshape(r, g, h // g, d).to(cd)
        delta = (do * result[:r].view(r, g, h // g, d).to(cd)).sum(dim=-1)
        found: list[torch.Tensor] = []

        def local() -> None:
            found.extend(attention_backward(do, q[:r], k[:r], v[:r], lse, delta, state.local_meta, scale))

        def step(s: int, block: Block) -> Block | None:
            rows, meta = state.steps[s - 1]
            if not len(rows):
                return None
            dq2, dk_b, dv_b = attention_backward(
                do.index_select(0, rows), q.index_select(0, rows), block[0], block[1],
                lse.index_select(0, rows), delta.index_select(0, rows), meta, scale)
            found[0].index_add_(0, rows, dq2)
            return dk_b, dv_b

        carry = ring_backward(state.link, state.num_ranks, (k, v), overlap, local, step,
                              state.num_steps, state.back)
        dq, dk_own, dv_own = found
        dk = torch.cat((dk_own.to(k.dtype), k.new_zeros((t - r, *k.shape[1:]))))
        dv = torch.cat((dv_own.to(v.dtype), v.new_zeros((t - r, *v.shape[1:]))))
        if carry is not None:
            own_k, own_v = carry.wait()
            dk, dv = dk + own_k, dv + own_v
        dq_full = torch.cat((dq.view(r, h, d).to(q.dtype), q.new_zeros((t - r, h, d))))
        return dq_full, dk, dv, None, None, None, sink_grad(lse.view(r, h), delta.view(r, h), sink)


def build(ctx: PathContext) -> RingState:
    return build_ring_state(ctx.layout, ctx.group, ctx.order, ctx.counter, ctx.device, ctx.window)


def run(state: RingState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        overlap: bool, sink: torch.Tensor | None) -> torch.Tensor:
    return RingAttention.apply(q, k, v, state, scale, overlap, sink)  # type: ignore[no-any-return]


def _last_step(state: RingState) -> int:
    return state.num_ranks - 1 if state.num_steps is None else state.num_steps


def planned_calls(state: RingState) -> tuple[PlannedCall, ...]:
    """The local call, then one call per step whose block some query sees (``block``: the
    step's ``T``-row block)."""
    r, t = state.num_real, state.block_rows
    calls = [PlannedCall("torch", state.local_meta, "local", 0, r, 0, r)]
    calls += [PlannedCall("torch", step.meta, "block", 0, len(step.rows), 0, t)
              for step in state.steps[: _last_step(state)] if len(step.rows)]
    return tuple(calls)


def buffers(state: RingState) -> dict[str, int]:
    return {"queries": state.num_real, "local": state.num_real, "block": state.block_rows}


def planned_transfers(state: RingState) -> tuple[PlannedTransfer, ...]:
    """3 shifts per step of a ``T``-row block: forward K/V, backward K/V and dK/dV."""
    return (PlannedTransfer("shift", state.block_rows, 3 * _last_step(state)),)
