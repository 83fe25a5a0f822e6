"""The contiguous halo baseline: the packed sequence in N contiguous equal-token ranges.

The strong simple layout for sliding-window models: rank r holds global packed positions
``[floor(r S / N), floor((r + 1) S / N))`` of the S tokens (range sizes differ by at most
one, the short ranks padded by one token), so a document is cut only where a range ends,
and under a window W each cut moves only the halo, the W - 1 keys before it, to the next
rank (``alltoallv``, core/window_work.py). Under causal attention it is unbalanced (the
last ranks' queries attend the longest prefixes); it is the reference a window-aware
planner must beat on windowed models, not a causal strategy.

O(D + N) for D documents and N ranks: each range is found by bisection on the document
offsets and holds one shard per document it touches.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner_service.core.build import GroupLayout, Layout
from planner_service.core.request import PlanRequest
from planner_service.solvers.common import doc_offsets, global_range_shards


def range_bounds(total: int, num_ranks: int) -> list[int]:
    """The N + 1 range boundaries ``floor(r S / N)``, r = 0 .. N."""
    return [r * total // num_ranks for r in range(num_ranks + 1)]


def contiguous_halo_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    """N contiguous ranges of floor(S / N) or ceil(S / N) tokens, rank r the r-th."""
    n = request.cp_size
    offsets = doc_offsets(doc_lengths)
    bounds = range_bounds(offsets[-1], n)
    ranks = [global_range_shards(offsets, bounds[r], bounds[r + 1]) for r in range(n)]
    return Layout(groups=[GroupLayout(tuple(range(n)), ranks)], info={})
