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

The step loops (:func:`ring_forward`, :func:`ring_backward`: shifts, waits, counter) take
the kernels as callbacks; ``RingAttention`` runs them with the PyTorch kernel, the flash
path's segment ring (``segring.py``) with segment kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
    rows_in_window,
)
from worker_runtime.layout import RankLayout, expand_ranges
from worker_runtime.overlap import merge_parts
from worker_runtime.sinks import merge_sink_, sink_grad
from worker_runtime.window_map import ring_steps


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


class RingLink(NamedTuple):
    """A rank's place on its group's ring and the counter that books its transfers."""

    group: Any
    send_to: int
    recv_from: int
    """Ranks inside ``group`` of the next and previous slot."""
    counter: CommCounter


def ring_link(layout: RankLayout, group: Any, order: Any, counter: CommCounter) -> RingLink:
    """``layout``'s rank on the ring (``order[slot]``: the slot's rank inside ``group``;
    None: slot order)."""
    n, i = layout.num_ranks, layout.slot
    ranks = list(order) if order is not None else list(range(n))
    return RingLink(group, ranks[(i + 1) % n], ranks[(i - 1) % n], counter)


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
        steps=tuple(steps), link=link, num_steps=num_steps, back=back,
    )


def shift(link: RingLink, tensors: tuple[torch.Tensor, ...], direction: str) -> Pending:
    """Send ``tensors`` to the next slot and receive the previous slot's (async); books the
    bytes sent on the counter."""
    works, bufs = [], []
    for tag, x in enumerate(tensors):
        buf = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, as gloo receives
        works.append(dist.isend(x.contiguous(), group=link.group, group_dst=link.send_to, tag=tag))
        works.append(dist.irecv(buf, group=link.group, group_src=link.recv_from, tag=tag))
        bufs.append(buf)
    nbytes = sum(x.numel() * x.element_size() for x in tensors)
    link.counter.add(direction, len(tensors[0]), nbytes)
    return Pending(works, lambda: tuple(bufs), link.counter, direction, tensors[0].is_cuda)


Block = tuple[torch.Tensor, torch.Tensor]


def circulate(link: RingLink, num_ranks: int, block: Block, overlap: bool, direction: str,
              local: Callable[[], None], steps: int | None = None) -> Iterator[tuple[int, Block]]:
    """The block schedule both passes share: the own block leaves for the next slot, then
    ``local()`` runs; for s = 1 .. N - 1 (``steps``: 1 .. steps, a windowed layer's last
    useful step) the block of slot ``i - s`` arrives, leaves again (not after the last
    step) and is yielded as ``(s, block)`` while it travels on.
    ``overlap=False`` waits for each transfer right after starting it."""
    last = num_ranks - 1 if steps is None else steps
    pending = shift(link, block, direction) if last > 0 else None
    arrived = pending.wait() if pending is not None and not overlap else None
    local()
    for s in range(1, last + 1):
        if overlap:
            arrived = pending.wait()  # type: ignore[union-attr]
        assert arrived is not None
        block = arrived
        pending = shift(link, block, direction) if s < last else None
        if pending is not None and not overlap:
            arrived = pending.wait()
        yield s, block


def ring_forward(link: RingLink, num_ranks: int, num_real: int, block: Block, overlap: bool,
                 local: Callable[[], None], step: Callable[[int, Block], None],
                 steps: int | None = None) -> None:
    """The forward ring of one rank around its kernels: ``local()`` while the own block
    (K, V: ``T`` rows) goes to the next slot, then for s = 1 .. N - 1 ``step(s, block)`` on
    the block of slot ``i - s`` while it travels on (not after the last step). N - 1
    transfers; the counter holds own + T x (2 if s < N - 1 else 1) rows at step s.
    ``steps``: run steps 1 .. steps only (``circulate``)."""
    t = len(block[0])
    last = num_ranks - 1 if steps is None else steps

    def own() -> None:
        local()
        link.counter.hold(num_real)

    for s, arrived in circulate(link, num_ranks, block, overlap, "forward", own, steps):
        link.counter.hold(num_real + t * (2 if s < last else 1))
        step(s, arrived)


def ring_backward(link: RingLink, num_ranks: int, block: Block, overlap: bool,
                  local: Callable[[], None],
                  step: Callable[[int, Block], Block | None], steps: int | None = None,
                  back: RingLink | None = None) -> Pending | Landed | None:
    """The backward ring: the blocks re-circulate as in :func:`ring_forward` (``local()``,
    then ``step(s, block)`` returning the block's dK/dV part, ``T`` rows, or None) and a
    dK/dV accumulator travels with each block, collecting every non-owner's part. The
    accumulator of the previous step is waited for after this step's kernels. 2 (N - 1)
    transfers. Returns the own block's accumulator in flight (``wait()`` gives the dK/dV
    the peers computed for the own rows), or None for a ring of one. ``steps`` (below
    N - 1): the blocks run steps 1 .. steps only, and the last accumulator goes straight
    to its block's owner over ``back`` (slot ``i - steps``, receiving from ``i + steps``)."""
    carry: Pending | Landed | None = None
    k, v = block
    last = num_ranks - 1 if steps is None else steps
    for s, arrived in circulate(link, num_ranks, block, overlap, "backward", local, steps):
        part = step(s, arrived)
        # The previous step's accumulator was in flight during this step's kernels.
        acc = (k.new_zeros(k.shape), v.new_zeros(v.shape)) if carry is None else carry.wait()
        if part is not None:
            acc = (acc[0] + part[0].to(k.dtype), acc[1] + part[1].to(v.dtype))
        carry = shift(back if s == last and back is not None else link, acc, "backward")
        if not overlap:
            carry = Landed(carry.wait())
    return carry


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
                merge_parts(found[0], found[1], rows, out2, lse2)

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


class Landed:
    """A transfer that has already landed (overlap off): ``wait()`` gives its value."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value
