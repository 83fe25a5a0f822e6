"""FlashCP heuristic sharding (FlashCP, arXiv:2606.08476, Algorithm 1), with comm-aware
balanced passes and token-neutral refinement that bring it close to the exact ILP's comm
saving (bench/results/ilp_compare.md). This module builds the layout and is the
strategy's entry point (``flashcp_shards``, ``flashcp_layout``); the token-neutral moves
that refine it (``_exchange``, ``_descend``) are in ``flashcp_refine.py``.

Every rank ends with at most T = ceil(S / N) tokens (exactly T but for the last ranks'
shortfall, which is explicit padding) and workload at most R x mean where it can.

1. Balanced passes (``_place`` then ``_finish``), each placing the docs in a given order:

   - a doc goes whole to the rank that lags most behind its share of the work, counting
     that every rank will still be filled to T tokens (lag = mean - load - room x the
     workload per token of the docs not yet placed), if the doc fits its token room and
     keeps it within R x mean;
   - a doc that no rank can take within R x mean is zigzagged (Per-Doc sharding) over the
     fewest lagging ranks, not all N: equal shares, and each rank needs only the prefix
     up to its later chunk, so fewer ranks means less KV to move; the outer chunk pair
     (the most KV) goes to the rank that needs least so far. In the nested pass such a
     doc is cut instead into nested pairs of unequal chunks sized so that no rank needs
     much more KV than the others (``flashcp_nested``: the shape of the exact ILP's
     placements of such docs);
   - docs that are light enough but fit no rank's room are split over the free room at
     the end (the fewest, roomiest ranks), pieces ordered for balance or for less KV;
   - if the result misses R, ``_exchange`` rebalances without changing any token count:
     the busiest rank swaps its highest positions of a doc for as many of the lowest
     positions of a doc on a light rank (the same doc preferred: both already need its
     prefix), a few times; across docs it gives a middle stretch instead of the top one
     where that needs less KV (a fold: the light rank then needs only the prefix below
     the stretch);

   The passes (``_passes``): docs longest first, finished with the spill for balance and,
   on small requests, also with the spill for less KV; and, when some docs must be split
   and others are heavy but fit whole, the heavy docs first, so the must-split docs are
   cut into the room left rather than splitting a heavy doc too; and, on small requests
   with a doc that must be split, the nested pass (fill-aware, spill for less KV).
   ``_descend`` then trades positions of shared docs (for the same doc's, or for a doc
   held whole) to lower the most KV any rank receives, within R (on requests with many
   docs, within part of R's slack: ``DESCENT_SLACK``), on the ``DESCENDED`` layout that
   receives least before it, and the layout with the least KV on the critical path wins.
   Large requests (many docs x ranks) skip the extra passes and the descent, so every
   batch plans in under 1 ms.

2. If no pass meets R, Algorithm 1 as published (lines 4-24): try k = 0, 1, 2, ... of
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
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from planner_service.core.build import GroupLayout, Layout
from planner_service.core.cost import alltoallv_receives, doc_workload, imbalance
from planner_service.core.plan import Shard
from planner_service.core.request import PlanRequest
from planner_service.solvers.common import zigzag_doc_shards
from planner_service.solvers.flashcp_nested import nested_zigzag
from planner_service.solvers.flashcp_refine import _crossing as _crossing  # re-export (tests)
from planner_service.solvers.flashcp_refine import _descend, _exchange

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


class _Pass(NamedTuple):
    """One run of the balanced pass's placement loop and the layouts finished from it."""

    order: list[int]
    """Docs in the order they are placed."""
    fill_aware: bool
    """Zigzag width counts the ranks' later fill (wider, more balanced)."""
    spills: tuple[bool, ...]
    """One finished layout per entry: spill splits put the largest piece last (True: less
    KV) or balance workload (False)."""
    descend: bool = True
    """Run ``_descend`` on the finished layouts (else only measure their receive)."""
    nested: bool = False
    """Cut the docs no rank can hold whole by ``nested_zigzag`` (equal zigzag if it finds
    no cut)."""


DESCENT_STEPS = 8
"""``_descend`` moves per candidate layout (more gained nothing on the benchmark sets)."""
DESCENDED = 1
"""Layouts descended per request: the one receiving least before descent (a second one
gained 0.2-0.4 points of saving on the 32K sets at N = 4 but cost about 0.1 ms of the
code set's median solve, which the nested pass needs)."""
SEARCH_BUDGET = 256
"""Docs x ranks up to which the heavy-first pass and ``_descend`` run (their cost grows
with both; larger requests, with many short docs, gain least from them: about 1 point of
saving at 128K, while they would take the median solve past 1 ms at N = 8)."""
DESCENT_SLACK = 0.6
"""Share of R's slack (R x mean - mean) the descent may fill on requests above
``FULL_SLACK_BUDGET`` docs x ranks: there, many docs give it many small trades of balance
for KV (at 128K on WLB-LLM, N = 4, all of it raised the mean imbalance from 1.017 to 1.021
for 0.2 points of saving)."""
FULL_SLACK_BUDGET = 64
"""Docs x ranks up to which the descent may fill all of R's slack (few docs: the KV is in
the docs that must be split, and the slack buys most there: half a point of saving on the
32K code set)."""
SPILL_BUDGET = 48
"""Docs x ranks up to which the longest-first layout is also finished with the spill for
less KV (keeps large batches well under a millisecond)."""
NESTED_BUDGET = 64
"""Docs x ranks up to which the nested pass runs when some doc must be split."""
HEAVY = 0.25
"""A doc that fits a rank whole and weighs more than HEAVY x the allowed max workload is
placed before the docs that must be split in the heavy-first order."""


def _passes(
    doc_lengths: Sequence[int], order: list[int], n: int, allowed: float
) -> tuple[list[_Pass], list[_Pass]]:
    """(the balanced passes always run, those run only if no layout of the first meets R).

    The longest-first order's layout is finished both ways (spill for balance, spill for
    less KV) on small requests (docs x ranks within ``SPILL_BUDGET``), where the second
    gains most; large ones finish it for balance only. The heavy-first pass runs within
    ``SEARCH_BUDGET``; the nested pass (longest first, must-split docs by
    ``nested_zigzag``) within ``NESTED_BUDGET`` when some doc must be split (few docs:
    there the KV is in the split docs, and equal zigzag chunks cost most).

    The heavy-first order places the heavy docs that fit a rank whole before the docs no
    rank can hold (longer than the rank's T tokens or heavier than ``allowed``), so those
    are cut into the room the heavy docs leave instead of taking the room a heavy doc needs
    whole (which would then be split too). It exists only when both kinds of doc do. Both
    kinds are runs of the longest-first ``order`` (the must-split docs first, then the
    heavy ones), so the heavy-first order swaps the two runs.
    """
    cap = -(-sum(doc_lengths) // n)
    first = [_Pass(order, False, (False, True) if len(order) * n <= SPILL_BUDGET else (False,))]
    must = heavy = 0  # ends of the two runs in ``order``
    for doc in order:
        length = doc_lengths[doc]
        if length > cap or doc_workload(length) > allowed:
            must = heavy = must + 1
        elif doc_workload(length) > HEAVY * allowed:
            heavy += 1
        else:
            break
    if must and len(order) * n <= NESTED_BUDGET:
        first.append(_Pass(order, True, (True,), nested=True))
    if 0 < must < heavy and len(order) * n <= SEARCH_BUDGET:
        # Not descended: it shares little beyond the zigzagged must-split docs, and descent
        # gained nothing on it in the benchmark sets (bench/ilp_compare.py).
        first.append(_Pass(order[must:heavy] + order[:must] + order[heavy:], True, (True,), False))
    return first, [_Pass(order, True, (False, True))]


def _place(
    doc_lengths: Sequence[int], order: Sequence[int], n: int, allowed: float, fill_aware: bool,
    total_work: int, nested: bool = False,
) -> tuple[_Ranks, list[tuple[int, int]]]:
    """Step 1 of the module docstring up to the spill: the layout so far and the docs left
    to split for tokens (``total_work``: the docs' total workload)."""
    rest_tokens = sum(doc_lengths)
    rest_work = total_work
    cap = -(-rest_tokens // n)
    ranks = _Ranks(n, cap)
    shards, tokens, work = ranks.shards, ranks.tokens, ranks.work
    spill: list[tuple[int, int]] = []
    all_ranks = range(n)
    for doc in order:
        length = doc_lengths[doc]
        doc_work = length * (length + 1) // 2
        rest_tokens -= length
        rest_work -= doc_work
        density = rest_work / rest_tokens if rest_tokens else 0.0
        # Lag up to a constant shared by all ranks: tokens x density - load.
        best, best_lag = -1, float("-inf")
        most = cap - length  # tokens a rank may hold to have room for the doc
        for r in all_ranks:
            if tokens[r] <= most:
                lag = tokens[r] * density - work[r]
                if lag > best_lag:
                    best, best_lag = r, lag
        if best >= 0 and work[best] + doc_work <= allowed:
            # ranks.add(best, doc, 0, length) inlined: most docs take this path.
            shards[best].append(_new_shard(Shard, (doc, 0, length)))
            tokens[best] += length
            work[best] += doc_work
            continue
        if min(work) + doc_work <= allowed:
            spill.append((doc, length))  # light enough but no room: split for tokens
            continue
        if nested and nested_zigzag(ranks, doc, length, allowed, density):
            continue
        by_lag = sorted(range(n), key=lambda r: (work[r] - tokens[r] * density, r))
        fill = density if fill_aware else 0.0
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
        # The outer chunk pair (most KV: the prefix up to the top) to the rank needing least.
        needs = alltoallv_receives(ranks.shards)
        chosen.sort(key=needs.__getitem__)
        _zigzag(ranks, chosen, doc, length)
    return ranks, spill


def _finish(ranks: _Ranks, spill: Sequence[tuple[int, int]], allowed: float, tail_largest: bool) -> None:
    """The rest of step 1: split the spill for tokens, then rebalance if R is missed."""
    _split_spill(ranks, spill, tail_largest=tail_largest)
    if imbalance(ranks.work) > allowed * len(ranks.work) / sum(ranks.work):
        _exchange(ranks, allowed)


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
    total_work = sum(length * (length + 1) for length in doc_lengths) // 2  # sum of doc_workload
    allowed = target * total_work / n
    fallback: tuple[float, _Ranks] | None = None
    steps = DESCENT_STEPS if len(order) * n <= SEARCH_BUDGET else 0
    if n > 1:
        for passes in _passes(doc_lengths, order, n, allowed):
            found: list[tuple[int, int, _Ranks, bool]] = []  # (receive, index, layout, descend)
            for spec in passes:
                placed, spill = _place(doc_lengths, spec.order, n, allowed, spec.fill_aware,
                                       total_work, spec.nested)
                # Without docs to spill, the spill orders give the same layout: finish one.
                spills = spec.spills if spill else spec.spills[:1]
                for i, tail_largest in enumerate(spills):
                    ranks = placed.copy() if i + 1 < len(spills) else placed
                    _finish(ranks, spill, allowed, tail_largest)
                    imb = imbalance(ranks.work)
                    if imb <= target:
                        found.append((max(alltoallv_receives(ranks.shards)), len(found), ranks,
                                      spec.descend and steps > 0))
                    elif fallback is None or imb < fallback[0]:
                        fallback = (imb, ranks)
            if found:
                # The least KV on the critical path after descending the DESCENDED layouts
                # that receive least before it; the first found wins ties.
                found.sort(key=lambda c: c[:2])
                best: tuple[int, int, _Ranks] | None = None
                descended = 0
                mean = total_work / n
                slack = 1.0 if len(order) * n <= FULL_SLACK_BUDGET else DESCENT_SLACK
                for recv, index, ranks, descend in found:
                    if descend and descended < DESCENDED:
                        recv = _descend(ranks, mean + slack * (allowed - mean), steps)
                        descended += 1
                    if best is None or (recv, index) < best[:2]:
                        best = (recv, index, ranks)
                assert best is not None
                return best[2].shards, _zigzagged(best[2], doc_lengths)
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
