"""A ring's exchange: the shifts of the ring paths (ring.py, segment_ring.py) and what hides them.

N - 1 point-to-point shifts of the whole local K/V block (T rows, padding included), each
t = ``latency_us + per_peer_us`` + T b / bandwidth: shift 0 in flight during the local
call(s), shift s during step s's call(s) and merge (the block of slot ``i - s``). Backward
circulates the blocks again with a dK/dV accumulator per block; a step waits for the
accumulator the previous step sent only after its own gradient call, so each accumulator
transfer is in flight during the next step's call (the block shifts travel beside them and
are taken as hidden; the link is taken to carry both at once); the last one is waited for
after the loop.

Overlap off: 3 (N - 1) t exposed. On: ``max(0, t - phi K_loc)`` + sum over steps
s = 1..N-2 of ``max(0, t - W_s)`` + ``max(0, t - (1 - phi) K_loc)`` + sum over steps
s = 2..N-1 of ``max(0, t - B_s)`` + t, with K_loc the local call(s), K_s the step's
call(s), ``W_s = phi K_s`` + the step's merge copies and ``B_s = (1 - phi) K_s`` (both 0
for a step without a call). Nothing when the rank receives nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from planner_service.core.model import ModelSpec
from planner_service.core.plan import Shard
from planner_service.core.profiles import KernelProfile, LinkProfile
from planner_service.core.step_time.runs import check_ring_size, ring_pairs
from planner_service.core.step_time.terms import (
    Exchange,
    KernelWork,
    RankInput,
    Rows,
    Step,
    copy_ms,
    forward_share,
    kernel_ms,
    transfer_ms,
)


def ring_shift_ms(tokens_per_rank: int, model: ModelSpec, link: LinkProfile) -> float:
    """One ring shift: the whole local K and V block to the next slot."""
    return transfer_ms(tokens_per_rank * model.kv_bytes_per_token, link, 1)


def ring_window_ms(work: KernelWork, merge: Rows, model: ModelSpec, kernel: KernelProfile) -> Any:
    """W_s: a ring step's forward work while the next shift is in flight (its calls' forward
    share and its merge copies ``merge``)."""
    return forward_share(kernel) * kernel_ms(work, model, kernel) + copy_ms(
        merge.bytes(model), kernel, merge.ops)


class RingHiding(NamedTuple):
    """What a rank's steps hide of the shifts after the first (values may be arrays)."""

    hidden: Any
    """Sum over steps 1..N-2 with a call of max(0, t - W_s), in step order."""
    mid_calls: Any
    """How many such steps."""
    bwd_hidden: Any
    """Sum over steps 2..N-1 with a call of max(0, t - B_s)."""
    late_calls: Any
    """How many such steps."""


def ring_blocks(inp: RankInput) -> list[Sequence[Shard]]:
    """The rank's ring blocks (steps 1..N-1), checked: ValueError unless N - 1 are given
    (N > 1), FieldError on ``comm_mode`` for a ring too large to model
    (``runs.MAX_RING_PAIRS``)."""
    n, blocks = inp.step.num_ranks, inp.ring_blocks
    if n > 1 and (blocks is None or len(blocks) != n - 1):
        raise ValueError(f"ring_blocks must list the {n - 1} blocks a ring rank attends "
                         "(the shards of slots i - 1, ..., i - N + 1)")
    out = list(blocks or ())
    if n > 1:
        held = [(r, sh.doc) for r, rank in enumerate((inp.shards, *out))
                for sh in rank if sh.end > sh.start]
        check_ring_size(ring_pairs(np.array([r for r, _ in held], dtype=np.int64),
                                   np.array([d for _, d in held], dtype=np.int64)))
    return out


def ring_hiding(parts: Sequence[tuple[KernelWork, Rows] | None], step: Step) -> RingHiding:
    """:class:`RingHiding` from each step's (calls, merge copies), None for a step without
    a call, steps 1..N-1 in order."""
    model, kernel, num_ranks = step.model, step.kernel, step.num_ranks
    shift = ring_shift_ms(step.tokens_per_rank, model, step.link)
    hidden = bwd_hidden = 0.0
    mid = late = 0
    phi = forward_share(kernel)
    for s, part in enumerate(parts, start=1):
        if part is None:
            continue
        work, merge = part
        if s <= num_ranks - 2:
            hidden += max(0.0, shift - ring_window_ms(work, merge, model, kernel))
            mid += 1
        if s >= 2:
            bwd_hidden += max(0.0, shift - (1 - phi) * kernel_ms(work, model, kernel))
            late += 1
    return RingHiding(hidden, mid, bwd_hidden, late)


def group_ring_hiding(rank: np.ndarray, steps: np.ndarray, work: KernelWork, merge: Rows,
                      step: Step, num_ranks: int | None = None) -> RingHiding:
    """:func:`ring_hiding` of every rank from one entry per (rank, step) with a call,
    sorted by (rank, step): fields of ``work`` and ``merge`` are arrays over the entries
    (or scalars). ``num_ranks``: the ranks of the output when ``step.num_ranks`` is the
    ring's length rather than the group's (a windowed ring's ``steps_run + 1``)."""
    def take(x: Any, keep: np.ndarray) -> Any:
        return type(x)(*(f[keep] if isinstance(f, np.ndarray) else f for f in x))

    model, kernel, n = step.model, step.kernel, step.num_ranks
    ranks = n if num_ranks is None else num_ranks
    shift = ring_shift_ms(step.tokens_per_rank, model, step.link)
    mid = steps <= n - 2
    w = ring_window_ms(take(work, mid), take(merge, mid), model, kernel)
    late = steps >= 2
    b_s = (1 - forward_share(kernel)) * kernel_ms(take(work, late), model, kernel)
    return RingHiding(np.bincount(rank[mid], weights=np.maximum(0.0, shift - w), minlength=ranks),
                      np.bincount(rank[mid], minlength=ranks),
                      np.bincount(rank[late], weights=np.maximum(0.0, shift - b_s),
                                  minlength=ranks),
                      np.bincount(rank[late], minlength=ranks))


def ring_exchange(step: Step, recv: Any, local: KernelWork, hiding: RingHiding | None) -> Exchange:
    """The shifts (module docstring): 3 (N - 1) of them over both passes; ``hiding`` None
    with overlap off (everything exposed)."""
    n, model, kernel = step.num_ranks, step.model, step.kernel
    shift = ring_shift_ms(step.tokens_per_rank, model, step.link)
    moves = recv > 0
    passes = moves * (3 * (n - 1))
    transfer = moves * ((3 * (n - 1)) * shift)
    if hiding is None:
        comm = transfer
    else:
        phi = forward_share(kernel)
        k_loc = kernel_ms(local, model, kernel)
        empty = max(n - 2, 0) - hiding.mid_calls
        late_empty = max(n - 2, 0) - hiding.late_calls
        exposed = (np.maximum(0.0, shift - phi * k_loc) + hiding.hidden + empty * shift) + (
            np.maximum(0.0, shift - (1 - phi) * k_loc) + hiding.bwd_hidden
            + late_empty * shift + shift)
        comm = moves * exposed
    return Exchange(moves * (3 * recv * model.kv_bytes_per_token), passes, passes, transfer, comm)
