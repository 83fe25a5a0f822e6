"""Ring execution of ``p2p_ring`` plans: N - 1 point-to-point steps, doc-masked, exact.

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
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from worker_runtime.comm import CommCounter, Pending
from worker_runtime.kernels import (
    VarlenMeta,
    attention_backward,
    attention_forward,
    build_masked_meta,
)
from worker_runtime.layout import RankLayout, expand_ranges
from worker_runtime.overlap import merge_parts


def rows_seeing(doc: np.ndarray, pos: np.ndarray, key_doc: np.ndarray, key_pos: np.ndarray) -> np.ndarray:
    """Query rows (doc, pos) that see at least one key (same doc, key position <= pos)."""
    real = key_doc >= 0
    key_doc, key_pos = key_doc[real], key_pos[real]
    if len(key_doc) == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((key_pos, key_doc))
    docs, first = np.unique(key_doc[order], return_index=True)
    first_pos = key_pos[order][first]
    at = np.minimum(np.searchsorted(docs, doc), len(docs) - 1)
    return np.flatnonzero((docs[at] == doc) & (first_pos[at] <= pos))


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
    group: Any
    send_to: int
    recv_from: int
    """Ranks inside ``group`` of the next and previous slot."""
    counter: CommCounter


def slot_rows(layout: RankLayout, slot: int) -> tuple[np.ndarray, np.ndarray]:
    """(doc, position) of every row of a slot's local buffer; padding rows have doc -1."""
    a = layout.arrays
    assert a is not None
    lo, hi = a.slot_bounds[slot], a.slot_bounds[slot + 1]
    length = a.end[lo:hi] - a.start[lo:hi]
    pad = layout.num_tokens - int(length.sum())
    doc = np.concatenate((np.repeat(a.doc[lo:hi], length), np.full(pad, -1, dtype=np.int64)))
    pos = np.concatenate((expand_ranges(a.start[lo:hi], length), np.zeros(pad, dtype=np.int64)))
    return doc, pos


def build_ring_state(layout: RankLayout, group: Any, order: Any, counter: CommCounter,
                     device: torch.device) -> RingState:
    """Per-step query rows and kernel metadata of one rank (``order[slot]``: the slot's rank
    inside ``group``)."""
    r, n, i = layout.num_real, layout.num_ranks, layout.slot
    doc, pos = layout.doc_ids[:r], layout.positions[:r]
    steps = []
    for s in range(1, n):
        key_doc, key_pos = slot_rows(layout, (i - s) % n)
        rows = rows_seeing(doc, pos, key_doc, key_pos)
        meta = build_masked_meta(doc[rows], pos[rows], key_doc, key_pos, device)
        steps.append(RingStep(torch.from_numpy(rows).to(device), meta))
    ranks = list(order) if order is not None else list(range(n))
    return RingState(
        num_real=r, num_ranks=n, local_meta=build_masked_meta(doc, pos, doc, pos, device),
        steps=tuple(steps), group=group, send_to=ranks[(i + 1) % n], recv_from=ranks[(i - 1) % n],
        counter=counter,
    )


def _shift(state: RingState, tensors: tuple[torch.Tensor, ...], direction: str) -> Pending:
    """Send ``tensors`` to the next slot and receive the previous slot's (async)."""
    works, bufs = [], []
    for tag, x in enumerate(tensors):
        buf = torch.empty_like(x)
        works.append(dist.isend(x.contiguous(), group=state.group, group_dst=state.send_to, tag=tag))
        works.append(dist.irecv(buf, group=state.group, group_src=state.recv_from, tag=tag))
        bufs.append(buf)
    nbytes = sum(x.numel() * x.element_size() for x in tensors)
    state.counter.add(direction, len(tensors[0]), nbytes)
    return Pending(works, lambda: tuple(bufs), state.counter, direction, tensors[0].is_cuda)


class RingAttention(torch.autograd.Function):
    """``out [T, H, D]`` of the local queries; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                state: RingState, scale: float, overlap: bool) -> torch.Tensor:
        r, n = state.num_real, state.num_ranks
        t, h, d = q.shape
        block: tuple[torch.Tensor, ...] = (k, v)
        pending = _shift(state, block, "forward") if n > 1 else None
        if pending is not None and not overlap:
            arrived = pending.wait()
        out, lse = attention_forward(q[:r], k[:r], v[:r], state.local_meta, scale)
        state.counter.hold(r)
        for s, step in enumerate(state.steps, start=1):
            if overlap:
                arrived = pending.wait()  # type: ignore[union-attr]
            block = arrived
            pending = _shift(state, block, "forward") if s < n - 1 else None
            if pending is not None and not overlap:
                arrived = pending.wait()
            state.counter.hold(r + t * (2 if s < n - 1 else 1))
            if len(step.rows):
                out2, lse2 = attention_forward(q.index_select(0, step.rows), block[0], block[1],
                                               step.meta, scale)
                merge_parts(out, lse, step.rows, out2, lse2)
        result = torch.cat((out.view(r, h, d).to(q.dtype), q.new_zeros((t - r, h, d))))
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.state, ctx.scale, ctx.overlap = state, scale, overlap
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # type: ignore[override]
        q, k, v, result, lse = ctx.saved_tensors
        state, scale, overlap = ctx.state, ctx.scale, ctx.overlap
        r, n = state.num_real, state.num_ranks
        t, h, d = q.shape
        g = k.shape[1]
        cd = lse.dtype
        do = dout[:r].reshape(r, g, h // g, d).to(cd)
        delta = (do * result[:r].view(r, g, h // g, d).to(cd)).sum(dim=-1)
        block: tuple[torch.Tensor, ...] = (k, v)
        pending = _shift(state, block, "backward") if n > 1 else None
        if pending is not None and not overlap:
            arrived = pending.wait()
        dq, dk_own, dv_own = attention_backward(do, q[:r], k[:r], v[:r], lse, delta,
                                                state.local_meta, scale)
        carry: Pending | _Done | None = None
        for s, step in enumerate(state.steps, start=1):
            if overlap:
                arrived = pending.wait()  # type: ignore[union-attr]
            block = arrived
            pending = _shift(state, block, "backward") if s < n - 1 else None
            if pending is not None and not overlap:
                arrived = pending.wait()
            rows = step.rows
            if len(rows):
                dq2, dk_b, dv_b = attention_backward(
                    do.index_select(0, rows), q.index_select(0, rows), block[0], block[1],
                    lse.index_select(0, rows), delta.index_select(0, rows), step.meta, scale)
                dq.index_add_(0, rows, dq2)
            # The previous step's accumulator was in flight during this step's kernel.
            acc = (k.new_zeros(k.shape), v.new_zeros(v.shape)) if carry is None else carry.wait()
            if len(rows):
                acc = (acc[0] + dk_b.to(k.dtype), acc[1] + dv_b.to(v.dtype))
            carry = _shift(state, acc, "backward")
            if not overlap:
                done = carry.wait()
                carry = _Done(done)
        dk = torch.cat((dk_own.to(k.dtype), k.new_zeros((t - r, *k.shape[1:]))))
        dv = torch.cat((dv_own.to(v.dtype), v.new_zeros((t - r, *v.shape[1:]))))
        if carry is not None:
            own_k, own_v = carry.wait()
            dk, dv = dk + own_k, dv + own_v
        dq_full = torch.cat((dq.view(r, h, d).to(q.dtype), q.new_zeros((t - r, h, d))))
        return dq_full, dk, dv, None, None, None


class _Done:
    """A transfer that has already landed (overlap off)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value
