"""The ``segment_ring`` path: flash-attn's varlen calls on a ``p2p_ring`` plan, a ring of them.

flash-attn on the segments flash path with ``p2p_ring`` (worker_runtime, the shared
segment-ring spec): the ring of shifts.py on varlen calls. Step 0 is the segments path's
local calls ``A(j, i)`` (segment_calls.py; own keys, gathered into (group, document) order
unless in place) merged into the float32 accumulators while shift 0 is in flight; step s
runs one full call per (query group, class of its documents with one shard count) that
sees a key of the block, reading the block in place, merged by log-sum-exp. Backward as
``ring``: the blocks circulate again with a T-row dK/dV accumulator each; nothing remote
is kept between the passes.

Cost: **calls** the local calls and every step's calls (``per_seq_us`` per segment of
every call; full rectangles, hollow and zero-query segments as below); **copies**
:func:`segment_ring_rows`; **transfers** 3 (N - 1) shifts, hidden as shifts.py says (each
step's merge copies: :func:`segments.segment_merge_rows`).

At step s = 1 .. N - 1 a rank holds the block of slot ``i - s``: that slot's whole local
K/V, its shards in (doc, start) order, then padding, so one doc's tokens are one run of
the block, sorted by position. Shards of one doc on two ranks are disjoint, so a local
query shard ``S = [s, e)`` of doc d sees exactly the block's doc-d tokens below s: a
prefix of d's run, ``seen(S)`` rows, every one of them (a full rectangle).

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
plain Python over the spec, from the rank's shards and its ring blocks, O(M^2 D + N
(shards + block shards) M)) and a whole group at once (:func:`group_segment_ring_work`:
numpy over the (shard, other holder of its doc) pairs of ``runs.ring_seen``, no loop over
ranks, capped by ``runs.MAX_RING_PAIRS``), compared on random groups in tests. Shards are
taken in (doc, start) order, disjoint, as plans hold them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from planner_service.core.plan import Shard
from planner_service.core.step_time.runs import SortedShards, ring_seen, sort_shards
from planner_service.core.step_time.segment_calls import (
    Calls,
    SegmentWork,
    group_segment_work,
    segment_work,
)
from planner_service.core.step_time.segments import (
    calls_work,
    segment_backward_window_rows,
    segment_forward_window_rows,
    segment_merge_rows,
)
from planner_service.core.step_time.shifts import (
    group_ring_hiding,
    ring_blocks,
    ring_exchange,
    ring_hiding,
)
from planner_service.core.step_time.terms import (
    GroupInput,
    PathModel,
    RankInput,
    Rows,
    Terms,
    add_work,
    assemble,
)


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

    calls: Calls
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
        Calls(tiles * tile_q * tile_k, tiles, sum(c.num_segments for c in calls),
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
        Calls(*(sum(st.calls[k] for st in steps) for k in range(len(Calls._fields)))),
        sum(st.hollow_calls for st in steps), sum(st.masked_rows for st in steps),
        sum(st.whole for st in steps), sum(st.steps for st in steps))


class GroupSegmentRing(NamedTuple):
    """One entry per (rank, step) with a call, sorted by (rank, step)."""

    rank: np.ndarray
    step: np.ndarray
    work: RingStepCalls
    """int64 arrays, one entry per (rank, step)."""


def group_segment_ring_work(s: SortedShards, tile_q: int, tile_k: int) -> GroupSegmentRing:
    """:func:`segment_ring_work` of every rank and step with a call. O(s log s + t log t)
    for t = (own shard, other holder of its doc) pairs (``runs.ring_seen``);
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
    seen = ring_seen(s)
    empty = np.zeros(0, dtype=np.int64)
    if len(seen.shard) == 0:
        none = Calls(empty, empty, empty, empty, empty, empty, empty)
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
    calls = Calls(t * tile_q * tile_k, t, per_step(segments),
                      per_step(cum_qt[b1] - cum_qt[b0]), per_step(np.ones_like(first)),
                      per_step(queries), per_step(keys))
    work = RingStepCalls(calls, per_step(hollow), per_step(hollow * queries),
                         per_step(queries == real[ci]), np.ones(len(at_step), dtype=np.int64))
    return GroupSegmentRing(ci[at_step], cs[at_step], work)


def segment_ring_rows(*, tokens_per_rank: Any, real: Any, work: SegmentWork,
                      ring: RingStepCalls, num_ranks: int) -> Rows:
    """Rows the copies write, forward + backward (values may be arrays): ``work`` the
    rank's segments-path counts (its local calls, the steps 0), ``ring`` its steps' calls
    summed (``ring.steps`` of them with a call). The two windows of the segments path
    (:func:`segments.segment_forward_window_rows`,
    :func:`segments.segment_backward_window_rows`: the local buffer's gathers unless in
    place, the accumulators and each group's first part, the local merges; the local
    dK/dV, the local calls' log-sum-exp slices and adds, dQ/dK/dV back into ``[T]``), and:

    - forward: the steps' merges (:func:`segments.segment_merge_rows`), the output back
      into ``[T]`` (zero fill, cast of r rows, an index copy of r rows unless in place);
      the blocks are read in place;
    - backward: dO and the output gathered (r rows each, unless in place), the zeroed dQ
      accumulator (r rows), per step call its log-sum-exp slice (not when it is the whole
      accumulator), the dQ add (and the masked dQ of a call with a hollow segment) and the
      dK/dV adds of its key rows into the step's part; the T-row dK/dV accumulators as the
      ring's (``ring.ring_rows``): zeros for the first and the final add into the own
      dK/dV (2T, N > 1), the add of each step's part (T per step with a call).
    """
    t, r, gathers, c = tokens_per_rank, real, 1 - work.in_place, ring.calls
    ring_on = num_ranks > 1
    forward = segment_merge_rows(c.calls, c.queries, ring.hollow_calls, ring.masked_rows) + Rows(
        0 * r, t + r + gathers * r, 0 * r, 2 + gathers)
    backward = Rows(ring_on * 2 * t + ring.steps * t, 2 * gathers * r + ring.masked_rows, 0 * r,
                    2 * gathers + 1 + 4 * c.calls - ring.whole + ring.hollow_calls
                    + 4 * ring_on + 2 * ring.steps,
                    c.keys, r + c.queries, c.queries - ring.whole * r)
    return (segment_forward_window_rows(work, r) + forward
            + segment_backward_window_rows(work, t, r) + backward)


def step_merge_rows(st: RingStepCalls) -> Rows:
    """A step's merges (of one step, or one entry per (rank, step))."""
    return segment_merge_rows(st.calls.calls, st.calls.queries, st.hollow_calls, st.masked_rows)


def _terms(inp: RankInput | GroupInput, work: SegmentWork, total: RingStepCalls,
           hiding: Any) -> Terms:
    step = inp.step
    local = calls_work(work.local)
    copies = segment_ring_rows(tokens_per_rank=step.tokens_per_rank, real=inp.real, work=work,
                               ring=total, num_ranks=step.num_ranks)
    return assemble(step, add_work(local, calls_work(total.calls)), copies,
                    ring_exchange(step, inp.recv, local, hiding))


def terms(inp: RankInput) -> Terms:
    """One rank's terms from its calls and its ring blocks (module docstring)."""
    blocks = ring_blocks(inp)
    k = inp.step.kernel
    work = segment_work(inp.shards, k.tile_q, k.tile_k)
    ring = segment_ring_work(inp.shards, blocks, k.tile_q, k.tile_k)
    hiding = ring_hiding([(calls_work(st.calls), step_merge_rows(st)) if st.steps else None
                          for st in ring], inp.step) if inp.step.overlap else None
    return _terms(inp, work, summed(ring), hiding)


def group_terms(inp: GroupInput) -> Terms:
    """Every rank's terms (:func:`group_segment_ring_work`)."""
    a, k, n = inp.arrays, inp.step.kernel, inp.step.num_ranks
    work = group_segment_work(a.rank, a.doc, a.start, a.end, n, k.tile_q, k.tile_k)
    gr = group_segment_ring_work(sort_shards(a.rank, a.doc, a.start, a.end, n), k.tile_q, k.tile_k)
    st = gr.work

    def by_rank(x: np.ndarray) -> np.ndarray:
        return np.bincount(gr.rank, weights=x, minlength=n).astype(np.int64)

    total = RingStepCalls(Calls(*(by_rank(x) for x in st.calls)), *(by_rank(x) for x in st[1:]))
    hiding = group_ring_hiding(gr.rank, gr.step, calls_work(st.calls), step_merge_rows(st),
                               inp.step) if inp.step.overlap else None
    return _terms(inp, work, total, hiding)


MODEL = PathModel(terms, group_terms, hides="ring")
