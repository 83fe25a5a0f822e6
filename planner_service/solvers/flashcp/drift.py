"""The ranks a run of equal docs will likely go to where the ranks' keys cross as the
density falls (``runs.py``'s least-key rule: each doc of L tokens, w = L (L + 1) / 2 work,
to the rank with room of least key A - B d, A its work and B its tokens, d the density
after the doc; ties to the lowest rank).

Where the ranks' token counts differ widely, a key's slope B differs from rank to rank:
as d falls along the run, the ranks holding fewer tokens come up more often than at the
block's first density, and a prediction at one density misses within a few docs.
``drift_ranks`` predicts with the fall: every rank's next docs (its j-th: A + j w - (B + j
L) d) ordered by their keys, each at the density of its place in the order, the order
redone from those keys a few times (``DRIFT_ROUNDS``), then neighbours compared at the
earlier one's density and swapped where out of order (``DRIFT_SWAPS`` odd-even passes at
most). O(M log M + DRIFT_SWAPS x K) for M = O(K + N) candidate docs (at most 3K + 16 +
``FEW_SPARE`` x N) of K predicted on N ranks.

Only a prediction: ``few.place_run`` checks every doc against the keys of all ranks and
places only the rule's ranks, so plans do not depend on it.
"""

from __future__ import annotations

import numpy as np

DRIFT_ROUNDS = 4
"""Times ``drift_ranks`` reorders the candidate docs by their keys at their places."""
FEW_RANKS = 16
"""Active ranks up to which each rank's next docs, up to twice its share and
``FEW_SPARE``, are the candidates (no level search)."""
FEW_SPARE = 16
"""Candidate docs per rank beyond twice its share (``FEW_RANKS``)."""
DRIFT_SWAPS = 64
"""Most odd-even passes of neighbour swaps after the reordering."""


def docs_by_level(phase: np.ndarray, room: np.ndarray, level: float) -> np.ndarray:
    """Per rank, its docs at times <= ``level`` when its j-th doc comes at time phase + j
    and it has room for ``room`` docs. O(N)."""
    return np.clip(np.floor(level - phase) + 1, 0, room).astype(np.int64)


def least_whole_level(phase: np.ndarray, room: np.ndarray, count: int) -> float:
    """The least whole level with ``count`` docs at times at or below it
    (``docs_by_level``), by doubling then bisection. O(N log(count + phase spread))."""
    low, high = -1.0, float(max(1, count // len(phase)))
    while docs_by_level(phase, room, high).sum() < count:
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        if docs_by_level(phase, room, mid).sum() < count:
            low = mid
        else:
            high = mid
    return high


def _level_counts(keys: np.ndarray, step: float, fits: np.ndarray, count: int) -> np.ndarray:
    """Per rank, its docs among the ``count`` of least key at one density (each next doc
    ``step`` above the last): the least whole level of ``count`` docs. O(N log(range))."""
    phase = (keys - keys.min()) / step
    return docs_by_level(phase, fits, least_whole_level(phase, fits, count))


def drift_ranks(work: np.ndarray, tokens: np.ndarray, fits: np.ndarray, length: int,
                densities: np.ndarray) -> np.ndarray | None:
    """The predicted ranks of the block's docs (one per density, every density below
    (L + 1) / 2 and none above the one before), or None if fewer docs fit or are
    candidates. Only a prediction (``few.place_run`` checks it). O(M log M + DRIFT_SWAPS x
    K) for M candidate docs (module docstring)."""
    count = len(densities)
    doc_work = length * (length + 1) // 2
    active = np.flatnonzero(fits)
    if int(fits[active].sum()) < count:
        return None
    room = fits[active]
    first, last = float(densities[0]), float(densities[-1])
    heavy, long = work[active].astype(np.float64), tokens[active].astype(np.float64)
    # Candidates: each rank's docs among the least ``more`` (half as many again) at
    # either end density.
    more = min(int(room.sum()), count + count // 2 + 8)
    if len(active) <= FEW_RANKS:  # each rank's next docs up to twice its share, and more
        most = np.minimum(room, 2 * more // len(active) + FEW_SPARE)
    else:
        most = np.maximum(
            _level_counts(heavy - long * first, doc_work - length * first, room, more),
            _level_counts(heavy - long * last, doc_work - length * last, room, more))
    if int(most.sum()) < count:
        # Room spread unevenly over few ranks (one with room for most docs, the others for
        # few): the capped candidates fall short of the block; no prediction.
        return None
    # The candidates rank by rank, each rank's in order: a stable sort by key breaks ties
    # by rank, then by doc.
    rank = np.repeat(active, most)
    nth = np.arange(len(rank)) - np.repeat(np.cumsum(most) - most, most)
    a = (work[rank] + nth * doc_work).astype(np.float64)
    b = (tokens[rank] + nth * length).astype(np.float64)
    at = densities[np.minimum(np.arange(len(rank)), count - 1)]
    order = np.argsort(a - b * first, kind="stable")
    for _ in range(DRIFT_ROUNDS):
        # Each doc's key at the density of its place in the order, the order redone.
        place = np.empty(len(rank))
        place[order] = at
        again = np.argsort(a - b * place, kind="stable")
        if np.array_equal(again, order):
            break
        order = again
    # Neighbours compared at the earlier one's density, swapped where out of order
    # (ranks distinct: a rank's own docs keep their order), until none is.
    seq = order[:count]
    at_d = densities[:count - 1]
    still = 0  # passes in a row without a swap
    for parity in range(DRIFT_SWAPS):
        lead = np.arange(parity % 2, count - 1, 2)
        x, y = seq[lead], seq[lead + 1]
        kx = a[x] - b[x] * at_d[lead]
        ky = a[y] - b[y] * at_d[lead]
        swap = (rank[x] != rank[y]) & ((ky < kx) | ((ky == kx) & (rank[y] < rank[x])))
        if swap.any():
            seq[lead[swap]], seq[lead[swap] + 1] = y[swap], x[swap]
            still = 0
        else:
            still += 1
            if still == 2:
                break
    return rank[seq]
