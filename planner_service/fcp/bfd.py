"""Stage 1: packing sequences into atomic groups (FCP paper, section 4.4, Stage 1).

* ``min_degrees``: ``d_min = ceil(tokens / E)``, the fewest ranks whose memory holds a
  sequence (eq. 3 and 7 with memory counted in tokens per rank).
* ``bfd_headroom``: the paper's Best-Fit-Decreasing: every long sequence (d_min >= 2)
  opens a bin of ``d_min * E`` tokens; short ones, longest first, go to the bin whose
  headroom fits them most tightly. Short sequences that fit no headroom are returned.
* ``pack_balanced``: sequences into a given number of bins, cost-balanced (LPT quality,
  packing.balanced_pack) under the memory capacity, falling back to BFD by tokens.
* ``merge_for_memory``: merge groups until their minimum degrees fit N ranks. Merging
  never needs more ranks (``ceil(a + b) <= ceil(a) + ceil(b)``), so this succeeds whenever
  the batch's tokens fit ``N * E``.

All functions take sequence indices and per-sequence arrays and return lists of index
lists; they never mutate their inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner_service.fcp.packing import (
    balanced_pack,
    best_fit_decreasing,
    descending,
    fit_into_rooms,
)


def min_degrees(tokens: np.ndarray, memory_tokens: int) -> np.ndarray:
    """``ceil(tokens / E)`` per entry (int64)."""
    return -(-np.asarray(tokens, dtype=np.int64) // memory_tokens)


def bfd_headroom(
    tokens: np.ndarray, memory_tokens: int, items: Sequence[int] | None = None
) -> tuple[list[list[int]], list[int]]:
    """Paper BFD: long sequences open bins of ``d_min * E``; shorts best-fit their headroom.

    Returns (bins, leftovers): bins hold a long sequence first and then the short ones
    placed in its headroom; leftovers are the short sequences that fit no headroom, longest
    first. Ties in length keep index order (stable), so the result is deterministic.
    """
    if items is None:
        items = range(len(tokens))
    order = descending(tokens, items)
    sizes = np.asarray(tokens)[order].tolist()
    # Long sequences come first in descending order; each opens a bin.
    num_long = int(np.searchsorted(-np.asarray(sizes), -memory_tokens, side="left"))
    bins = [[i] for i in order[:num_long]]
    rooms = sorted(
        (-(-size // memory_tokens) * memory_tokens - size, b)
        for b, size in enumerate(sizes[:num_long])
    )
    rooms = [r for r in rooms if r[0] > 0]
    leftovers = fit_into_rooms(order[num_long:], sizes[num_long:], rooms, bins)
    return bins, leftovers


def bfd_bins(tokens: np.ndarray, capacity: int, items: Sequence[int]) -> list[list[int]]:
    """Plain Best-Fit-Decreasing by tokens into bins of ``capacity`` (opens bins as needed)."""
    return best_fit_decreasing(tokens, capacity, items)


def pack_balanced(
    tokens: np.ndarray, costs: np.ndarray, items: Sequence[int], num_bins: int, capacity: int,
    *, fallback: bool = True,
) -> list[list[int]] | None:
    """Cost-balanced packing into ``num_bins`` bins of ``capacity`` tokens, else BFD.

    ``packing.balanced_pack`` (LPT quality); if some item fits no bin, BFD by tokens is
    tried when ``fallback`` (it succeeds whenever ``num_bins`` is at least the number of
    bins BFD opens); None if that fails too. Empty bins are dropped.
    """
    if num_bins < 1:
        return None if items else []
    bins, left = balanced_pack(descending(costs, items), costs, tokens, num_bins, capacity)
    if not left:
        return [b for b in bins if b]
    if not fallback:
        return None
    by_tokens = best_fit_decreasing(tokens, capacity, items)
    return by_tokens if len(by_tokens) <= num_bins else None


def merge_for_memory(
    groups: list[list[int]], tokens: np.ndarray, memory_tokens: int, num_ranks: int
) -> list[list[int]] | None:
    """Merge groups until ``sum ceil(S_g / E) <= N``; None if the tokens exceed ``N * E``.

    Each round merges the groups with the most wasted memory (``d_min E - S``), largest
    first, until their waste reaches E: the merged group then needs at least one rank
    fewer. Such a set exists whenever the sum is above N and the tokens fit (total waste
    is then at least E), so every round makes progress.
    """
    sizes = [int(tokens[g].sum()) for g in groups]
    if sum(sizes) > num_ranks * memory_tokens:
        return None
    groups = [list(g) for g in groups]
    while True:
        need = [-(-s // memory_tokens) for s in sizes]
        if sum(need) <= num_ranks:
            return groups
        waste = [d * memory_tokens - s for d, s in zip(need, sizes, strict=True)]
        order = sorted(range(len(groups)), key=lambda g: (-waste[g], g))
        taken, total = [], 0
        for g in order:
            taken.append(g)
            total += waste[g]
            if total >= memory_tokens and len(taken) >= 2:
                break
        merged = sorted(i for g in taken for i in groups[g])
        keep = [g for g in range(len(groups)) if g not in set(taken)]
        groups = [groups[g] for g in keep] + [merged]
        sizes = [sizes[g] for g in keep] + [sum(sizes[g] for g in taken)]
