"""FlashCP heuristic sharding (FlashCP, arXiv:2606.08476, Algorithm 1).

Outer loop (Algorithm 1 lines 4-24): try k = 0, 1, 2, ... of the longest docs under
Per-Doc (zigzag) sharding; place the rest by Whole-Doc sharding; stop at the first k
whose imbalance is at most R (fewer Per-Doc docs means less KV to move).

Whole-Doc sharding (lines 5-16), with every rank's capacity T = ceil(S / N) tokens:
1. LPT: docs by length, descending, each whole onto the least-loaded (by workload)
   rank that still has room for it. Whole docs move no KV.
2. The docs that fit nowhere whole are split adaptively over the free room: the fewest
   ranks whose room covers the doc, the lightest head on the most loaded of them and
   the heavy tail on the least loaded, so workload stays balanced, and the KV to move
   is only the prefixes that later pieces need.
Ranks end with exactly T tokens except the last ones, whose shortfall is padding.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from planner_service.core.build import GroupLayout, Layout
from planner_service.core.cost import doc_workload, imbalance, shard_workload
from planner_service.core.plan import Shard
from planner_service.core.request import PlanRequest
from planner_service.solvers.common import zigzag_doc_shards

MAX_PER_DOC = 64
"""Upper bound on Per-Doc docs tried; imbalance left after that comes from integrality."""


class _Ranks:
    """Mutable per-rank state of a layout under construction (plain lists: N is small
    and per-doc numpy calls would cost more than they save)."""

    def __init__(self, n: int, capacity: int) -> None:
        self.shards: list[list[Shard]] = [[] for _ in range(n)]
        self.tokens = [0] * n
        self.work = [0] * n
        self.capacity = capacity

    def copy(self) -> _Ranks:
        other = _Ranks(0, self.capacity)
        other.shards = [list(r) for r in self.shards]
        other.tokens = list(self.tokens)
        other.work = list(self.work)
        return other

    def add(self, rank: int, shard: Shard) -> None:
        self.shards[rank].append(shard)
        self.tokens[rank] += shard.end - shard.start
        self.work[rank] += shard_workload(shard.start, shard.end - shard.start)


def _whole_doc(ranks: _Ranks, docs: Sequence[tuple[int, int]]) -> None:
    """Place (doc, length) pairs, longest first, by Whole-Doc sharding (module docstring)."""
    cap = ranks.capacity
    # Min-heap of (workload, rank) over ranks with room left; full ranks leave for good.
    heap = [(w, r) for r, w in enumerate(ranks.work) if ranks.tokens[r] < cap]
    heapq.heapify(heap)
    spill = []
    for doc, length in docs:
        skipped = []
        while heap and cap - ranks.tokens[heap[0][1]] < length:
            skipped.append(heapq.heappop(heap))
        if heap:
            _, rank = heapq.heappop(heap)
            ranks.add(rank, Shard(doc=doc, start=0, end=length))
            if ranks.tokens[rank] < cap:
                heapq.heappush(heap, (ranks.work[rank], rank))
        else:
            spill.append((doc, length))
        for item in skipped:
            heapq.heappush(heap, item)
    for doc, length in spill:
        room = [cap - t for t in ranks.tokens]
        # Fewest pieces: take the roomiest ranks until their room covers the doc.
        chosen = []
        covered = 0
        for rank in sorted(range(len(room)), key=lambda r: (-room[r], r)):
            if covered >= length or room[rank] <= 0:
                break
            chosen.append(rank)
            covered += room[rank]
        # Light head to the most loaded rank, heavy tail to the least loaded.
        chosen.sort(key=lambda r: (-ranks.work[r], r))
        start = 0
        for i, rank in enumerate(chosen):
            end = length if i == len(chosen) - 1 else min(length, start + room[rank])
            if end > start:
                ranks.add(rank, Shard(doc=doc, start=start, end=end))
            start = end


def _must_exceed(length: int, per_doc: _Ranks, allowed: float) -> bool:
    """True if Whole-Doc placement provably exceeds the allowed max workload: the longest
    remaining doc fits whole on some rank (so LPT places it whole) and alone weighs more
    than allowed."""
    fits = per_doc.capacity - min(per_doc.tokens) >= length
    return fits and doc_workload(length) > allowed


def flashcp_shards(
    doc_lengths: Sequence[int], num_ranks: int, target: float, *, max_per_doc: int = MAX_PER_DOC
) -> tuple[list[list[Shard]], list[int]]:
    """Algorithm 1: per-rank shards and the docs given Per-Doc sharding."""
    n = num_ranks
    capacity = -(-sum(doc_lengths) // n)
    order = sorted(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
    per_doc = _Ranks(n, capacity)  # the Per-Doc part, grown by one doc per iteration
    allowed = target * sum(doc_workload(length) for length in doc_lengths) / n
    best: tuple[float, list[list[Shard]], list[int]] | None = None
    for k in range(min(len(order), max_per_doc) + 1):
        if k:
            doc = order[k - 1]
            for rank, shard in zigzag_doc_shards(doc, doc_lengths[doc], n, np.array(per_doc.tokens)):
                per_doc.add(rank, shard)
        last = k == len(order) or k == max_per_doc or doc_lengths[order[k]] <= 2 * n
        if not last and _must_exceed(doc_lengths[order[k]], per_doc, allowed):
            continue
        ranks = per_doc.copy()
        _whole_doc(ranks, [(d, doc_lengths[d]) for d in order[k:]])
        imb = imbalance(ranks.work)
        if best is None or imb < best[0]:
            best = (imb, ranks.shards, sorted(order[:k]))
        if imb <= target:
            break
        if last:
            break
    assert best is not None
    return best[1], best[2]


def flashcp_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    shards, per_doc = flashcp_shards(doc_lengths, request.cp_size, request.imbalance_target)
    return Layout(
        groups=[GroupLayout(tuple(range(request.cp_size)), shards)],
        info={"per_doc_docs": per_doc, "imbalance_target": request.imbalance_target},
    )
