"""Blocks the runtime's PyTorch kernel visits on its lean and ring paths.

The kernel (worker_runtime/kernels.py, ``build_masked_meta``) takes queries and keys as
(doc, position) rows, each sorted by (doc, position); query blocks of ``block_q`` rows
each read the keys from the first key of the block's first query's doc up to the last key
at or below the block's last query, cut into key blocks of ``block_k``; every block pair
is computed dense. Per call that gives (pairs, key blocks, query blocks).

Calls of one rank (worker_runtime/overlap.py, ring.py), rows in (doc, start) order:

- lean local: every real query against the rank's own keys;
- lean remote: the queries that see a remote key (rows of a doc at or after the doc's
  first position the rank does not hold) against the distinct remote keys (per doc, the
  positions below the end of the rank's last shard of it that it does not hold);
- ring step s: the queries that see a key of the block of slot ``i - s`` against that
  block's real rows.

Two forms: per rank from its rows (:func:`lean_work`, :func:`ring_step_work`; the
reference, O(rows + blocks) numpy) and for a whole group from shard arrays
(:func:`group_lean_work`, :func:`group_ring_work`; O(s log s + blocks) for s shards, no
loop over ranks), compared on random groups in tests. Shards are taken sorted by
(doc, start) and disjoint on each rank, as plans hold them; the runtime's own metadata is
the check of the reference (tests/test_step_time.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from planner_service.core.errors import FieldError
from planner_service.core.plan import Shard


class Blocks(NamedTuple):
    """What one kernel call computes."""

    pairs: int
    """Query-key pairs computed (dense block pairs, masked ones included)."""
    tiles: int
    """Key blocks visited (block pairs)."""
    row_blocks: int
    """Query blocks."""
    queries: int
    """Query rows of the call."""


NO_BLOCKS = Blocks(0, 0, 0, 0)


def masked_blocks(q_doc: np.ndarray, q_pos: np.ndarray, k_doc: np.ndarray, k_pos: np.ndarray,
                  block_q: int, block_k: int) -> Blocks:
    """``build_masked_meta``'s blocks for these rows, counted. O(T + K) numpy.

    Key rows with a negative doc (padding) sort last and are never read.
    """
    q_doc, q_pos = np.asarray(q_doc, np.int64), np.asarray(q_pos, np.int64)
    k_doc, k_pos = np.asarray(k_doc, np.int64), np.asarray(k_pos, np.int64)
    if len(q_doc) == 0:
        return NO_BLOCKS
    stride = int(max(q_pos.max(initial=0), k_pos.max(initial=0))) + 1
    k_key = np.where(k_doc < 0, np.iinfo(np.int64).max, k_doc * stride + k_pos)
    q0 = np.arange(0, len(q_doc), block_q, dtype=np.int64)
    q1 = np.minimum(q0 + block_q, len(q_doc))
    k_lo = np.searchsorted(k_key, q_doc[q0] * stride, side="left")
    k_hi = np.searchsorted(k_key, q_doc[q1 - 1] * stride + q_pos[q1 - 1], side="right")
    span = np.maximum(k_hi - k_lo, 0)
    return Blocks(int(((q1 - q0) * span).sum()), int((-(-span // block_k)).sum()), len(q0),
                  len(q_doc))


def shard_rows(shards: Sequence[Shard]) -> tuple[np.ndarray, np.ndarray]:
    """(doc, position) of every row of ``shards`` sorted by (doc, start)."""
    ordered = sorted(s for s in shards if s.end > s.start)
    if not ordered:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    doc = np.array([s.doc for s in ordered], dtype=np.int64)
    start = np.array([s.start for s in ordered], dtype=np.int64)
    length = np.array([s.end - s.start for s in ordered], dtype=np.int64)
    first = np.cumsum(length) - length
    pos = np.arange(int(length.sum()), dtype=np.int64) - np.repeat(first - start, length)
    return np.repeat(doc, length), pos


def seeing(doc: np.ndarray, pos: np.ndarray, key_doc: np.ndarray, key_pos: np.ndarray) -> np.ndarray:
    """Rows (doc, pos) that see at least one key (same doc, key position <= pos)."""
    if len(key_doc) == 0 or len(doc) == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((key_pos, key_doc))
    docs, first = np.unique(key_doc[order], return_index=True)
    first_pos = key_pos[order][first]
    at = np.minimum(np.searchsorted(docs, doc), len(docs) - 1)
    return np.flatnonzero((docs[at] == doc) & (first_pos[at] <= pos))


class LeanWork(NamedTuple):
    local: Blocks
    remote: Blocks
    remote_keys: int
    """Distinct remote KV rows the rank keeps (its all-to-all-v receive)."""


def lean_work(shards: Sequence[Shard], block_q: int, block_k: int) -> LeanWork:
    """The two calls of one rank on the lean path (module docstring), from its rows."""
    doc, pos = shard_rows(shards)
    local = masked_blocks(doc, pos, doc, pos, block_q, block_k)
    if len(doc) == 0:
        return LeanWork(local, NO_BLOCKS, 0)
    # Remote keys: per doc, the positions below the doc's last own row + 1 not held here.
    docs, first = np.unique(doc, return_index=True)
    last = np.append(first[1:], len(doc)) - 1
    limit = pos[last] + 1
    gaps_doc, gaps_pos = [], []
    for d, lo, hi, e in zip(docs.tolist(), first.tolist(), last.tolist(), limit.tolist(), strict=True):
        held = np.zeros(e, dtype=bool)
        held[pos[lo:hi + 1]] = True
        missing = np.flatnonzero(~held)
        gaps_doc.append(np.full(len(missing), d, dtype=np.int64))
        gaps_pos.append(missing)
    k_doc, k_pos = np.concatenate(gaps_doc), np.concatenate(gaps_pos)
    rows = seeing(doc, pos, k_doc, k_pos)
    remote = masked_blocks(doc[rows], pos[rows], k_doc, k_pos, block_q, block_k)
    return LeanWork(local, remote, len(k_doc))


def ring_step_work(shards: Sequence[Shard], block: Sequence[Shard], block_q: int,
                   block_k: int) -> Blocks:
    """One ring step's call: this rank's queries that see a key of ``block`` (another
    slot's shards) against that block's rows."""
    doc, pos = shard_rows(shards)
    k_doc, k_pos = shard_rows(block)
    rows = seeing(doc, pos, k_doc, k_pos)
    return masked_blocks(doc[rows], pos[rows], k_doc, k_pos, block_q, block_k)


# -- the whole group at once, from shard arrays ---------------------------------------------


class SortedShards(NamedTuple):
    """A group's non-empty shards sorted by (rank, doc, start), with their (rank, doc) runs."""

    rank: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    num_ranks: int
    run: np.ndarray
    """Run (rank, doc) of each shard, numbered in sorted order."""
    run_first: np.ndarray
    """First shard of each run."""
    before: np.ndarray
    """Per shard, the rank's tokens of the same doc in earlier shards."""
    rank_row: np.ndarray
    """Per shard, its first row in its rank's local rows."""


def sort_shards(rank: np.ndarray, doc: np.ndarray, start: np.ndarray, end: np.ndarray,
                num_ranks: int) -> SortedShards:
    keep = end > start
    rank, doc, start, end = rank[keep], doc[keep], start[keep], end[keep]
    order = np.lexsort((end, start, doc, rank))
    rank, doc, start = rank[order], doc[order], start[order]
    length = end[order] - start
    head = np.ones(len(rank), dtype=bool)
    head[1:] = (rank[1:] != rank[:-1]) | (doc[1:] != doc[:-1])
    run_first = np.flatnonzero(head)
    run = np.cumsum(head) - 1
    cum = np.concatenate(([0], np.cumsum(length)))
    rank_first = np.searchsorted(rank, np.arange(num_ranks), side="left")
    before = cum[:-1] - cum[run_first[run]]
    rank_row = cum[:-1] - cum[rank_first[rank]]
    return SortedShards(rank, doc, start, length, num_ranks, run, run_first, before, rank_row)


class GroupBlocks(NamedTuple):
    """Per call group: ``Blocks`` fields as int64 arrays."""

    pairs: np.ndarray
    tiles: np.ndarray
    row_blocks: np.ndarray
    queries: np.ndarray


def blocks_of_calls(call: np.ndarray, length: np.ndarray, lo_key: np.ndarray, hi_base: np.ndarray,
                    diagonal: bool, num_calls: int, block_q: int, block_k: int) -> GroupBlocks:
    """Blocks of ``num_calls`` calls whose query rows are the given shards, in order.

    Shard i (non-empty) belongs to call ``call[i]`` (non-decreasing); a block whose first
    row is in shard a and last row in shard b reads keys ``[lo_key[a], hi)`` with
    ``hi = hi_base[b]`` plus, if ``diagonal`` (keys are the queries themselves), the rows
    of b up to the block's last. O(shards + blocks).
    """
    zeros = np.zeros(num_calls, dtype=np.int64)
    if len(call) == 0:
        return GroupBlocks(zeros, zeros.copy(), zeros.copy(), zeros.copy())
    row0 = np.concatenate(([0], np.cumsum(length)))
    bounds = np.searchsorted(call, np.arange(num_calls + 1), side="left")
    rows = row0[bounds[1:]] - row0[bounds[:-1]]
    nb = -(-rows // block_q)
    block_call = np.repeat(np.arange(num_calls, dtype=np.int64), nb)
    index = np.arange(int(nb.sum()), dtype=np.int64) - np.repeat(np.cumsum(nb) - nb, nb)
    q0 = row0[bounds[:-1]][block_call] + index * block_q
    q1 = np.minimum(q0 + block_q, row0[bounds[1:]][block_call])
    a = np.searchsorted(row0, q0, side="right") - 1
    b = np.searchsorted(row0, q1 - 1, side="right") - 1
    hi = hi_base[b] + (q1 - row0[b] if diagonal else 0)
    span = np.maximum(hi - lo_key[a], 0)

    def per_call(x: np.ndarray) -> np.ndarray:
        sums = np.concatenate(([0], np.cumsum(x)))
        ends = np.cumsum(nb)
        return sums[ends] - sums[ends - nb]

    return GroupBlocks(per_call((q1 - q0) * span), per_call(-(-span // block_k)), nb, rows)


class GroupLeanWork(NamedTuple):
    local: GroupBlocks
    remote: GroupBlocks
    remote_keys: np.ndarray


def group_lean_work(s: SortedShards, block_q: int, block_k: int) -> GroupLeanWork:
    """``lean_work`` of every rank of the group. O(s + blocks).

    Local: a block reads from its first row's doc run start to its last row. Remote: a
    shard's rows see the gaps below its start (``g = start - before``), all of them when
    ``g > 0``; the remote keys of a run follow those of the rank's earlier runs.
    """
    n = s.num_ranks
    local = blocks_of_calls(s.rank, s.length, s.rank_row[s.run_first[s.run]], s.rank_row, True,
                            n, block_q, block_k)
    gap = s.start - s.before
    run_end = np.maximum.reduceat(s.start + s.length, s.run_first) if len(s.run_first) else \
        np.zeros(0, np.int64)
    run_tokens = np.add.reduceat(s.length, s.run_first) if len(s.run_first) else run_end
    run_far = run_end - run_tokens
    run_rank = s.rank[s.run_first]
    cum = np.concatenate(([0], np.cumsum(run_far)))
    rank_first_run = np.searchsorted(run_rank, np.arange(n + 1), side="left")
    far = cum[rank_first_run[1:]] - cum[rank_first_run[:-1]]
    run_key0 = cum[:-1] - cum[rank_first_run[run_rank]]
    sees = gap > 0
    key0 = run_key0[s.run[sees]]
    remote = blocks_of_calls(s.rank[sees], s.length[sees], key0, key0 + gap[sees], False, n,
                             block_q, block_k)
    return GroupLeanWork(local, remote, far)


MAX_RING_PAIRS = 1 << 20
"""The most (shard, other holder of its doc) pairs a group's ring is modelled for: a ring's
calls are per (rank, step), so the work grows with ranks x shards (a zigzag plan holds
every doc on every rank); well under a second of numpy at the limit on either ring path
(the PyTorch kernel's here, flash-attn's in core/segment_ring_work.py)."""


def ring_pairs(rank: np.ndarray, doc: np.ndarray) -> int:
    """Sum over the non-empty shards (given by rank and doc) of the other ranks holding
    their doc. O(s log s)."""
    if len(rank) == 0:
        return 0
    pairs = np.unique(np.stack((doc, rank)), axis=1)
    docs, holders = np.unique(pairs[0], return_counts=True)
    return int((holders[np.searchsorted(docs, doc)] - 1).sum())


def check_ring_size(pairs: int) -> None:
    """FieldError on ``comm_mode`` when a ring is too large to model (MAX_RING_PAIRS)."""
    if pairs > MAX_RING_PAIRS:
        raise FieldError(
            "comm_mode",
            f"comm_mode: the ring of a p2p_ring plan is modelled for at most {MAX_RING_PAIRS} "
            f"(shard, other holder of its doc) pairs per group, this group has {pairs}; use "
            "fewer ranks or another comm_mode")


class RingSeen(NamedTuple):
    """Per (own shard, run of another rank holding its doc) pair in which the shard sees a
    key of that run; a run is a rank's shards of one doc (``SortedShards.run``)."""

    shard: np.ndarray
    """Index of the query shard in the sorted shards."""
    other: np.ndarray
    """The run of the other rank."""
    seen: np.ndarray
    """The run's tokens below the shard's start (> 0): every row of the shard sees exactly
    these keys of that rank, a prefix of the run."""
    key0: np.ndarray
    """The run's first row in its rank's local rows (the block's rows)."""
    step: np.ndarray
    """The ring step that brings the run's block to the shard's rank: (i - j) mod N."""


def ring_seen(s: SortedShards) -> RingSeen:
    """Every pair of :class:`RingSeen`. O(s log s + t) for t = (own shard, other holder of
    its doc) pairs; ValueError above MAX_RING_PAIRS.

    Own shard a of rank i sees the block of slot j iff j holds tokens of a's doc below a's
    start (``seen`` of them; a's rows hold no position of j's, so every row of a sees
    exactly those keys of that doc); the block's keys of earlier docs come first.
    """
    n = s.num_ranks
    empty = np.zeros(0, dtype=np.int64)
    if len(s.rank) == 0 or n < 2:
        return RingSeen(empty, empty, empty, empty, empty)
    check_ring_size(ring_pairs(s.rank, s.doc))
    run_rank, run_doc = s.rank[s.run_first], s.doc[s.run_first]
    # Runs by doc: each shard pairs with every run of its doc.
    by_doc = np.lexsort((run_rank, run_doc))
    doc_sorted = run_doc[by_doc]
    doc_lo = np.searchsorted(doc_sorted, s.doc, side="left")
    holders = np.searchsorted(doc_sorted, s.doc, side="right") - doc_lo
    shard = np.repeat(np.arange(len(s.rank), dtype=np.int64), holders)
    other = by_doc[np.repeat(doc_lo, holders) + np.arange(int(holders.sum()), dtype=np.int64)
                   - np.repeat(np.cumsum(holders) - holders, holders)]
    keep = other != s.run[shard]
    shard, other = shard[keep], other[keep]
    # Tokens of run ``other`` below the shard's start: its shards starting before it.
    stride = int((s.start + s.length).max()) + 1
    key = s.run * stride + s.start
    idx = np.searchsorted(key, other * stride + s.start[shard], side="left")
    c0 = np.concatenate(([0], np.cumsum(s.length)))
    c = c0[idx] - c0[s.run_first[other]]
    sees = c > 0
    shard, other, c = shard[sees], other[sees], c[sees]
    step = (s.rank[shard] - run_rank[other]) % n
    return RingSeen(shard, other, c, s.rank_row[s.run_first[other]], step)


class GroupRingWork(NamedTuple):
    """One entry per (rank, step) whose call has queries, sorted by (rank, step)."""

    rank: np.ndarray
    step: np.ndarray
    blocks: GroupBlocks


def group_ring_work(s: SortedShards, block_q: int, block_k: int) -> GroupRingWork:
    """``ring_step_work`` of every rank and step with queries: the queries of the pairs of
    :func:`ring_seen`, each against ``seen`` keys from the run's first row. O(s log s + t
    + blocks) for t = (own shard, other holder of its doc) pairs; ValueError above
    MAX_RING_PAIRS."""
    seen = ring_seen(s)
    if len(seen.shard) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return GroupRingWork(empty, empty, GroupBlocks(empty, empty, empty, empty))
    shard, c, key0, step = seen.shard, seen.seen, seen.key0, seen.step
    i = s.rank[shard]
    order = np.lexsort((shard, step, i))
    shard, c, key0, i, step = shard[order], c[order], key0[order], i[order], step[order]
    head = np.ones(len(i), dtype=bool)
    head[1:] = (i[1:] != i[:-1]) | (step[1:] != step[:-1])
    call = np.cumsum(head) - 1
    blocks = blocks_of_calls(call, s.length[shard], key0, key0 + c, False, int(head.sum()),
                             block_q, block_k)
    return GroupRingWork(i[head], step[head], blocks)
