"""The ring's step loops, shared by the ring (``ring.py``) and the segment ring
(``segment_ring.py``): each rank's K and V blocks (its whole local buffer, padding
included, as the plan's full-exchange figure counts) travel around the group ring, N - 1
point-to-point steps, the kernels given as callbacks.

Forward: step 0 runs the own block's kernels while the first transfer is in flight; at
step s (1 <= s <= N - 1) the rank holds the block of slot ``i - s`` (from slot ``i - 1``),
forwards it to slot ``i + 1`` (not after the last step) and runs its kernels. Backward
re-circulates the blocks the same way and sends a dK/dV accumulator along with each: the
accumulator of block b starts empty at slot ``b + 1``, collects every non-owner's part and
reaches slot b after N - 1 transfers. Every transfer is booked on the counter's history;
``overlap=False`` waits for each transfer right after starting it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from worker_runtime.comm import CommCounter, Pending
from worker_runtime.layout import RankLayout, expand_ranges


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


class Landed:
    """A transfer that has already landed (overlap off): ``wait()`` gives its value."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value
