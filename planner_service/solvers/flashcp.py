"""FlashCP heuristic sharding (FlashCP, arXiv:2606.08476, Algorithm 1), with a comm-aware
first pass and a token-neutral rebalancing step that bring it within about 10% of the
exact ILP's comm saving (bench/results/ilp_compare.md).

Every rank ends with at most T = ceil(S / N) tokens (exactly T but for the last ranks'
shortfall, which is explicit padding) and workload at most R x mean where it can.

1. A balanced pass (``_balanced_pass``), docs longest (densest) first:

   - a doc goes whole to the rank that lags most behind its share of the work, counting
     that every rank will still be filled to T tokens (lag = mean - load - room x the
     workload per token of the docs not yet placed), if the doc fits its token room and
     keeps it within R x mean;
   - a doc that no rank can take within R x mean is zigzagged (Per-Doc sharding) over the
     fewest lagging ranks, not all N: equal shares, and each rank needs only the prefix
     up to its later chunk, so fewer ranks means less KV to move;
   - docs that are light enough but fit no rank's room are split over the free room at
     the end (the fewest, roomiest ranks);
   - if the result misses R, ``_exchange`` rebalances without changing any token count:
     the busiest rank swaps its highest positions of a doc for as many of the lowest
     positions of a doc on a light rank (the same doc preferred: both already need its
     prefix), a few times.

   Variants (``VARIANTS``: zigzag width by workload alone or counting the later fill;
   spill pieces ordered for less KV or for balance) are tried in order; small requests
   try several and keep the least KV on the critical path, large ones stop after the
   first (``VARIANT_BUDGET``), so a 128K batch plans in well under a millisecond.

2. If no variant meets R, Algorithm 1 as published (lines 4-24): try k = 0, 1, 2, ... of
   the longest docs under Per-Doc sharding over all N ranks, place the rest by Whole-Doc
   sharding, stop at the first k whose imbalance is at most R:

   - LPT: docs by length, descending, each whole onto the least-loaded (by workload) rank
     that still has room for it. Whole docs move no KV.
   - The docs that fit nowhere whole are split adaptively over the free room: the fewest
     ranks whose room covers the doc, the lightest head on the most loaded of them and the
     heavy tail on the least loaded, so workload stays balanced.

   If no k reaches R, the most balanced layout found (pass or Algorithm 1) is returned.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from planner_service.core.build import GroupLayout, Layout
from planner_service.core.cost import comm_volumes, doc_workload, imbalance
from planner_service.core.plan import Shard
from planner_service.core.request import PlanRequest
from planner_service.solvers.common import zigzag_doc_shards

_new_shard = tuple.__new__  # Shard(doc, start, end) without NamedTuple's Python-level __new__ (hot)

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

    def add(self, rank: int, doc: int, start: int, end: int) -> None:
        self.shards[rank].append(_new_shard(Shard, (doc, start, end)))
        self.tokens[rank] += end - start
        # cost.shard_workload inlined (hot path): (2p + s + 1) s / 2 = (p + e + 1)(e - p) / 2.
        self.work[rank] += (start + end + 1) * (end - start) // 2


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
            ranks.add(rank, doc, 0, length)
            if ranks.tokens[rank] < cap:
                heapq.heappush(heap, (ranks.work[rank], rank))
        else:
            spill.append((doc, length))
        for item in skipped:
            heapq.heappush(heap, item)
    _split_spill(ranks, spill, tail_largest=False)


def _split_spill(ranks: _Ranks, spill: Sequence[tuple[int, int]], *, tail_largest: bool) -> None:
    """Split each doc that fits no rank whole over the roomiest ranks (fewest pieces).

    Piece order: ``tail_largest`` puts the largest piece last (its rank receives only the
    pieces before it); otherwise the lightest head goes to the most loaded rank and the
    heavy tail to the least loaded (Algorithm 1's Whole-Doc sharding, for balance).
    """
    cap = ranks.capacity
    for doc, length in spill:
        room = [cap - t for t in ranks.tokens]
        chosen = []
        covered = 0
        for rank in sorted(range(len(room)), key=lambda r: (-room[r], r)):
            if covered >= length or room[rank] <= 0:
                break
            chosen.append(rank)
            covered += room[rank]
        if tail_largest:
            # The roomiest rank takes the tail, as much as it can hold; then the next.
            pieces = []
            left = length
            for rank in chosen:
                take = min(room[rank], left)
                pieces.append((rank, take))
                left -= take
            pieces.reverse()
        else:
            chosen.sort(key=lambda r: (-ranks.work[r], r))
            pieces = []
            left = length
            for i, rank in enumerate(chosen):
                take = left if i == len(chosen) - 1 else min(left, room[rank])
                pieces.append((rank, take))
                left -= take
        start = 0
        for rank, take in pieces:
            if take > 0:
                ranks.add(rank, doc, start, start + take)
            start += take


def _zigzag(ranks: _Ranks, chosen: Sequence[int], doc: int, length: int) -> None:
    """Cut a doc into 2m chunks over the m ``chosen`` ranks, chunk i and 2m-1-i on the
    i-th (Per-Doc sharding over a subset): near-equal workloads, two shards per rank."""
    m = len(chosen)
    base, extra = divmod(length, 2 * m)
    sizes = [base] * (2 * m)
    # The remainder goes one token per rank (low chunks first, then high chunks), so no
    # rank holds more than ceil(L / m) tokens of the doc.
    for k in range(extra):
        sizes[k if k < m else 2 * m - 1 - (k - m)] += 1
    starts = [0] * (2 * m + 1)
    for chunk, size in enumerate(sizes):
        starts[chunk + 1] = starts[chunk] + size
    for i, rank in enumerate(chosen):
        for chunk in (i, 2 * m - 1 - i):
            if sizes[chunk]:
                ranks.add(rank, doc, starts[chunk], starts[chunk + 1])


class _Variant(NamedTuple):
    """One configuration of the balanced pass."""

    fill_aware: bool
    """Zigzag width counts the ranks' later fill (wider, more balanced)."""
    tail_largest: bool
    """Spill splits put the largest piece last (less KV) rather than balance workload."""


VARIANTS = (_Variant(False, False), _Variant(True, False), _Variant(True, True), _Variant(False, True))
"""Tried in this order; small requests try them all and keep the least KV, large ones stop
after the first (``VARIANT_BUDGET``)."""
VARIANT_BUDGET = 128
"""Docs x ranks a request may spend on variants after the first (keeps 128K batches well
under a millisecond)."""
PARTNERS = 2
"""Lightest ranks the busiest one may exchange positions with."""
DESCENT_STEPS = 8
DESCENT_BUDGET = 1000
"""``_descend`` (its cost grows with docs x ranks) runs while docs x ranks x DESCENT_STEPS
stays within this: small requests, where it gains most."""
CROSS_DOCS = 6
"""The busiest rank's docs (furthest-reaching first) tried against a partner's other docs."""
SETTLE = 0.8
"""The exchange brings the busiest rank to mean + SETTLE x (R x mean - mean): moving less
than down to the mean moves fewer tokens, so less KV."""


def _balanced_pass(
    doc_lengths: Sequence[int], order: Sequence[int], n: int, allowed: float, variant: _Variant
) -> _Ranks:
    """Step 1 of the module docstring."""
    cap = -(-sum(doc_lengths) // n)
    ranks = _Ranks(n, cap)
    tokens, work = ranks.tokens, ranks.work
    rest_tokens = sum(doc_lengths)
    rest_work = sum(length * (length + 1) // 2 for length in doc_lengths)
    spill: list[tuple[int, int]] = []
    for doc in order:
        length = doc_lengths[doc]
        doc_work = length * (length + 1) // 2
        rest_tokens -= length
        rest_work -= doc_work
        density = rest_work / rest_tokens if rest_tokens else 0.0
        # Lag up to a constant shared by all ranks: tokens x density - load.
        best, best_lag = -1, float("-inf")
        for r in range(n):
            if cap - tokens[r] >= length:
                lag = tokens[r] * density - work[r]
                if lag > best_lag:
                    best, best_lag = r, lag
        if best >= 0 and work[best] + doc_work <= allowed:
            ranks.add(best, doc, 0, length)
            continue
        if min(work) + doc_work <= allowed:
            spill.append((doc, length))  # light enough but no room: split for tokens
            continue
        by_lag = sorted(range(n), key=lambda r: (work[r] - tokens[r] * density, r))
        fill = density if variant.fill_aware else 0.0
        chosen = None
        for m in range(2, n + 1):
            # The m most lagging ranks with room for an equal share.
            fit = [r for r in by_lag if cap - tokens[r] >= -(-length // m)][:m]
            if len(fit) == m and (m == n or max(
                _ends(ranks, r, length / m, doc_work / m, fill) for r in fit
            ) <= allowed):
                chosen = fit
                break
        if chosen is None:
            spill.append((doc, length))  # no m ranks have room for shares: split for tokens
            continue
        _zigzag(ranks, chosen, doc, length)
    _split_spill(ranks, spill, tail_largest=variant.tail_largest)
    if imbalance(ranks.work) > allowed * n / sum(ranks.work):
        _exchange(ranks, allowed)
    return ranks


def _work(intervals: Sequence[tuple[int, int]]) -> int:
    return sum((a + b + 1) * (b - a) // 2 for a, b in intervals)


Intervals = list[tuple[int, int]]


def _take(intervals: Intervals, count: int, top: bool) -> tuple[Intervals, Intervals]:
    """Split sorted disjoint intervals into (kept, taken): the ``count`` highest (``top``)
    or lowest positions are taken."""
    kept: Intervals = list(intervals)
    taken: Intervals = []
    while count > 0:
        a, b = kept.pop() if top else kept.pop(0)
        size = min(count, b - a)
        if top:
            taken.insert(0, (b - size, b))
            if b - size > a:
                kept.append((a, b - size))
        else:
            taken.append((a, a + size))
            if a + size < b:
                kept.insert(0, (a + size, b))
        count -= size
    return kept, taken


def _exchange(ranks: _Ranks, allowed: float, max_moves: int = 8) -> None:
    """Rebalance without changing any rank's token count: the busiest rank gives its
    highest positions of a doc and takes as many of the lowest positions of a doc on one
    of the two lightest ranks (a later token carries more work: query i attends i + 1
    keys). The same doc on both ranks is preferred, as both already need its prefix;
    else the partner's longest doc (its lowest positions are its cheapest) against my doc
    that ends earliest among those that can move enough (the partner will need its
    prefix)."""
    n = len(ranks.work)
    mean = sum(ranks.work) / n
    for _ in range(max_moves):
        busy = max(range(n), key=lambda r: (ranks.work[r], -r))
        if ranks.work[busy] <= allowed:
            return
        held = _intervals(ranks, busy)
        partners = []
        for other in sorted(range(n), key=lambda r: (ranks.work[r], r))[:PARTNERS]:
            # Aim to bring the busiest rank to mean + SETTLE x slack; never push the partner
            # above ``allowed`` or above the busiest rank's new load.
            most = min(allowed - ranks.work[other], ranks.work[busy] - ranks.work[other])
            goal = min(ranks.work[busy] - mean - SETTLE * (allowed - mean), most)
            if other != busy and goal > 0:
                partners.append((other, goal, most, _intervals(ranks, other)))
        best = _best_move(held, partners, shared=True) or _best_move(held, partners, shared=False)
        if best is None:
            return
        other, x, y, theirs, goal, limit = best
        count = _count_for(held[x], theirs[y], goal, limit)
        mine_kept, mine_given = _take(held[x], count, True)
        their_kept, their_given = _take(theirs[y], count, False)
        if x == y:
            _replace(ranks, busy, x, mine_kept + their_given)
            _replace(ranks, other, x, their_kept + mine_given)
        else:
            _replace(ranks, busy, x, mine_kept)
            _replace(ranks, busy, y, held.get(y, []) + their_given)
            _replace(ranks, other, y, their_kept)
            _replace(ranks, other, x, theirs.get(x, []) + mine_given)


def _best_move(held: dict[int, list[tuple[int, int]]], partners: list, *, shared: bool):
    """The best exchange among the same docs (``shared``) or across docs; None if none
    moves work. ``partners``: (rank, goal, most work it may take, its intervals).
    Returns (partner, my doc, their doc, their intervals, goal, limit)."""
    best = None
    for other, goal, most, theirs in partners:
        if shared:
            pairs = [(d, d) for d in held.keys() & theirs.keys()]
        else:
            longest = sorted(theirs, key=lambda d: -sum(b - a for a, b in theirs[d]))[:2]
            mine = sorted(held, key=lambda d: -held[d][-1][1])[:CROSS_DOCS]
            pairs = [(x, y) for x in mine for y in longest if x != y]
        for x, y in pairs:
            mine_iv, their_iv = held[x], theirs[y]
            # One position moves (my top + 1) - (their bottom + 1); it may already be more
            # than the partner can take.
            if mine_iv[-1][1] - 1 - their_iv[0][0] > most:
                continue
            limit = _crossing(mine_iv, their_iv)
            potential = _edge_work(mine_iv, limit, True) - _edge_work(their_iv, limit, False)
            if potential <= 0:
                continue
            key = (potential >= goal, 0 if shared else -mine_iv[-1][1], min(goal, potential))
            if best is None or key > best[0]:
                best = (key, (other, x, y, theirs, goal, limit))
    return None if best is None else best[1]


def _descend(ranks: _Ranks, allowed: float, max_steps: int) -> None:
    """Lower the critical-path KV within the balance limit: the rank receiving most gives
    the top stretch of a doc it shares with another rank for as many of that rank's lowest
    positions of the doc, so its need of the doc's prefix shrinks and the partner's grows;
    taken when the larger of the two ranks' new receives is below the old maximum and both
    workloads stay within ``allowed``."""
    n = len(ranks.work)
    held = [_intervals(ranks, r) for r in range(n)]
    recv = [sum(iv[-1][1] - sum(b - a for a, b in iv) for iv in h.values()) for h in held]
    for _ in range(max_steps):
        top = max(range(n), key=lambda r: (recv[r], -r))
        best = None
        for other in range(n):
            if other == top:
                continue
            for doc in held[top].keys() & held[other].keys():
                mine, theirs = held[top][doc], held[other][doc]
                limit = _crossing(mine, theirs)
                for count in {min(limit, mine[-1][1] - mine[-1][0]), limit // 2, limit}:
                    if count <= 0:
                        continue
                    moved = _edge_work(mine, count, True) - _edge_work(theirs, count, False)
                    if ranks.work[other] + moved > allowed:
                        continue
                    mine_kept, mine_given = _take(mine, count, True)
                    their_kept, their_given = _take(theirs, count, False)
                    new_mine = sorted(mine_kept + their_given)
                    new_theirs = sorted(their_kept + mine_given)
                    old_mine = mine[-1][1] - sum(b - a for a, b in mine)
                    old_theirs = theirs[-1][1] - sum(b - a for a, b in theirs)
                    top_recv = recv[top] - old_mine + new_mine[-1][1] - sum(b - a for a, b in new_mine)
                    other_recv = recv[other] - old_theirs + new_theirs[-1][1] - sum(
                        b - a for a, b in new_theirs)
                    worst = max(top_recv, other_recv)
                    if worst < recv[top] and (best is None or worst < best[0]):
                        best = (worst, other, doc, new_mine, new_theirs, top_recv, other_recv)
        if best is None:
            return
        _, other, doc, new_mine, new_theirs, top_recv, other_recv = best
        _replace(ranks, top, doc, new_mine)
        _replace(ranks, other, doc, new_theirs)
        held[top][doc], held[other][doc] = _merged(new_mine), _merged(new_theirs)
        recv[top], recv[other] = top_recv, other_recv


def _merged(intervals: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif b > a:
            out.append((a, b))
    return out


def _crossing(mine: Sequence[tuple[int, int]], theirs: Sequence[tuple[int, int]]) -> int:
    """How many of my highest positions lie above as many of their lowest: exchanging
    more would move work back, so the exchange moves most work there. One merge walk:
    my positions downwards from the top, theirs upwards from the bottom."""
    i, j = len(mine) - 1, 0
    if i < 0 or not theirs:
        return 0
    top, bottom = mine[i][1], theirs[0][0]  # next: my top - 1, their bottom
    count = 0
    while True:
        step = min(top - mine[i][0], theirs[j][1] - bottom)
        # The t-th pair of this stretch is top - t > bottom + t - 1 while 2t <= top - bottom.
        fits = (top - bottom) // 2
        if fits < step:
            return count + max(0, fits)
        count += step
        top -= step
        bottom += step
        if top == mine[i][0]:
            i -= 1
            if i < 0:
                return count
            top = mine[i][1]
        if bottom == theirs[j][1]:
            j += 1
            if j == len(theirs):
                return count
            bottom = theirs[j][0]


def _count_for(mine: Sequence[tuple[int, int]], theirs: Sequence[tuple[int, int]], goal: float,
               limit: int) -> int:
    """The largest count up to ``limit`` whose exchange moves at most ``goal`` work (the
    work moved grows with the count up to ``limit``), and at least 1."""
    if len(mine) == 1 and len(theirs) == 1:
        # Single stretches: c positions move c (b - a) - c^2 work (b: my end, a: their
        # start); take the smaller root of c^2 - c (b - a) + goal = 0, then settle exactly.
        span = mine[0][1] - theirs[0][0]
        disc = span * span - 4 * goal
        c = limit if disc < 0 else min(limit, int((span - math.sqrt(disc)) / 2))
        c = max(c, 1)
        while c < limit and (c + 1) * span - (c + 1) ** 2 <= goal:
            c += 1
        while c > 1 and c * span - c * c > goal:
            c -= 1
        return c
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _edge_work(mine, mid, True) - _edge_work(theirs, mid, False) <= goal:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _edge_work(intervals: Sequence[tuple[int, int]], count: int, top: bool) -> int:
    """Work of the ``count`` highest (``top``) or lowest positions of sorted intervals."""
    total = 0
    for a, b in reversed(intervals) if top else intervals:
        if count <= 0:
            break
        size = min(count, b - a)
        lo = b - size if top else a
        total += (2 * lo + size + 1) * size // 2
        count -= size
    return total


def _intervals(ranks: _Ranks, rank: int) -> dict[int, list[tuple[int, int]]]:
    """The rank's shards as sorted position intervals per doc."""
    out: dict[int, list[tuple[int, int]]] = {}
    for s in ranks.shards[rank]:
        out.setdefault(s.doc, []).append((s.start, s.end))
    for intervals in out.values():
        intervals.sort()
    return out


def _replace(ranks: _Ranks, rank: int, doc: int, intervals: Sequence[tuple[int, int]]) -> None:
    """Set the rank's shards of one doc (token count unchanged), updating its workload."""
    old = [s for s in ranks.shards[rank] if s.doc == doc]
    ranks.shards[rank] = [s for s in ranks.shards[rank] if s.doc != doc]
    ranks.work[rank] += _work(intervals) - _work([(s.start, s.end) for s in old])
    ranks.shards[rank].extend(Shard(doc, a, b) for a, b in sorted(intervals) if b > a)


def _ends(ranks: _Ranks, rank: int, share: float, load: float, density: float) -> float:
    """A rank's expected final workload after taking a share (tokens, load) of a doc and
    then filling its remaining room at ``density`` (work per token)."""
    room = max(0.0, ranks.capacity - ranks.tokens[rank] - share)
    return ranks.work[rank] + load + room * density


def _must_exceed(length: int, per_doc: _Ranks, allowed: float) -> bool:
    """True if Whole-Doc placement provably exceeds the allowed max workload: the longest
    remaining doc fits whole on some rank (so LPT places it whole) and alone weighs more
    than allowed."""
    fits = per_doc.capacity - min(per_doc.tokens) >= length
    return fits and doc_workload(length) > allowed


def _algorithm1(
    doc_lengths: Sequence[int], order: Sequence[int], n: int, target: float, allowed: float,
    max_per_doc: int,
) -> tuple[float, _Ranks, list[int]]:
    """Step 2 of the module docstring: (imbalance, layout, Per-Doc docs)."""
    per_doc = _Ranks(n, -(-sum(doc_lengths) // n))  # the Per-Doc part, one more doc per k
    best: tuple[float, _Ranks, list[int]] | None = None
    for k in range(min(len(order), max_per_doc) + 1):
        if k:
            doc = order[k - 1]
            for rank, shard in zigzag_doc_shards(doc, doc_lengths[doc], n, np.array(per_doc.tokens)):
                per_doc.add(rank, shard.doc, shard.start, shard.end)
        last = k == len(order) or k == max_per_doc or doc_lengths[order[k]] <= 2 * n
        if not last and _must_exceed(doc_lengths[order[k]], per_doc, allowed):
            continue
        ranks = per_doc.copy()
        _whole_doc(ranks, [(d, doc_lengths[d]) for d in order[k:]])
        imb = imbalance(ranks.work)
        if best is None or imb < best[0]:
            best = (imb, ranks, sorted(order[:k]))
        if imb <= target or last:
            break
    assert best is not None
    return best


def flashcp_shards(
    doc_lengths: Sequence[int], num_ranks: int, target: float, *, max_per_doc: int = MAX_PER_DOC
) -> tuple[list[list[Shard]], list[int]]:
    """Per-rank shards and the docs cut by Per-Doc (zigzag) sharding (module docstring)."""
    n = num_ranks
    order = sorted(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
    allowed = target * sum(doc_workload(length) for length in doc_lengths) / n
    fallback: tuple[float, _Ranks] | None = None
    passing: list[_Ranks] = []
    spent = 0
    for i, variant in enumerate(VARIANTS if n > 1 else ()):
        # The first always, the second if the first missed R, more within the budget.
        if (passing or i >= 2) and spent + len(order) * n > VARIANT_BUDGET:
            break
        spent += len(order) * n
        ranks = _balanced_pass(doc_lengths, order, n, allowed, variant)
        imb = imbalance(ranks.work)
        if imb <= target:
            passing.append(ranks)
        elif fallback is None or imb < fallback[0]:
            fallback = (imb, ranks)
    if passing:
        # The least KV on the critical path; computed only when there is a choice.
        chosen = passing[0] if len(passing) == 1 else min(
            passing, key=lambda r: max(comm_volumes(r.shards).alltoallv_recv))
        if len(order) * n * DESCENT_STEPS <= DESCENT_BUDGET:
            _descend(chosen, allowed, DESCENT_STEPS)
        return chosen.shards, _zigzagged(chosen, doc_lengths)
    imb, ranks, per_doc = _algorithm1(doc_lengths, order, n, target, allowed, max_per_doc)
    if fallback is not None and fallback[0] < imb:
        return fallback[1].shards, _zigzagged(fallback[1], doc_lengths)
    return ranks.shards, per_doc


def _zigzagged(ranks: _Ranks, doc_lengths: Sequence[int]) -> list[int]:
    """Docs held as two shards on one rank (zigzag), ascending."""
    seen: dict[tuple[int, int], int] = {}
    for rank, shards in enumerate(ranks.shards):
        for s in shards:
            seen[s.doc, rank] = seen.get((s.doc, rank), 0) + 1
    return sorted({doc for (doc, _), count in seen.items() if count > 1})


def flashcp_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    shards, per_doc = flashcp_shards(doc_lengths, request.cp_size, request.imbalance_target)
    return Layout(
        groups=[GroupLayout(tuple(range(request.cp_size)), shards)],
        info={"per_doc_docs": per_doc, "imbalance_target": request.imbalance_target},
    )
