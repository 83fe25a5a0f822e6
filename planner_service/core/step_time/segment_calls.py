"""The varlen calls the runtime's flash path (``segments``) makes on one rank, counted.

Shared by the segments path (segments.py) and the segment ring (segment_ring.py: its
step 0, the local calls).

worker_runtime/segments.py splits a rank's document mask into flash-attn varlen calls. Per
document held here, its local shards sorted by start ``S_1 .. S_m`` (``S_j = [s_j, e_j)``)
and the remote gaps ``G_j = [e_{j-1}, s_j)`` (``e_0 = 0``). Documents are ordered by shard
count, descending, ties by the local row of their first shard; query group ``j`` is the
documents with at least ``j`` shards here (a prefix of that order). With ``M`` the most
shards of one document on the rank, per pass:

- ``A(j, i)``, ``i <= j``: queries ``S_j`` against keys ``S_i`` of every document of group
  ``j``; causal (one square block per document) when ``i = j``, full otherwise.
  ``M (M + 1) / 2`` calls, every one with ``|group j|`` document segments.
- ``B(j, i)``, ``i <= j``: the same queries against ``G_i``, full, over the documents of
  group ``j`` from the first to the last with a non-empty ``G_i``; skipped when every
  ``G_i`` of the group is empty. A document inside that range whose gap is empty is still
  a segment of the call (its query rows run against no key and are masked: *hollow*).

flash-attn's tiles per document segment of ``q`` queries and ``k`` keys: ``ceil(q / tile_q)``
query tiles; full: ``ceil(k / tile_k)`` key tiles each; causal square (``k = q``): query
tile ``a`` reads ``ceil(min((a + 1) tile_q, q) / tile_k)`` key tiles. A started tile costs
a whole tile. The local buffer is the caller's rows in place when the (group, document)
order of the shards is their own order (every document with one shard here, for one).

Two forms: per rank (:func:`segment_calls`, :func:`segment_work`: the reference, Python
over the calls built as the runtime builds them) and a whole group at once
(:func:`group_segment_work`: numpy, no loop over ranks or documents), compared on random
groups in tests; the reference is checked against the runtime's ``build_segment_plan``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from planner_service.core.cost import lex_order
from planner_service.core.plan import Shard


def causal_tiles_of(starts: np.ndarray, lengths: np.ndarray, tile_q: int, tile_k: int) -> np.ndarray:
    """Tiles of causal segments of ``lengths`` queries at doc positions ``starts`` with keys
    ``[0, start + length)`` (int64 arrays): query tile ``a`` reads
    ``ceil((start + min((a + 1) tile_q, length)) / tile_k)`` key tiles. O(query tiles)."""
    if not len(starts):
        return np.zeros(0, dtype=np.int64)
    q_tiles = -(-lengths // tile_q)
    shard_of_tile = np.repeat(np.arange(len(starts)), q_tiles)
    # Index of each query tile within its segment: 0, 1, ... per segment.
    first = np.cumsum(q_tiles) - q_tiles
    j = np.arange(int(q_tiles.sum()), dtype=np.int64) - np.repeat(first, q_tiles)
    last_row = starts[shard_of_tile] + np.minimum((j + 1) * tile_q, lengths[shard_of_tile])
    return np.bincount(shard_of_tile, weights=-(-last_row // tile_k), minlength=len(starts)).astype(
        np.int64
    )


class Calls(NamedTuple):
    """Calls of one kind (local or remote) of one rank, summed (ints; int64 arrays with
    one entry per rank in :func:`group_segment_work`)."""

    pairs: Any
    """Query-key pairs computed: tiles x tile_q x tile_k."""
    tiles: Any
    segments: Any
    """Document segments, summed over the calls (``per_seq_us`` each)."""
    row_blocks: Any
    """Query tiles (hollow segments' included)."""
    calls: Any
    queries: Any
    """Query rows, summed over the calls."""
    keys: Any
    """Key rows, summed over the calls."""


class SegmentWork(NamedTuple):
    """One rank's calls on the segments path and what their copies depend on."""

    local: Calls
    """The ``A`` calls (own keys)."""
    remote: Calls
    """The ``B`` calls (the distinct remote keys)."""
    pieces: Any
    """M: query groups, each starting from its causal ``A(j, j)``."""
    merge_rows: Any
    """Query rows of the local calls merged into an accumulator (``A(j, i < j)``)."""
    hollow_calls: Any
    """Remote calls with a hollow segment (their results are masked: whole-call copies)."""
    hollow_rows: Any
    """Query rows of those calls."""
    whole_local: Any
    """Local calls whose queries are every local row (their log-sum-exp slice is the whole
    accumulator, already contiguous in backward)."""
    whole_remote: Any
    """Remote calls likewise."""
    remote_keys: Any
    """F: the distinct remote KV (the gaps' tokens)."""
    in_place: Any
    """The caller's rows serve as the local buffer (no gathers, no index copies)."""


class SegmentCall(NamedTuple):
    """One call's shape: per document segment, query and key rows."""

    remote: bool
    causal: bool
    queries: tuple[int, ...]
    keys: tuple[int, ...]


def segment_calls(shards: Sequence[Shard]) -> tuple[list[SegmentCall], bool, int]:
    """(the rank's calls as the runtime builds them, whether the local buffer is in place,
    F the distinct remote KV: the gaps' tokens) for its shards in local-row order. O(M^2 D)
    for D documents; the reference. Plans hold disjoint shards; overlapping ones (which
    the runtime refuses) are given empty gaps, as :func:`group_segment_work` does."""
    held = [s for s in shards if s.end > s.start]
    by_doc: dict[int, list[tuple[int, Shard]]] = {}
    for row, s in enumerate(held):
        by_doc.setdefault(s.doc, []).append((row, s))
    for pieces in by_doc.values():
        pieces.sort(key=lambda p: p[1].start)
    docs = sorted(by_doc, key=lambda d: (-len(by_doc[d]), by_doc[d][0][0]))
    most = max((len(p) for p in by_doc.values()), default=0)

    def piece(d: int, j: int) -> int:
        s = by_doc[d][j][1]
        return s.end - s.start

    def gap(d: int, j: int) -> int:
        prev_end = by_doc[d][j - 1][1].end if j else 0
        return max(0, by_doc[d][j][1].start - prev_end)  # 0 for overlapping shards

    calls: list[SegmentCall] = []
    buffer_rows: list[int] = []
    remote_keys = sum(gap(d, j) for d in docs for j in range(len(by_doc[d])))
    for j in range(most):
        group = [d for d in docs if len(by_doc[d]) > j]
        buffer_rows += [by_doc[d][j][0] for d in group]
        q = tuple(piece(d, j) for d in group)
        for i in range(j + 1):
            calls.append(SegmentCall(False, i == j, q, tuple(piece(d, i) for d in group)))
            gaps = [gap(d, i) for d in group]
            nonzero = [t for t, g in enumerate(gaps) if g]
            if nonzero:
                t0, t1 = nonzero[0], nonzero[-1] + 1
                calls.append(SegmentCall(True, False, q[t0:t1], tuple(gaps[t0:t1])))
    return calls, buffer_rows == list(range(len(held))), remote_keys


def segment_work(shards: Sequence[Shard], tile_q: int, tile_k: int) -> SegmentWork:
    """The counts of :func:`segment_calls` (module docstring for the tiles)."""
    calls, in_place, remote_keys = segment_calls(shards)
    real = sum(s.end - s.start for s in shards if s.end > s.start)

    def tiles(c: SegmentCall) -> int:
        if c.causal:
            q = np.array(c.queries, dtype=np.int64)
            return int(causal_tiles_of(np.zeros_like(q), q, tile_q, tile_k).sum())
        return sum(-(-q // tile_q) * -(-k // tile_k) for q, k in zip(c.queries, c.keys, strict=True))

    def summed(remote: bool) -> Calls:
        kind = [c for c in calls if c.remote == remote]
        t = sum(tiles(c) for c in kind)
        return Calls(t * tile_q * tile_k, t, sum(len(c.queries) for c in kind),
                     sum(-(-q // tile_q) for c in kind for q in c.queries), len(kind),
                     sum(sum(c.queries) for c in kind), sum(sum(c.keys) for c in kind))

    hollow = [c for c in calls if c.remote and 0 in c.keys]
    whole = [c for c in calls if real and sum(c.queries) == real]
    return SegmentWork(
        local=summed(False), remote=summed(True),
        pieces=sum(c.causal for c in calls),
        merge_rows=sum(sum(c.queries) for c in calls if not c.remote and not c.causal),
        hollow_calls=len(hollow), hollow_rows=sum(sum(c.queries) for c in hollow),
        whole_local=sum(not c.remote for c in whole), whole_remote=sum(c.remote for c in whole),
        remote_keys=remote_keys, in_place=in_place)


# -- the whole group at once -------------------------------------------------------------------


def group_segment_work(rank: np.ndarray, doc: np.ndarray, start: np.ndarray, end: np.ndarray,
                       num_ranks: int, tile_q: int, tile_k: int) -> SegmentWork:
    """:func:`segment_work` of every rank of a group: shard arrays rank by rank (``rank``
    non-decreasing), each rank's shards in its local-row order; fields are int64 arrays
    (``in_place`` bool) with one entry per rank. O(s log s + c + q) in numpy for s shards,
    c candidate remote calls (``M (M + 1) / 2`` per rank) and q query tiles (only when
    ``tile_k`` does not divide ``tile_q``); no loop over ranks or documents. Shards already
    in (rank, doc, start) order, as plans hold them, skip both sorts: O(s + c) then."""
    n = num_ranks
    keep = end > start
    if not keep.all():
        rank, doc, start, end = rank[keep], doc[keep], start[keep], end[keep]
    zero = np.zeros(n, dtype=np.int64)
    if not len(rank):
        none = Calls(zero, zero, zero, zero, zero, zero, zero)
        return SegmentWork(none, none, zero, zero, zero, zero, zero, zero, zero,
                           np.ones(n, dtype=bool))
    count = len(rank)
    same_rank = rank[1:] == rank[:-1]
    same_doc = same_rank & (doc[1:] == doc[:-1])
    in_order = bool(np.all(same_doc & (start[1:] > start[:-1]) | same_rank & (doc[1:] > doc[:-1])
                           | (rank[1:] > rank[:-1])))
    head = np.ones(count, dtype=bool)
    if in_order:
        order = np.arange(count, dtype=np.int64)
        r, s, e = rank, start, end
        np.logical_not(same_doc, out=head[1:])
    else:
        order = lex_order((start, doc, rank))
        r, d, s, e = rank[order], doc[order], start[order], end[order]
        head[1:] = (r[1:] != r[:-1]) | (d[1:] != d[:-1])
    # Runs: a rank's shards of one doc, by start; j = a shard's piece index in its run.
    run_first = np.flatnonzero(head)
    run = np.cumsum(head) - 1
    j = np.arange(count) - run_first[run]
    m_run = np.diff(np.append(run_first, count))
    m = m_run[run]
    length = e - s
    prev_end = np.empty_like(e)
    prev_end[0] = 0
    prev_end[1:] = e[:-1]
    prev_end[head] = 0
    gap = np.maximum(s - prev_end, 0)
    per_rank = _summer(r, n)
    # Document order t per rank: most shards first, then the local row of the first shard
    # (the run order itself when the shards came in (doc, start) order).
    run_rank = r[run_first]
    most_shards = int(m_run.max())
    if in_order:
        key = run_rank * (most_shards + 1) - m_run
        by = (None if most_shards == 1 or bool(np.all(key[1:] >= key[:-1]))
              else np.argsort(key, kind="stable"))
    else:
        by = np.lexsort((order[run_first], -m_run, run_rank))
    rank_first_run = np.searchsorted(run_rank, np.arange(n))
    if by is None:  # already in document order
        t_run = np.arange(len(run_first)) - rank_first_run[run_rank]
    else:
        t_run = np.empty(len(run_first), dtype=np.int64)
        t_run[by] = np.arange(len(by)) - rank_first_run[run_rank[by]]
    t = t_run[run]
    has = np.zeros(n, dtype=bool)
    has[run_rank] = True
    first_doc = rank_first_run[has] if by is None else by[rank_first_run[has]]
    most = zero.copy()  # M: the first document in order has the most shards
    most[has] = m_run[first_doc]

    # (rank, group j) table: D = documents with more than j shards = shards with index j.
    cum_most = np.concatenate(([0], np.cumsum(most)))
    pid = cum_most[r] + j
    docs_in = np.bincount(pid, minlength=int(cum_most[-1]))
    base = np.concatenate(([0], np.cumsum(docs_in)))
    buf = base[pid] + t  # position in the local buffer's (rank, group, document) order

    q_tiles = -(-length // tile_q)
    k_tiles = -(-length // tile_k)
    if tile_q % tile_k:
        square = causal_tiles_of(np.zeros_like(length), length, tile_q, tile_k)
    else:  # closed form: query tile a < n - 1 reads (a + 1) tile_q / tile_k key tiles
        square = tile_q // tile_k * (q_tiles - 1) * q_tiles // 2 + k_tiles
    jp = j + 1
    rest = m - j  # the calls whose keys are piece j: groups j .. m - 1
    real = per_rank(length)
    lt = per_rank(square + q_tiles * _in_runs(k_tiles, run_first, run, False))
    l_queries = per_rank(jp * length)
    local = Calls(lt * tile_q * tile_k, lt, per_rank(jp), per_rank(jp * q_tiles),
                  most * (most + 1) // 2, l_queries, per_rank(length * rest))
    rt = per_rank(q_tiles * _in_runs(-(-gap // tile_k), run_first, run, True))
    r_keys, far, moved = per_rank(gap * rest), per_rank(gap), per_rank(buf != order)

    # Remote call candidates (rank, j, i <= j); one exists when some document of group j has
    # a non-empty G_i. In buffer order, group i's documents are positions base[(rank, i)] +
    # t, and group j's are the first D(rank, j) of them (j >= i).
    at = np.empty(count, dtype=np.int64)
    at[buf] = np.arange(count)
    nonzero = gap[at] > 0
    nz_count = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(nonzero, out=nz_count[1:])
    nz_pos = np.flatnonzero(nonzero)
    entry_rank = np.repeat(np.arange(n, dtype=np.int64), most)
    entry_j = np.arange(len(docs_in), dtype=np.int64) - cum_most[entry_rank]
    c_entry = np.repeat(np.arange(len(docs_in), dtype=np.int64), entry_j + 1)
    c_rank = entry_rank[c_entry]
    c_block = base[cum_most[c_rank] + np.arange(len(c_entry), dtype=np.int64) - np.repeat(
        np.cumsum(entry_j + 1) - (entry_j + 1), entry_j + 1)]  # base of (rank, i)
    lo = nz_count[c_block]
    hi = nz_count[c_block + docs_in[c_entry]]
    exists = hi > lo
    lo, hi, c_block, c_entry, c_rank = (x[exists] for x in (lo, hi, c_block, c_entry, c_rank))
    t0 = nz_pos[lo] - c_block
    t1 = nz_pos[hi - 1] - c_block + 1
    b0, b1 = base[c_entry] + t0, base[c_entry] + t1
    cum_len = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(length[at], out=cum_len[1:])
    cum_qt = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(q_tiles[at], out=cum_qt[1:])
    queries = cum_len[b1] - cum_len[b0]
    hollow = (hi - lo) < (t1 - t0)
    per_call_rank = _summer(c_rank, n)
    remote = Calls(rt * tile_q * tile_k, rt, per_call_rank(t1 - t0),
                   per_call_rank(cum_qt[b1] - cum_qt[b0]), per_call_rank(np.ones_like(c_rank)),
                   per_call_rank(queries), r_keys)
    return SegmentWork(
        local=local, remote=remote, pieces=most, merge_rows=l_queries - real,
        hollow_calls=per_call_rank(hollow), hollow_rows=per_call_rank(hollow * queries),
        whole_local=(most == 1).astype(np.int64),
        whole_remote=per_call_rank(queries == real[c_rank]), remote_keys=far, in_place=moved == 0)


def _summer(keys: np.ndarray, n: int) -> Any:
    """A function summing an array over the entries of each key 0 .. n - 1 (``keys``
    non-decreasing): one cumulative sum into a kept buffer, then the differences."""
    bounds = np.searchsorted(keys, np.arange(n + 1))
    cum = np.zeros(len(keys) + 1, dtype=np.int64)

    def sums(x: np.ndarray) -> np.ndarray:
        np.cumsum(x, out=cum[1:])
        return cum[bounds[1:]] - cum[bounds[:-1]]

    return sums


def _in_runs(x: np.ndarray, run_first: np.ndarray, run: np.ndarray, inclusive: bool) -> np.ndarray:
    """Per entry, the sum of ``x`` over the earlier entries of its run (and itself if
    ``inclusive``); entries sorted by run."""
    cum = np.cumsum(x)
    before_run = cum[run_first] - x[run_first]
    out = cum - before_run[run]
    return out if inclusive else out - x
