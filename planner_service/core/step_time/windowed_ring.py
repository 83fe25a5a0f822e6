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
steps bring nothing runs fewer shifts).

Two forms. Per rank (:func:`terms`, the reference) step by step from its rows and its
blocks, O(S (rows log rows + blocks)). For a group (:func:`group_terms`) every (rank,
step) call at once from shard arrays: step s's queries of rank i are, per own shard of a
doc that rank i - s holds below it, the shard's rows whose window reaches back to that
rank's last key of the doc below the shard, a prefix of the shard (:func:`step_queries`,
on the pairs of ``runs.ring_seen``); each query block's key range is counted by binary
search in the group's sorted shards. O((s + t + b) log s) for s shards, t (shard, other
holder of its doc) pairs and b query blocks (local and ring calls), no loop over ranks
or steps. The ring calls' query blocks, the kernel's own work, are bounded by
:data:`MAX_STEP_BLOCKS` (``runs.MAX_RING_PAIRS`` bounds t); above either a group is
refused with a FieldError on ``comm_mode``. The two forms are compared field by field in
tests/test_step_time_window_ring.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from planner_service.core.cost import ShardArrays
from planner_service.core.errors import FieldError
from planner_service.core.plan import Shard
from planner_service.core.step_time import ring
from planner_service.core.step_time.blocks import NO_BLOCKS, Blocks, query_blocks, shard_rows
from planner_service.core.step_time.runs import RingSeen, SortedShards, ring_seen, sort_shards
from planner_service.core.step_time.shifts import (
    RingHiding,
    group_ring_hiding,
    ring_blocks,
    ring_hiding,
)
from planner_service.core.step_time.terms import GroupInput, KernelWork, RankInput, Terms
from planner_service.core.step_time.windowed_lean import window_blocks

MAX_STEP_BLOCKS = 1 << 22
"""The most query blocks (``tile_q`` rows each) :func:`group_terms` prices over a group's
ring calls, every (rank, step) with queries in its windows: the kernel's own work, which
the group form's arrays follow (about a second of numpy at the limit). Above it the group
is refused with a FieldError on ``comm_mode``; the (shard, other holder of its doc) pairs
the calls are built from are bounded by ``runs.MAX_RING_PAIRS``."""


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


class _Rows(NamedTuple):
    """A group's sorted shards (``runs.sort_shards``) set up to count a rank's rows below a
    (doc, position): the rows of rank j below (d, p) are those of its runs of earlier docs
    and those of its run of d at positions below p."""

    s: SortedShards
    row0: np.ndarray
    """Each sorted shard's first row in the group's rows (rank, doc, position), then the
    total."""
    docs: np.ndarray
    """The group's distinct docs."""
    run_key: np.ndarray
    """Per run, ``rank * len(docs) + `` its doc's index in ``docs`` (increasing)."""
    run_first: np.ndarray
    """Per run its first shard, then the number of shards."""
    shard_key: np.ndarray
    """Per shard ``run * stride + start`` (increasing)."""
    rank_row0: np.ndarray
    """Per rank its first row in the group's rows."""
    stride: int
    """Above every position."""


def _rows(s: SortedShards) -> _Rows:
    row0 = np.concatenate(([0], np.cumsum(s.length)))
    docs = np.unique(s.doc)
    run_rank, run_doc = s.rank[s.run_first], s.doc[s.run_first]
    run_key = run_rank * len(docs) + np.searchsorted(docs, run_doc)
    stride = int((s.start + s.length).max(initial=0)) + 1
    rank_first = np.searchsorted(s.rank, np.arange(s.num_ranks), side="left")
    return _Rows(s, row0, docs, run_key, np.append(s.run_first, len(s.rank)),
                 s.run * stride + s.start, row0[rank_first], stride)


def _below(g: _Rows, rank: np.ndarray, doc: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Per entry, rank ``rank``'s rows below (``doc``, ``pos``) in (doc, position) order;
    ``doc`` one of the group's docs, ``0 <= pos < stride``. O(e log s) for e entries."""
    s = g.s
    target = rank * len(g.docs) + np.searchsorted(g.docs, doc)
    run = np.searchsorted(g.run_key, target, side="left")
    first = g.run_first[run]
    found = g.run_key[np.minimum(run, len(g.run_key) - 1)] == target
    found &= run < len(g.run_key)
    # The run's shards starting below pos: the last of them holds rows at and above pos
    # when it reaches past it.
    idx = np.searchsorted(g.shard_key, run * g.stride + pos, side="left")
    last = np.where(found & (idx > first), idx - 1, -1)
    lt = np.maximum(last, 0)
    below = np.where(last >= 0, g.row0[lt] + np.minimum(s.length[lt], pos - s.start[lt]),
                     g.row0[first])
    return below - g.rank_row0[rank]


def _call_blocks(g: _Rows, call: np.ndarray, shard: np.ndarray, rows: np.ndarray,
                 key_rank: np.ndarray, block_q: int, block_k: int, window: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(pairs, key blocks, query blocks, queries) of ``len(key_rank)`` windowed calls,
    :func:`windowed_lean.window_blocks`'s count: call c's queries are, in order, the first
    ``rows[e]`` (> 0) rows of shard ``shard[e]`` of its entries e (``call`` non-decreasing),
    its keys the rows of rank ``key_rank[c]``. O(e + b log s) for e entries and b query
    blocks."""
    qb = query_blocks(call, rows, len(key_rank), block_q)
    # The block's first query (doc, p0) reads from its window start, its last (doc, p1)
    # up to itself.
    s, j, first, last = g.s, key_rank[qb.call], shard[qb.a], shard[qb.b]
    p0 = s.start[first] + (qb.q0 - qb.row0[qb.a])
    p1 = s.start[last] + (qb.q1 - 1 - qb.row0[qb.b])
    lo = _below(g, j, s.doc[first], np.maximum(p0 - window + 1, 0))
    hi = _below(g, j, s.doc[last], p1 + 1)
    span = np.maximum(hi - lo, 0)
    return (qb.per_call((qb.q1 - qb.q0) * span), qb.per_call(-(-span // block_k)), qb.nb,
            qb.rows)


class _GroupWork(NamedTuple):
    """A group's windowed calls: each rank's local call and every ring call."""

    local: KernelWork
    """Per rank, its local call."""
    last: int
    """The group's ``steps_run``."""
    rank: np.ndarray
    """Per ring call (a (rank, step) with queries), sorted by (rank, step): its rank."""
    step: np.ndarray
    """Per ring call, its step."""
    blocks: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    """Per ring call (pairs, key blocks, query blocks, queries)."""


def step_queries(s: SortedShards, seen: RingSeen, window: int) -> np.ndarray:
    """Per pair of ``seen``, the shard's rows with a key of the other run in their window:
    a prefix of the shard. The run's keys below the shard's start end at ``e`` (its last
    shard starting below the start: shards are disjoint), so row p has one iff
    ``p < e + W - 1``; its keys above the shard are above every row of it."""
    stride = int((s.start + s.length).max()) + 1
    key = s.run * stride + s.start
    last = np.searchsorted(key, seen.other * stride + s.start[seen.shard], side="left") - 1
    e = s.start[last] + s.length[last]
    return np.clip(e + window - 1 - s.start[seen.shard], 0, s.length[seen.shard])


def _group_work(a: ShardArrays, n: int, block_q: int, block_k: int, window: int) -> _GroupWork:
    """:func:`_rank_work`'s calls of every rank at once (module docstring): the ring calls
    from the (own shard, other run) pairs of ``runs.ring_seen`` with queries in their window
    (:func:`step_queries`), grouped by (rank, step); FieldError on ``comm_mode`` above
    ``runs.MAX_RING_PAIRS`` pairs or :data:`MAX_STEP_BLOCKS` ring query blocks."""
    s = sort_shards(a.rank, a.doc, a.start, a.end, n)
    seen = ring_seen(s)
    rows = step_queries(s, seen, window) if len(seen.shard) else seen.seen
    keep = rows > 0
    shard, step, rows = seen.shard[keep], seen.step[keep], rows[keep]
    i = s.rank[shard]
    order = np.lexsort((shard, step, i))
    shard, step, rows, i = shard[order], step[order], rows[order], i[order]
    head = np.ones(len(i), dtype=bool)
    head[1:] = (i[1:] != i[:-1]) | (step[1:] != step[:-1])
    queries = np.add.reduceat(rows, np.flatnonzero(head)) if len(rows) else rows
    blocks = int((-(-queries // block_q)).sum())
    if blocks > MAX_STEP_BLOCKS:
        raise FieldError(
            "comm_mode",
            f"comm_mode: a windowed p2p_ring layer is modelled for at most {MAX_STEP_BLOCKS} "
            f"query blocks over its ring steps per group (MAX_STEP_BLOCKS), this group has "
            f"{blocks}; use fewer ranks, a smaller window or another comm_mode")
    g = _rows(s)
    lp, lt, lr, _ = _call_blocks(g, s.rank, np.arange(len(s.rank), dtype=np.int64), s.length,
                                 np.arange(n, dtype=np.int64), block_q, block_k, window)
    local = KernelWork(lp, lt, np.diff(a.bounds), lr, np.ones(n, dtype=np.int64))
    ci, cs = i[head], step[head]
    return _GroupWork(local, int(cs.max(initial=0)), ci, cs,
                      _call_blocks(g, np.cumsum(head) - 1, shard, rows, (ci - cs) % n, block_q,
                                   block_k, window))


def group_parts(inp: GroupInput, window: int
                ) -> tuple[int, KernelWork, KernelWork, np.ndarray, RingHiding | None]:
    """(``steps_run``, local calls, ring calls, ring queries, hiding) per rank: what
    :func:`_rank_work` gives rank by rank, as arrays over the ranks."""
    a, step = inp.arrays, inp.step
    n, k = step.num_ranks, step.kernel
    w = _group_work(a, n, k.tile_q, k.tile_k, window)
    pairs, tiles, row_blocks, queries = w.blocks
    ends = np.searchsorted(w.rank, np.arange(n + 1), side="left")

    def per_rank(x: np.ndarray) -> np.ndarray:
        sums = np.concatenate(([0], np.cumsum(x, dtype=np.int64)))
        return sums[ends[1:]] - sums[ends[:-1]]

    work = KernelWork(per_rank(pairs), per_rank(tiles), np.zeros(n, dtype=np.int64),
                      per_rank(row_blocks), np.diff(ends))
    hiding = group_ring_hiding(w.rank, w.step, KernelWork(pairs, tiles, 0, row_blocks, 1),
                               ring.merge_rows(queries), step._replace(num_ranks=w.last + 1),
                               num_ranks=n) if step.overlap else None
    return w.last, w.local, work, per_rank(queries), hiding


def group_terms(inp: GroupInput, window: int) -> Terms:
    """Every rank's terms under ``window``: :func:`terms`' calls for all (rank, step) pairs
    at once (:func:`group_parts`, module docstring)."""
    last, local, work, queries, hiding = group_parts(inp, window)
    return ring._terms(inp.step._replace(num_ranks=last + 1), local, work, inp.real, inp.recv,
                       queries, hiding)
