"""Fast packing primitives shared by stage 1, the micro-batch split and the
reference schedules.

* ``descending``: a deterministic weight-descending order.
* ``balanced_pack``: cost-balanced packing (LPT) into k bins under a token capacity:
  plain LPT checked against the capacity in one numpy pass, exact LPT with a room check
  per item only when a bin would overflow (``lpt_checked``).
* ``best_fit_decreasing``: BFD by tokens into bins of one capacity.
* ``fit_into_rooms``: BFD of items into given rooms, skipping at once past items that
  are larger than every room left.

The reference schedules use the same ``balanced_pack``, so FCP's static-degree candidates
are exactly the groupings the static reference schedule runs.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

import numpy as np


def descending(values: np.ndarray, items: Sequence[int]) -> list[int]:
    """``items`` by ``values[item]`` descending, ties by item id (deterministic)."""
    idx = np.asarray(items, dtype=np.int64)
    return idx[np.lexsort((idx, -np.asarray(values)[idx]))].tolist()


def balanced_pack(
    order: Sequence[int], weights: np.ndarray, sizes: np.ndarray, num_bins: int, capacity: int
) -> tuple[list[list[int]], list[int]]:
    """LPT of item ids ``order`` (weight-descending) into ``num_bins`` bins of ``capacity``.

    Plain LPT (each item to the least-loaded bin) runs first and its bins are checked
    against the capacity at once; only if one overflows is exact LPT with a room check per
    item run (``lpt_checked``: the same choices whenever the capacity does not bind).
    Returns (bins of item ids, ids that fit no bin).
    """
    order = list(order)
    s = np.asarray(sizes, dtype=np.float64)[order]
    if num_bins == 1 and s.sum() <= capacity:
        return [order], []
    w = np.asarray(weights, dtype=np.float64)[order]
    heap = [(0.0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    room = [float(capacity)] * num_bins
    replace = heapq.heapreplace  # the hot loop: one heap step per item
    for i, weight, size in zip(order, w.tolist(), s.tolist(), strict=True):
        load, b = heap[0]
        bins[b].append(i)
        room[b] -= size
        replace(heap, (load + weight, b))
    if min(room) < 0:
        return lpt_checked(order, dict(zip(order, s.tolist(), strict=True)),
                           dict(zip(order, w.tolist(), strict=True)), num_bins, capacity)
    return bins, []


def lpt_checked(
    order: Sequence[int], sizes: dict[int, float], weights: dict[int, float], num_bins: int,
    capacity: int,
) -> tuple[list[list[int]], list[int]]:
    """Exact LPT with a room check: each item to the least-loaded bin that has room."""
    heap = [(0.0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    room = [float(capacity)] * num_bins
    left = []
    for i in order:
        size = sizes[i]
        skipped = []
        while heap and room[heap[0][1]] < size:
            skipped.append(heapq.heappop(heap))
        if heap:
            load, b = heap[0]
            bins[b].append(i)
            room[b] -= size
            heapq.heapreplace(heap, (load + weights[i], b))
        else:
            left.append(i)
        for entry in skipped:
            heapq.heappush(heap, entry)
    return bins, left


def fit_into_rooms(
    order: Sequence[int], sizes: Sequence[int], rooms: list[tuple[int, int]],
    bins: list[list[int]],
) -> list[int]:
    """Best-Fit-Decreasing of ``order`` (size-descending item ids; ``sizes`` aligned with
    it) into ``rooms`` (sorted (room, bin) pairs), appending to ``bins`` in place; returns
    the items that fit no room, in order. Items larger than the largest room are skipped
    in one bisect, so a long tail of unplaceable items costs nothing."""
    left: list[int] = []
    negated = [-x for x in sizes]
    pos = 0
    while pos < len(order):
        if not rooms:
            left.extend(order[pos:])
            break
        # First item no larger than the largest room (sizes descend).
        nxt = bisect.bisect_left(negated, -rooms[-1][0], lo=pos)
        left.extend(order[pos:nxt])
        if nxt == len(order):
            break
        size = sizes[nxt]
        at = bisect.bisect_left(rooms, (size, -1))
        room, b = rooms.pop(at)
        bins[b].append(order[nxt])
        if room > size:
            bisect.insort(rooms, (room - size, b))
        pos = nxt + 1
    return left


def best_fit_decreasing(tokens: np.ndarray, capacity: int, items: Sequence[int]) -> list[list[int]]:
    """Plain BFD by tokens into bins of ``capacity`` (opens bins as needed)."""
    order = descending(tokens, items)
    bins: list[list[int]] = []
    rooms: list[tuple[int, int]] = []
    for i, size in zip(order, np.asarray(tokens)[order].tolist(), strict=True):
        assert size <= capacity, "item larger than a bin"
        at = bisect.bisect_left(rooms, (size, -1))
        if at == len(rooms):
            b, room = len(bins), capacity
            bins.append([])
        else:
            room, b = rooms.pop(at)
        bins[b].append(i)
        if room > size:
            bisect.insort(rooms, (room - size, b))
    return bins
