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

import bisect
import heapq
import math
from collections.abc import Sequence
from itertools import accumulate
from typing import NamedTuple

import numpy as np

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.build import GroupLayout, Layout
from planner_service.core.cost import imbalance
from planner_service.core.mask import AttentionMask
from planner_service.core.plan import Shard
from planner_service.core.request import PlanRequest
from planner_service.solvers.common import doc_offsets, global_range_shards


def range_bounds(total: int, num_ranks: int) -> list[int]:
    """The N + 1 range boundaries ``floor(r S / N)``, r = 0 .. N (in numpy where r S fits
    int64)."""
    if total * num_ranks < 1 << 62:
        return (np.arange(num_ranks + 1, dtype=np.int64) * total // num_ranks).tolist()
    return [r * total // num_ranks for r in range(num_ranks + 1)]


def contiguous_halo_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    """N contiguous ranges of floor(S / N) or ceil(S / N) tokens, rank r the r-th."""
    n = request.cp_size
    offsets = doc_offsets(doc_lengths)
    bounds = range_bounds(offsets[-1], n)
    ranks = [global_range_shards(offsets, bounds[r], bounds[r + 1]) for r in range(n)]
    return Layout(groups=[GroupLayout(tuple(range(n)), ranks)], info={})


class WeightedPrefix:
    """The layer-weighted work ``P(c)`` of packed positions ``[0, c)`` under a mask, and
    its inverse, in closed form.

    Inside a document, position p's weighted work is ``sum_g count_g min(p + 1, W_g)``, so
    the doc prefix ``P_d(p) = sum_g count_g w_g(p)`` with ``w(p) = p (p + 1) / 2`` up to W
    and ``W (W + 1) / 2 + (p - W) W = W p - W (W - 1) / 2`` past it: between consecutive
    windows ``Q p (p + 1) / 2 + B p + C`` (Q the layers still quadratic, B and C from the
    rest), inverted by its root and corrected by a step. O(D G) to build, O(log D + log G)
    a query.
    """

    def __init__(self, doc_lengths: Sequence[int], mask: AttentionMask) -> None:
        self.lengths = list(doc_lengths)
        self.offsets = doc_offsets(doc_lengths)
        groups = [(g.layers, g.window) for g in mask.groups]
        self.breaks = sorted({w for _, w in groups if w is not None})
        # Piece j holds the p with exactly j windows at most p (p >= breaks[j - 1]).
        self.pieces = []
        for j in range(len(self.breaks) + 1):
            below = self.breaks[j - 1] if j else 0
            lin = [(c, w) for c, w in groups if w is not None and w <= below]
            self.pieces.append((sum(c for c, w in groups if w is None or w > below),
                                sum(c * w for c, w in lin),
                                -sum(c * w * (w - 1) // 2 for c, w in lin)))
        self.at_breaks = [self.doc_prefix(b) for b in self.breaks]
        lengths = np.asarray(self.lengths, dtype=np.int64)
        work = np.zeros_like(lengths)
        arrays = _doc_arrays(np.zeros_like(lengths), lengths)
        for count, window in groups:
            work += count * ww.shard_window_workloads(arrays, window)
        self.cum = [0, *accumulate(work.tolist())]
        self.total = self.cum[-1]

    def doc_prefix(self, p: int) -> int:
        """``P_d(p)``: weighted pairs of a doc's first p positions (any doc). O(log G)."""
        quad, lin, const = self.pieces[bisect.bisect_right(self.breaks, p)]
        return quad * p * (p + 1) // 2 + lin * p + const

    def at(self, c: int) -> int:
        """``P(c)``. O(log D + log G)."""
        d = bisect.bisect_right(self.offsets, c) - 1
        if d >= len(self.lengths):
            return self.total
        return self.cum[d] + self.doc_prefix(c - self.offsets[d])

    def at_many(self, cs: Sequence[int]) -> list[int]:
        """``P(c)`` of every c (ascending or not), as ``at_array``."""
        return self.at_array(cs).tolist()

    def at_array(self, cs: Sequence[int] | np.ndarray) -> np.ndarray:
        """``P(c)`` of every c (ascending or not): int64 where every figure fits, else an
        object array of Python ints computed one by one. O(k (log D + log G)) for k
        values."""
        if self.total >= 1 << 61 or not self.lengths:
            return np.asarray([self.at(int(c)) for c in cs], dtype=object)
        c = np.asarray(cs, dtype=np.int64)
        offsets = np.asarray(self.offsets, dtype=np.int64)
        d = np.minimum(np.searchsorted(offsets, c, side="right") - 1, len(self.lengths) - 1)
        p = c - offsets[d]
        piece = np.searchsorted(np.asarray(self.breaks, dtype=np.int64), p, side="right")
        quad, lin, const = (np.asarray(x, dtype=np.int64) for x in zip(*self.pieces, strict=True))
        out = np.asarray(self.cum, dtype=np.int64)[d] + (
            quad[piece] * p * (p + 1) // 2 + lin[piece] * p + const[piece])
        return out

    def doc_reach(self, value: int, length: int) -> int:
        """The greatest p in [0, length] with ``P_d(p) <= value`` (value >= 0). O(log G)."""
        j = bisect.bisect_right(self.at_breaks, value)
        lo = self.breaks[j - 1] if j else 0
        if lo >= length:
            return length
        quad, lin, const = self.pieces[j]
        b = quad / 2 + lin
        root = (value - const) / b if quad == 0 else (
            -b + math.sqrt(b * b + 2 * quad * (value - const))) / quad
        p = min(length, max(lo, int(root)))
        while p < length and self.doc_prefix(p + 1) <= value:
            p += 1
        while p > lo and self.doc_prefix(p) > value:
            p -= 1
        return p

    def reach(self, value: int) -> int:
        """The greatest c with ``P(c) <= value``. O(log D + log G)."""
        if value >= self.total:
            return self.offsets[-1]
        if value < 0:
            return 0
        d = bisect.bisect_right(self.cum, value) - 1
        return self.offsets[d] + self.doc_reach(value - self.cum[d], self.lengths[d])


def _doc_arrays(start: np.ndarray, end: np.ndarray) -> cost.ShardArrays:
    n = len(start)
    idx = np.arange(n, dtype=np.int64)
    return cost.ShardArrays(idx, idx, start, end, np.arange(n + 1, dtype=np.int64))


TAU_STEPS = 8
"""Bisection steps on the largest cut position tau (``weighted_cuts``): tau to within
``1 / 2^8`` of the first feasible cut's, the causal layers' exchange to within 0.4%."""


def weighted_cuts(wp: WeightedPrefix, num_ranks: int, target: float,
                  max_tokens: int | None = None) -> list[int]:
    """The N + 1 global cut positions of a balanced contiguous layout of small exchange.

    Every range's layer-weighted work is at most ``target`` times the mean (and its
    tokens at most ``max_tokens``). A cut at doc position p (0 at a doc boundary) makes
    the next rank receive p keys in causal layers and ``min(p, W - 1)`` in a window's, so
    every window's critical-path exchange is set by the largest p. For a bound tau on it,
    the greedy that puts each cut at the furthest position allowed (doc position at most
    tau, the range's work and tokens within their limits) finds a feasible cut if any
    exists; tau is bisected from the unbounded greedy's largest p down, ``TAU_STEPS``
    steps. ``[]`` if no contiguous cut meets the target.
    O(D G + TAU_STEPS N (log D + G)).
    """
    offsets, lengths = wp.offsets, wp.lengths
    total, n = offsets[-1], num_ranks
    limit = math.floor(target * wp.total / n)
    cap = total if max_tokens is None else max_tokens

    def greedy(tau: int) -> tuple[list[int], int] | None:
        cuts, work, largest = [0], 0, 0
        for i in range(n - 1):
            prev = cuts[-1]
            if wp.total - work > (n - i) * limit or total - prev > (n - i) * cap:
                return None  # the ranks left cannot hold the rest
            c = min(wp.reach(work + limit), prev + cap)
            if c < total:
                d = bisect.bisect_right(offsets, c) - 1
                c = max(prev, min(c, offsets[d] + tau))
                largest = max(largest, c - offsets[d])
            cuts.append(c)
            work = wp.at(c)
        if wp.total - work > limit or total - cuts[-1] > cap:
            return None
        cuts.append(total)
        return cuts, largest

    first = greedy(max(lengths, default=0))
    if first is None:
        return []
    best, hi = first
    lo = 0
    for _ in range(TAU_STEPS):
        if lo >= hi:
            break
        mid = (lo + hi) // 2
        found = greedy(mid)
        if found is None:
            lo = mid + 1
        else:
            best, hi = found[0], found[1]
    return best


def contiguous_figures(wp: WeightedPrefix, cuts: Sequence[int],
                       mask: AttentionMask) -> tuple[float, int]:
    """(layer-weighted imbalance, layer-weighted all-to-all-v critical path) of the
    contiguous layout with ``cuts``, in closed form: rank r's work is
    ``P(c_{r+1}) - P(c_r)``, and it receives, in a layer of window W, ``min(p, W - 1)``
    keys for the doc position p of its first token (p for a causal layer; nothing if it
    holds no token). ``window_work.mask_figures_of`` on the layout gives the same.
    O(N (log D + G))."""
    work = wp.at_many(cuts)
    loads = [b - a for a, b in zip(work, work[1:], strict=False)]
    largest = 0
    for r in range(len(cuts) - 1):
        c = cuts[r]
        if cuts[r + 1] > c:
            largest = max(largest, c - wp.offsets[bisect.bisect_right(wp.offsets, c) - 1])
    comm = sum(g.layers * (largest if g.window is None else min(largest, g.window - 1))
               for g in mask.groups)
    return imbalance(loads), comm


def contiguous_layout(doc_lengths: Sequence[int], cuts: Sequence[int]) -> Layout:
    """Rank r holds global packed positions ``[cuts[r], cuts[r + 1])``. O(D + N)."""
    c = np.asarray(cuts, dtype=np.int64)
    return Layout(groups=[GroupLayout(tuple(range(len(cuts) - 1)),
                                      range_shards(doc_lengths, c[:-1], c[1:], 1))], info={})


def weighted_contiguous_layout(doc_lengths: Sequence[int], request: PlanRequest
                               ) -> Layout | None:
    """N contiguous ranges within ``request.imbalance_target`` on the layer-weighted work
    of ``request.mask`` with a small exchange (``weighted_cuts``), rank r the r-th; None
    if no contiguous cut meets the target."""
    cuts = weighted_cuts(WeightedPrefix(doc_lengths, request.mask), request.cp_size,
                         request.imbalance_target)
    return contiguous_layout(doc_lengths, cuts) if cuts else None


class Chunks(NamedTuple):
    """Equal-token chunks of the packed sequence and the ranks holding them."""

    bounds: np.ndarray
    """The k N + 1 chunk boundaries (``range_bounds``)."""
    held: np.ndarray
    """(N, k): rank r's chunks in packed order."""
    loads: list[int]
    """Per rank, the layer-weighted work of its chunks."""


HEAP_CHUNKS = 2048
"""Most chunks placed one by one (``chunk_ranks``); more are placed in rounds."""


def chunk_ranks(prefix: WeightedPrefix, num_ranks: int, per_rank: int,
                heap: bool | None = None) -> Chunks:
    """The packed sequence in ``per_rank N`` contiguous equal-token chunks, ``per_rank``
    of them on every rank, placed by LPT on their layer-weighted work, heaviest chunk
    first (ties: lower chunk, lower rank). ``heap`` (default: at most ``HEAP_CHUNKS``
    chunks): each onto the least loaded rank still short of ``per_rank`` chunks,
    O(k N log N) in Python; else in rounds of N, the round's heaviest onto the least
    loaded rank, every rank one chunk a round, O(k N log N) in numpy. Tokens per rank
    differ by at most ``per_rank``."""
    n, k = num_ranks, per_rank
    bounds = range_bounds(prefix.offsets[-1], k * n)
    work = np.diff(prefix.at_array(bounds))
    exact = np.int64 if work.dtype == np.int64 else object
    order = np.argsort(-work, kind="stable")
    owner = np.empty(k * n, dtype=np.int64)
    if heap if heap is not None else k * n <= HEAP_CHUNKS:
        queue = [(0, r) for r in range(n)]
        count = [0] * n
        for j, w in zip(order.tolist(), work[order].tolist(), strict=True):
            load, r = heapq.heappop(queue)
            owner[j] = r
            count[r] += 1
            if count[r] < k:
                heapq.heappush(queue, (load + w, r))
        loads = cost.per_rank_sums(work[np.argsort(owner, kind="stable")],
                                   np.arange(0, k * n + 1, k)) if exact is np.int64 else \
            [sum(work[owner == r].tolist()) for r in range(n)]
    else:
        loads = np.zeros(n, dtype=exact)
        for t in range(k):
            block = order[t * n:(t + 1) * n]
            ranks = np.argsort(loads, kind="stable")
            owner[block] = ranks
            loads[ranks] += work[block]
    held = np.argsort(owner, kind="stable").reshape(n, k)
    return Chunks(np.asarray(bounds, dtype=np.int64), held, [int(x) for x in loads])


def chunked_figures(prefix: WeightedPrefix, chunks: Chunks,
                    mask: AttentionMask) -> tuple[float, int, int]:
    """(layer-weighted imbalance, layer-weighted all-to-all-v critical path, tokens on
    the fullest rank) of ``chunks``, in closed form. A chunk's later docs start inside it
    (nothing to receive); its first doc, cut at doc position p, adds ``min(W - 1, p - e)``
    keys in a layer of window W (``p - e`` causal), with e the doc position where the
    rank's previous chunk ends if that one ends inside the same doc, else 0 (as
    ``window_work.window_comm_volumes_of``). ``window_work.mask_figures_of`` on
    ``chunked_layout`` gives the same. O(k N (log D + G)), in numpy."""
    offsets = np.asarray(prefix.offsets, dtype=np.int64)
    n, k = chunks.held.shape
    start = chunks.bounds[chunks.held]
    end = chunks.bounds[chunks.held + 1]
    doc_start = offsets[np.searchsorted(offsets, start, side="right") - 1]
    prev_end = np.zeros_like(start)
    prev_end[:, 1:] = end[:, :-1]
    gap = start - np.maximum(doc_start, prev_end)
    gap[end == start] = 0
    comm = 0
    for group in mask.groups:
        adds = gap if group.window is None else np.minimum(gap, group.window - 1)
        comm += group.layers * int(adds.sum(axis=1).max(initial=0))
    return imbalance(chunks.loads), comm, int((end - start).sum(axis=1).max(initial=0))


def chunked_layout(doc_lengths: Sequence[int], chunks: Chunks) -> Layout:
    """Rank r holds the chunks ``chunks.held[r]``. O(D + k N), in numpy."""
    n, k = chunks.held.shape
    starts = chunks.bounds[chunks.held].ravel()
    ends = chunks.bounds[chunks.held + 1].ravel()
    return Layout(groups=[GroupLayout(tuple(range(n)),
                                      range_shards(doc_lengths, starts, ends, k))], info={})


def range_shards(doc_lengths: Sequence[int], starts: np.ndarray, ends: np.ndarray,
                 per_rank: int) -> list[list[Shard]]:
    """The shards of global packed ranges ``[starts[i], ends[i])``, ``per_rank`` ranges a
    rank in order (``common.global_range_shards`` of each, vectorised). O(D + r) for r
    ranges."""
    offsets = np.asarray(doc_offsets(doc_lengths), dtype=np.int64)
    keep = ends > starts
    first = np.searchsorted(offsets, starts, side="right") - 1
    last = np.searchsorted(offsets, ends - 1, side="right") - 1
    pieces = np.where(keep, last - first + 1, 0)
    range_of = np.repeat(np.arange(len(starts)), pieces)
    doc = first[range_of] + (np.arange(len(range_of)) - np.repeat(
        np.cumsum(pieces) - pieces, pieces))
    lo = np.maximum(starts[range_of], offsets[doc]) - offsets[doc]
    hi = np.minimum(ends[range_of], offsets[doc + 1]) - offsets[doc]
    # tuple.__new__ builds the same Shards 2.5x faster than Shard's generated __new__.
    make = tuple.__new__
    flat = [make(Shard, t) for t in zip(doc.tolist(), lo.tolist(), hi.tolist(), strict=True)]
    per: list[int] = np.add.reduceat(pieces, np.arange(0, len(starts), per_rank)).tolist() \
        if len(starts) else []
    cuts = [0, *accumulate(per)]
    return [flat[cuts[r]:cuts[r + 1]] for r in range(len(cuts) - 1)]
