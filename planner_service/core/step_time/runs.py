"""A group's shards as (rank, doc) runs, and the pairs a ring's steps are built from.

Shared by the ring paths (ring.py, segment_ring.py) and the window figures
(core/window_work.py): :func:`sort_shards` orders a group's non-empty shards by (rank, doc,
start) with their runs (a rank's shards of one doc), and :func:`ring_seen` lists every
(own shard, run of another rank holding its doc) pair in which the shard sees a key of
that run: a ring's calls are per (rank, step), so its work grows with ranks x shards, and
:func:`check_ring_size` refuses a ring above ``MAX_RING_PAIRS`` such pairs.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from planner_service.core.cost import lex_order, stable_lexsort
from planner_service.core.errors import FieldError


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
    order = lex_order((end, start, doc, rank))
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

MAX_RING_PAIRS = 1 << 20
"""The most (shard, other holder of its doc) pairs a group's ring is modelled for: a ring's
calls are per (rank, step), so the work grows with ranks x shards (a zigzag plan holds
every doc on every rank); well under a second of numpy at the limit on either ring path
(the PyTorch kernel's, ring.py; flash-attn's, segment_ring.py)."""


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
    by_doc = stable_lexsort((run_rank, run_doc))
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

