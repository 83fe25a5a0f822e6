"""Building blocks shared by the strategies: position maps and zigzag chunking."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from itertools import accumulate

import numpy as np

from planner_service.core.plan import Shard


def doc_offsets(doc_lengths: Sequence[int]) -> list[int]:
    """Global start of each doc in the packed sequence, plus the total at the end."""
    return [0, *accumulate(doc_lengths)]


def global_range_shards(offsets: Sequence[int], start: int, end: int) -> list[Shard]:
    """Shards covering global packed positions [start, end)."""
    out = []
    doc = bisect.bisect_right(offsets, start) - 1
    while start < end:
        stop = min(end, offsets[doc + 1])
        out.append(Shard(doc=doc, start=start - offsets[doc], end=stop - offsets[doc]))
        start = stop
        doc += 1
    return out


def zigzag_doc_shards(
    doc: int, length: int, num_ranks: int, rank_tokens: np.ndarray
) -> list[tuple[int, Shard]]:
    """Cut one doc into 2N chunks, chunk i and 2N-1-i on rank i (WLB-LLM Per-Doc).

    Lengths need not divide: the L mod 2N extra tokens go one per chunk to the ranks
    holding the fewest tokens so far (``rank_tokens``, updated in place), so token counts
    stay within a few tokens of each other across many docs.
    """
    n = num_ranks
    base, extra = divmod(length, 2 * n)
    sizes = np.full(2 * n, base, dtype=np.int64)
    if extra:
        order = np.argsort(rank_tokens, kind="stable")
        for k in range(extra):
            rank = int(order[k % n])
            sizes[rank if k < n else 2 * n - 1 - rank] += 1
    starts = np.concatenate(([0], np.cumsum(sizes)))
    out = []
    for chunk in np.flatnonzero(sizes):
        rank = int(chunk) if chunk < n else 2 * n - 1 - int(chunk)
        out.append((rank, Shard(doc=doc, start=int(starts[chunk]), end=int(starts[chunk + 1]))))
        rank_tokens[rank] += int(sizes[chunk])
    return out
