"""The varlen calls of a ring step on the flash path (``segment_ring``), counted.

A ``p2p_ring`` plan under flash-attn runs as a ring whose steps are varlen calls
(worker_runtime, the shared segment-ring spec). Step 0 is the segments path's local calls
``A(j, i)`` (core/segment_work.py). At step s = 1 .. N - 1 a rank holds the block of slot
``i - s``: that slot's whole local K/V, its shards in (doc, start) order, then padding, so
one doc's tokens are one run of the block, sorted by position. Shards of one doc on two
ranks are disjoint, so a local query shard ``S = [s, e)`` of doc d sees exactly the
block's doc-d tokens below s: a prefix of d's run, ``seen(S)`` rows, every one of them
(a full rectangle).

Per query group j (the documents with more than j shards here, ordered by shard count
descending, then doc id, as the local buffer), the documents split into *classes*: the
maximal runs with the same shard count (each class is doc-id increasing, so its runs in
the block are too). One call per (j, class) where some document of the class has
``seen > 0``; the call spans the class's documents from the first to the last with
``seen > 0``: a document inside with ``seen = 0`` is a *hollow* segment (its rows run
against no key and are masked). Key segments are the documents' prefixes, read in place
from the block between the first used key row and the last; where a used key segment
does not start where the previous one ended, a *zero-query* segment (no query row, the
skipped block rows as keys) fills the hole. Calls of a step in order: j ascending, then
class order.

flash-attn's tiles per segment of q queries and k keys (full): ``ceil(q / tile_q)
ceil(k / tile_k)``; a hollow segment its ``ceil(q / tile_q)`` query tiles and no key tile,
a zero-query segment none. A started tile costs a whole tile (``pairs`` = tiles x tile_q x
tile_k, as on the segments path).

Two forms: per rank (:func:`segment_ring_calls`, :func:`segment_ring_work`: the reference,
plain Python over the spec, from the rank's shards and its ring blocks) and a whole group
at once (:func:`group_segment_ring_work`: numpy over the (shard, other holder of its doc)
pairs of ``masked_work.ring_seen``, no loop over ranks, capped by
``masked_work.MAX_RING_PAIRS``), compared on random groups in tests. Shards are taken in
(doc, start) order, disjoint, as plans hold them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from planner_service.core import masked_work as mw
from planner_service.core import segment_work as sgw
from planner_service.core.plan import Shard


class RingSegmentCall(NamedTuple):
    """One call of a ring step: query rows ``[q_lo, q_lo + q_rows)`` of the local buffer
    against key rows ``[k_lo, k_lo + key_rows)`` of the step's block, as segments."""

    step: int
    group: int
    """Query group j (0-based)."""
    q_lo: int
    """First query row in the local buffer ((group, document) order)."""
    k_lo: int
    """First key row in the block (the slot's local rows)."""
    queries: tuple[int, ...]
    """Query rows per segment (0: a zero-query segment)."""
    keys: tuple[int, ...]
    """Key rows per segment (0 with query rows: a hollow segment)."""

    @property
    def q_rows(self) -> int:
        return sum(self.queries)

    @property
    def key_rows(self) -> int:
        return sum(self.keys)

    @property
    def num_segments(self) -> int:
        return len(self.queries)

    @property
    def hollow_rows(self) -> int:
        """Rows of the hollow segments (the runtime masks them)."""
        return sum(q for q, k in zip(self.queries, self.keys, strict=True) if not k)


def _runs(shards: Sequence[Shard]) -> dict[int, list[Shard]]:
    """Non-empty shards per doc, by start, docs in id order."""
    out: dict[int, list[Shard]] = {}
    for s in sorted(s for s in shards if s.end > s.start):
        out.setdefault(s.doc, []).append(s)
    return out


def segment_ring_calls(shards: Sequence[Shard],
                       blocks: Sequence[Sequence[Shard]]) -> list[list[RingSegmentCall]]:
    """Per ring step s = 1 .. len(blocks) (``blocks[s - 1]``: the shards of slot i - s),
    the calls of the rank holding ``shards`` (module docstring). The reference: plain
    Python, O(steps x (shards + block shards) x M) for M the most shards of one doc here."""
    mine = _runs(shards)
    docs = sorted(mine, key=lambda d: (-len(mine[d]), d))
    most = max((len(p) for p in mine.values()), default=0)
    groups = [[d for d in docs if len(mine[d]) > j] for j in range(most)]
    q_lo: dict[tuple[int, int], int] = {}
    row = 0
    for j, group in enumerate(groups):
        for d in group:
            q_lo[j, d] = row
            row += mine[d][j].end - mine[d][j].start
    out = []
    for step, block in enumerate(blocks, start=1):
        theirs = _runs(block)
        run_start, row = {}, 0
        for d, pieces in theirs.items():
            run_start[d] = row
            row += sum(p.end - p.start for p in pieces)
        calls = []
        for j, group in enumerate(groups):
            for _, members in itertools.groupby(group, key=lambda d: len(mine[d])):
                cls = list(members)
                # The block's doc-d tokens below S_j (its shards starting below S_j's
                # start: the same count for disjoint shards, and the group form's for any).
                seen = [sum(p.end - p.start for p in theirs.get(d, ()) if p.start < mine[d][j].start)
                        for d in cls]
                used = [t for t, c in enumerate(seen) if c]
                if not used:
                    continue
                queries: list[int] = []
                keys: list[int] = []
                end = None  # the block row where the previous used key segment ends
                for t in range(used[0], used[-1] + 1):
                    d = cls[t]
                    if seen[t]:
                        if end is not None and run_start[d] != end:  # a zero-query filler
                            queries.append(0)
                            keys.append(run_start[d] - end)
                        end = run_start[d] + seen[t]
                    queries.append(mine[d][j].end - mine[d][j].start)
                    keys.append(seen[t])
                first = cls[used[0]]
                calls.append(RingSegmentCall(step, j, q_lo[j, first], run_start[first],
                                             tuple(queries), tuple(keys)))
        out.append(calls)
    return out


class RingStepCalls(NamedTuple):
    """The calls of one ring step of one rank, summed (ints), or of several steps (summed
    over them), or one entry per (rank, step) (int64 arrays, :func:`group_segment_ring_work`)."""

    calls: sgw.Calls
    hollow_calls: Any
    """Calls with a hollow segment (their parts are masked whole)."""
    masked_rows: Any
    """Query rows of those calls."""
    whole: Any
    """Calls whose queries are every local row (their log-sum-exp slice is the whole
    accumulator)."""
    steps: Any = 1
    """Steps with a call among those summed."""


def step_calls(calls: Sequence[RingSegmentCall], real: int, tile_q: int, tile_k: int) -> RingStepCalls:
    """The counts of one step's calls (module docstring); ``real``: the rank's real rows."""
    tiles = sum(-(-q // tile_q) * -(-k // tile_k) for c in calls
                for q, k in zip(c.queries, c.keys, strict=True))
    hollow = [c for c in calls if c.hollow_rows]
    return RingStepCalls(
        sgw.Calls(tiles * tile_q * tile_k, tiles, sum(c.num_segments for c in calls),
                  sum(-(-q // tile_q) for c in calls for q in c.queries), len(calls),
                  sum(c.q_rows for c in calls), sum(c.key_rows for c in calls)),
        len(hollow), sum(c.q_rows for c in hollow),
        sum(bool(real) and c.q_rows == real for c in calls), int(bool(calls)))


def segment_ring_work(shards: Sequence[Shard], blocks: Sequence[Sequence[Shard]], tile_q: int,
                      tile_k: int) -> list[RingStepCalls]:
    """:func:`step_calls` of every step of :func:`segment_ring_calls` (one entry per block)."""
    real = sum(s.end - s.start for s in shards if s.end > s.start)
    return [step_calls(calls, real, tile_q, tile_k) for calls in segment_ring_calls(shards, blocks)]


def summed(steps: Sequence[RingStepCalls]) -> RingStepCalls:
    """Several steps' counts added up (ints)."""
    return RingStepCalls(
        sgw.Calls(*(sum(st.calls[k] for st in steps) for k in range(len(sgw.Calls._fields)))),
        sum(st.hollow_calls for st in steps), sum(st.masked_rows for st in steps),
        sum(st.whole for st in steps), sum(st.steps for st in steps))


class GroupSegmentRing(NamedTuple):
    """One entry per (rank, step) with a call, sorted by (rank, step)."""

    rank: np.ndarray
    step: np.ndarray
    work: RingStepCalls
    """int64 arrays, one entry per (rank, step)."""


def group_segment_ring_work(s: mw.SortedShards, tile_q: int, tile_k: int) -> GroupSegmentRing:
    """:func:`segment_ring_work` of every rank and step with a call. O(s log s + t log t)
    for t = (own shard, other holder of its doc) pairs (``masked_work.ring_seen``);
    ValueError above MAX_RING_PAIRS; no loop over ranks, steps or documents.

    A pair (query shard x, the block's run of x's doc) with ``seen > 0`` is x's used key
    segment at that step; its call is (rank, step, piece j, shard count m: the class).
    Sorted by (rank, step, local-buffer position), a call's pairs are consecutive: the
    local buffer orders rows by (j, -m, doc). A call's query rows are the buffer rows from
    its first pair's shard to its last's (hollow shards between included), its key rows
    from the first pair's run start to the last's prefix end; a zero-query segment sits
    between two consecutive pairs whose key segments do not touch.
    """
    n = s.num_ranks
    seen = mw.ring_seen(s)
    empty = np.zeros(0, dtype=np.int64)
    if len(seen.shard) == 0:
        none = sgw.Calls(empty, empty, empty, empty, empty, empty, empty)
        return GroupSegmentRing(empty, empty, RingStepCalls(none, empty, empty, empty, empty))
    count = len(s.rank)
    j = np.arange(count, dtype=np.int64) - s.run_first[s.run]
    m = np.diff(np.append(s.run_first, count))[s.run]
    at = np.lexsort((s.doc, -m, j, s.rank))  # local-buffer order, every rank's in turn
    buf = np.empty(count, dtype=np.int64)
    buf[at] = np.arange(count, dtype=np.int64)
    q_tiles = -(-s.length // tile_q)
    cum_len = np.concatenate(([0], np.cumsum(s.length[at])))
    cum_qt = np.concatenate(([0], np.cumsum(q_tiles[at])))

    x, c, key0, step = seen.shard, seen.seen, seen.key0, seen.step
    i = s.rank[x]
    order = np.lexsort((buf[x], step, i))
    x, c, key0, step, i = x[order], c[order], key0[order], step[order], i[order]
    b, jx, mx = buf[x], j[x], m[x]
    head = np.ones(len(x), dtype=bool)
    head[1:] = ((i[1:] != i[:-1]) | (step[1:] != step[:-1]) | (jx[1:] != jx[:-1])
                | (mx[1:] != mx[:-1]))
    first = np.flatnonzero(head)
    last = np.append(first[1:], len(x)) - 1
    b0, b1 = b[first], b[last] + 1
    queries = cum_len[b1] - cum_len[b0]
    span = b1 - b0
    hollow = span > last - first + 1
    apart = np.zeros(len(x), dtype=np.int64)  # a zero-query segment before the next pair
    apart[:-1] = (key0[1:] != key0[:-1] + c[:-1]) & ~head[1:]
    tiles = np.add.reduceat(q_tiles[x] * -(-c // tile_k), first)
    segments = span + np.add.reduceat(apart, first)
    keys = key0[last] + c[last] - key0[first]
    real = np.bincount(s.rank, weights=s.length, minlength=n).astype(np.int64)

    ci, cs = i[first], step[first]
    step_head = np.ones(len(first), dtype=bool)
    step_head[1:] = (ci[1:] != ci[:-1]) | (cs[1:] != cs[:-1])
    at_step = np.flatnonzero(step_head)

    def per_step(v: np.ndarray) -> np.ndarray:
        return np.add.reduceat(np.asarray(v, dtype=np.int64), at_step)

    t = per_step(tiles)
    calls = sgw.Calls(t * tile_q * tile_k, t, per_step(segments),
                      per_step(cum_qt[b1] - cum_qt[b0]), per_step(np.ones_like(first)),
                      per_step(queries), per_step(keys))
    work = RingStepCalls(calls, per_step(hollow), per_step(hollow * queries),
                         per_step(queries == real[ci]), np.ones(len(at_step), dtype=np.int64))
    return GroupSegmentRing(ci[at_step], cs[at_step], work)
