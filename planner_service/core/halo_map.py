"""Which doc ranges each rank receives from which, for one windowed layer (all-to-all-v).

The exchange of core/window_work.py as a list of transfers: rank ``receiver`` needs the
keys ``[max(0, s - W + 1), s)`` before each of its shards ``[s, e)`` (W None: ``[0, s)``)
that it does not hold itself; each such gap is held by the other ranks' shards of the doc,
and the gap cut at their bounds gives one :class:`Transfer` per (gap, holder shard).
Summed per receiver, the lengths are ``window_work.window_comm_volumes_of``'s
``alltoallv_recv``; the runtime's comm map for a window is this list grouped by
(sender, receiver).

:func:`halo_transfers_of` is numpy over ``cost.ShardArrays`` (O(s log s + x) for s shards
and x transfers); :func:`reference_halo_keys` the keys each (receiver, sender) pair moves,
token by token; compared in tests/test_core_halo_map.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from planner_service.core import cost
from planner_service.core.plan import Shard


class Transfers(NamedTuple):
    """One entry per transfer, sorted by (receiver, doc, lo): ``sender`` sends the doc's
    positions ``[lo, hi)`` to ``receiver``."""

    receiver: np.ndarray
    sender: np.ndarray
    doc: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


def halo_transfers_of(arrays: cost.ShardArrays, window: int | None) -> Transfers:
    """The transfers of the all-to-all-v of one layer of ``window`` (module docstring)."""
    keep = arrays.end > arrays.start
    rank, doc, start, end = (arrays.rank[keep], arrays.doc[keep], arrays.start[keep],
                             arrays.end[keep])
    empty = np.zeros(0, dtype=np.int64)
    if len(rank) == 0:
        return Transfers(empty, empty, empty, empty, empty)
    # The gaps: per (rank, doc) in start order, the halo not covered by the previous shard.
    order = cost.lex_order((start, doc, rank))
    r, d, s, e = rank[order], doc[order], start[order], end[order]
    prev = np.zeros(len(r), dtype=np.int64)
    same = (r[1:] == r[:-1]) & (d[1:] == d[:-1])
    prev[1:] = np.where(same, e[:-1], 0)
    gap_lo = prev if window is None else np.maximum(prev, s - window + 1)
    has_gap = gap_lo < s
    g_rank, g_doc, g_lo, g_hi = r[has_gap], d[has_gap], gap_lo[has_gap], s[has_gap]
    # The holders: every shard in (doc, start) order; a gap overlaps a contiguous run of them.
    by_doc = cost.stable_lexsort((start, doc))
    h_rank, h_doc, h_start, h_end = rank[by_doc], doc[by_doc], start[by_doc], end[by_doc]
    stride = int(end.max()) + 1
    first = np.searchsorted(h_doc * stride + h_end, g_doc * stride + g_lo, side="right")
    last = np.searchsorted(h_doc * stride + h_start, g_doc * stride + g_hi, side="left")
    count = last - first
    gap = np.repeat(np.arange(len(g_rank), dtype=np.int64), count)
    holder = first[gap] + np.arange(int(count.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(count) - count, count)
    lo = np.maximum(g_lo[gap], h_start[holder])
    hi = np.minimum(g_hi[gap], h_end[holder])
    return Transfers(g_rank[gap], h_rank[holder], g_doc[gap], lo, hi)


def transfer_matrix(transfers: Transfers, num_ranks: int) -> np.ndarray:
    """Tokens per (sender, receiver): int64 (N, N)."""
    out = np.zeros((num_ranks, num_ranks), dtype=np.int64)
    np.add.at(out, (transfers.sender, transfers.receiver), transfers.hi - transfers.lo)
    return out


def reference_halo_keys(shards_per_rank: Sequence[Sequence[Shard]], window: int | None
                        ) -> dict[tuple[int, int], set[tuple[int, int]]]:
    """Per (sender, receiver), the (doc, position) keys moved: every key a query of the
    receiver attends that the sender holds, the receiver not."""
    owner = {(doc, p): rank for rank, shards in enumerate(shards_per_rank)
             for doc, s, e in shards for p in range(s, e)}
    out: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for receiver, shards in enumerate(shards_per_rank):
        for doc, s, e in shards:
            for p in range(s, e):
                for k in range(p + 1 if window is None else min(p + 1, window)):
                    sender = owner[(doc, p - k)]
                    if sender != receiver:
                        out.setdefault((sender, receiver), set()).add((doc, p - k))
    return out
