"""A sliding-window layer on the PyTorch kernel's ring (``packed`` tiling, ``p2p_ring``).

Under a window W the runtime runs the ring itself (worker_runtime/paths/ring.py,
``build_ring_state`` with ``window``): the local call on the windowed mask of the rank's
own rows, then the ring's steps 1 .. S only, S the group's ``steps_run``
(``window_work.RingSchedule``: its last step bringing some rank a key inside one of its
windows): at step s the queries with a key of slot ``i - s``'s block in their window
against that block, windowed (``build_masked_meta(..., window=W)``, counted by
windowed_lean.py ``window_blocks``), one call per step with such queries. Backward
re-circulates the blocks over the same S steps, the last accumulator going straight to
its owner.

Cost: ring.py's terms (its copies ``ring_rows``, its shifts and their hiding, shifts.py)
on these calls, with S in place of N - 1: 3 S shifts of the T-row block (``recv``: the
caller's S x T, ``window_work.recv_tokens`` with the ring schedule). A window at least
every position gives the ring's causal terms exactly when S = N - 1 (a ring whose last
steps bring nothing runs fewer shifts). Per rank from its rows and its blocks,
O(S (rows log rows + blocks)); the group form runs it rank by rank, O(N S (T log T +
blocks)) for T rows per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner_service.core.cost import ShardArrays
from planner_service.core.errors import FieldError
from planner_service.core.plan import Shard
from planner_service.core.step_time import ring
from planner_service.core.step_time.blocks import NO_BLOCKS, Blocks, shard_rows
from planner_service.core.step_time.shifts import RingHiding, ring_blocks, ring_hiding
from planner_service.core.step_time.terms import GroupInput, KernelWork, RankInput, Terms
from planner_service.core.step_time.windowed_lean import window_blocks

MAX_RANK_STEPS = 16_384
"""The most (rank, ring step) pairs :func:`group_terms` prices: it runs one step call per
pair (about 80 us each), so this bounds a request's pricing to about 1.3 s CPU."""


def steps_run(own: Sequence[Shard], blocks: Sequence[Sequence[Shard]], window: int) -> int:
    """The group's ``RingSchedule.steps_run`` from one rank's shards and its ring blocks
    (slots i - 1, ..., i - N + 1; the schedule is the same from every slot)."""
    from planner_service.core import window_work  # imports step_time.runs: not at the top
    from planner_service.core.cost import shard_arrays

    n = len(blocks) + 1
    slots: list[Sequence[Shard]] = [own] + [blocks[(-j) % n - 1] for j in range(1, n)]
    arrays = shard_arrays([list(s) for s in slots])
    if arrays is None:
        raise ValueError("window: the windowed model needs int64-safe shards "
                         "(positions below 2^31)")
    return window_work.ring_schedule_of(arrays, window).steps_run


def step_blocks(shards: Sequence[Shard], block: Sequence[Shard], block_q: int, block_k: int,
                window: int) -> Blocks:
    """One windowed ring step's call: the rank's queries with a key of ``block`` in their
    window, against the block's rows."""
    doc, pos = shard_rows(shards)
    k_doc, k_pos = shard_rows(block)
    if len(doc) == 0 or len(k_doc) == 0:
        return NO_BLOCKS
    stride = int(max(pos.max(), k_pos.max())) + 1
    key = k_doc * stride + k_pos
    hi = np.searchsorted(key, doc * stride + pos, side="right")
    lo = np.searchsorted(key, doc * stride + np.maximum(pos - window + 1, 0), side="left")
    rows = np.flatnonzero(hi > lo)
    return window_blocks(doc[rows], pos[rows], k_doc, k_pos, block_q, block_k, window)


def _rank_work(inp: RankInput, blocks: Sequence[Sequence[Shard]], last: int, window: int
               ) -> tuple[KernelWork, KernelWork, int, RingHiding | None]:
    step = inp.step._replace(num_ranks=last + 1)
    bq, bk = step.kernel.tile_q, step.kernel.tile_k
    doc, pos = shard_rows(inp.shards)
    lb = window_blocks(doc, pos, doc, pos, bq, bk, window)
    local = KernelWork(lb.pairs, lb.tiles, len(inp.shards), lb.row_blocks, 1)
    steps = [step_blocks(inp.shards, b, bq, bk, window) for b in blocks[:last]]
    called = [b for b in steps if b.queries]
    work = KernelWork(sum(b.pairs for b in called), sum(b.tiles for b in called), 0,
                      sum(b.row_blocks for b in called), len(called))
    hiding = ring_hiding([(KernelWork(b.pairs, b.tiles, 0, b.row_blocks, 1),
                           ring.merge_rows(b.queries)) if b.queries else None for b in steps],
                         step) if step.overlap else None
    return local, work, sum(b.queries for b in called), hiding


def terms(inp: RankInput, window: int) -> Terms:
    """One rank's terms under ``window`` (module docstring)."""
    blocks = ring_blocks(inp)
    last = steps_run(inp.shards, blocks, window) if blocks else 0
    local, work, queries, hiding = _rank_work(inp, blocks, last, window)
    return ring._terms(inp.step._replace(num_ranks=last + 1), local, work, inp.real, inp.recv,
                       queries, hiding)


def _rank_shards(a: ShardArrays, i: int) -> list[Shard]:
    lo, hi = int(a.bounds[i]), int(a.bounds[i + 1])
    return [Shard(int(d), int(s), int(e))
            for d, s, e in zip(a.doc[lo:hi], a.start[lo:hi], a.end[lo:hi], strict=True)]


def group_terms(inp: GroupInput, window: int) -> Terms:
    """Every rank's terms under ``window``: :func:`terms`' work rank by rank, in arrays."""
    from planner_service.core import window_work  # imports step_time.runs: not at the top

    a, step = inp.arrays, inp.step
    n = step.num_ranks
    last = window_work.ring_schedule_of(a, window).steps_run if n > 1 else 0
    if n * last > MAX_RANK_STEPS:
        raise FieldError(
            "comm_mode",
            f"comm_mode: a windowed p2p_ring layer on the {step.kernel.name!r} kernel is modelled "
            f"for at most {MAX_RANK_STEPS} (rank, ring step) pairs per group, this group has "
            f"{n * last}; use fewer ranks, a smaller window or another comm_mode")
    shards = [_rank_shards(a, i) for i in range(n)]
    fields = np.zeros((n, 10), dtype=np.int64)
    hid = np.zeros((n, 4), dtype=np.float64)
    for i in range(n):
        blocks = [shards[(i - s) % n] for s in range(1, n)]
        rin = RankInput(step, shards[i], int(inp.recv[i]), int(inp.real[i]), None, blocks)
        local, work, queries, hiding = _rank_work(rin, blocks, last, window)
        fields[i] = (*local, *work[:2], work.row_blocks, work.calls, queries)
        if hiding is not None:
            hid[i] = hiding
    f = fields.T
    zero = np.zeros(n, dtype=np.int64)
    local = KernelWork(f[0], f[1], f[2], f[3], f[4])
    work = KernelWork(f[5], f[6], zero, f[7], f[8])
    hiding = (RingHiding(hid[:, 0], hid[:, 1].astype(np.int64), hid[:, 2],
                         hid[:, 3].astype(np.int64)) if step.overlap else None)
    return ring._terms(step._replace(num_ranks=last + 1), local, work, inp.real, inp.recv,
                       f[9], hiding)
