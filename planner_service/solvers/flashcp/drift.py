"""Blocks of a run of equal docs whose ranks' keys cross as the density falls (``runs.py``'s
least-key rule: each doc of L tokens, w = L (L + 1) / 2 work, to the rank with room of
least key A - B d, A its work and B its tokens, d the density after the doc; ties to the
lowest rank).

Where the ranks' token counts differ widely, a key's slope B differs from rank to rank:
as d falls along the run, the ranks holding fewer tokens come up more often than at the
block's first density, and ``runs.sloped_block``'s certificate (one order at every density
of the block) fails. Here each doc is checked at its own density instead:

- ``drift_ranks`` predicts the ranks: every rank's next docs (its j-th: A + j w - (B + j L)
  d) ordered by their keys, each at the density of its place in the order, the order then
  redone from those keys a few times (``DRIFT_ROUNDS``). O(M log M) for M = K + 2N
  candidate docs of K placed.
- ``drift_certified`` certifies them: at the i-th doc every other rank's next doc (the
  doc it takes next in the block, or after it) must have a key above the i-th doc's key
  at d_i, by more than a margin bounding both keys' rounding (``runs.MARGIN``), so the
  predicted rank is the rule's choice. Densities never rise along the block (longest
  first), and a key never falls as d falls, so a doc's key at the start of a stretch of
  steps bounds its keys over the stretch from below: the check is made per stretch of at
  most ``DRIFT_STRETCH`` steps against the most any doc of the stretch picks (a range
  maximum, ``np.maximum.reduceat``-free sparse table). O((K + N) log K + K N /
  DRIFT_STRETCH).

Only a certified prediction is placed, so the rule and its docs are unchanged.
"""

from __future__ import annotations

import numpy as np

DRIFT_ROUNDS = 4
"""Times ``drift_ranks`` reorders the candidate docs by their keys at their places."""
FEW_RANKS = 16
"""Active ranks up to which each rank's next docs, up to twice its share and
``FEW_SPARE``, are the candidates (no level search)."""
FEW_SPARE = 16
DRIFT_SWAPS = 64
"""Most odd-even passes of neighbour swaps after the reordering."""
DRIFT_STRETCH = 32
"""Most steps of the block over which one lower bound of a doc's key is checked."""
DRIFT_STEP_CHECKS = 8
"""Steps checked one by one, per doc and rank of the block, before giving up."""


def _level_counts(keys: np.ndarray, step: float, fits: np.ndarray, count: int) -> np.ndarray:
    """Per rank, its docs among the ``count`` of least key at one density (each next doc
    ``step`` above the last): the least whole level of ``count`` docs. O(N log(range))."""
    phase = (keys - keys.min()) / step

    def docs_by(level: float) -> np.ndarray:
        return np.clip(np.floor(level - phase) + 1, 0, fits).astype(np.int64)

    low, high = -1.0, float(max(1, count // len(keys)))
    while docs_by(high).sum() < count:
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        if docs_by(mid).sum() < count:
            low = mid
        else:
            high = mid
    return docs_by(high)


def drift_ranks(work: np.ndarray, tokens: np.ndarray, fits: np.ndarray, length: int,
                densities: np.ndarray) -> np.ndarray | None:
    """The predicted ranks of the block's docs (one per density, every density below
    (L + 1) / 2 and none above the one before), or None if fewer docs fit. Only a
    prediction (``drift_certified`` checks it). O(M log M), M = K + 2N."""
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
    if len(active) <= FEW_RANKS:  # every rank's next ``more`` docs: few candidates
        most = np.minimum(room, 2 * more // len(active) + FEW_SPARE)
    else:
        most = np.maximum(
            _level_counts(heavy - long * first, doc_work - length * first, room, more),
            _level_counts(heavy - long * last, doc_work - length * last, room, more))
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
