"""Local search that refines a FlashCP layout after the balanced pass (``place.py``).

Both moves exchange positions between two ranks without changing any rank's token count,
so the layout keeps its T tokens per rank; only workload and KV traffic change:

- ``exchange`` (balance): while the busiest rank exceeds the allowed workload, it gives
  its highest positions of a doc for as many of the lowest positions of a doc on a light
  rank (a later token carries more work: query i attends i + 1 keys); across docs, a
  middle stretch of the doc (``fold``) where that needs less KV than its top;
- ``descend`` (comm): the rank receiving the most KV gives the top stretch of a doc it
  shares with another rank for that rank's lowest positions of the doc, or gives a doc it
  holds whole for as many of the partner's highest positions of a shared doc (filling the
  gap below its own top stretch, ``_best_absorb``), while both stay within the allowed
  workload, so the critical-path receive shrinks.

The layout under construction is ``ranks.Ranks``; ``solve.py`` decides when to run these
moves.

Complexity, with s shards on the ranks involved: ``exchange`` makes at most ``max_moves``
moves, each O(N log N + s log s) (the partner, the candidate pairs of at most
``CROSS_DOCS`` x 2 docs, ``FOLD_COUNTS`` folds); ``descend`` makes at most ``max_steps``
steps, each O(N x shared docs x s) for the pairs and ``ABSORB_TRIES`` whole docs per pair
(binary search over a rank's whole docs), after an O(s log s) setup.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Container, Sequence
from typing import NamedTuple

from planner_service.core.plan import Shard
from planner_service.solvers.flashcp.ranks import Ranks, new_shard

ABSORB_TRIES = 2
"""Whole docs (the longest that fit) ``_best_absorb`` tries per shared doc and partner."""
PARTNERS = 1
"""Lightest ranks the busiest one may exchange positions with: one, so the work moved
lands on the lightest rank and the others keep their room for the descent."""
CROSS_DOCS = 6
"""The busiest rank's docs (furthest-reaching first) tried against a partner's other docs."""
SETTLE = 0.8
"""The exchange brings the busiest rank to mean + SETTLE x (R x mean - mean): moving less
than down to the mean moves fewer tokens, so less KV."""


Intervals = list[tuple[int, int]]


class Move(NamedTuple):
    """An exchange ``_best_move`` found: the busiest rank's doc ``mine`` against the
    partner's doc ``theirs_doc``."""

    partner: int
    """The rank taking the busiest rank's highest positions."""
    mine: int
    """The busiest rank's doc that gives its highest positions."""
    theirs_doc: int
    """The partner's doc that gives its lowest positions."""
    theirs: dict[int, Intervals]
    """The partner's intervals per doc."""
    goal: float
    """Work the move aims to take off the busiest rank."""
    limit: int
    """Most positions exchanged before the move would move work back (``crossing``)."""


def take(intervals: Intervals, count: int, top: bool) -> tuple[Intervals, Intervals]:
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


def exchange(ranks: Ranks, allowed: float, max_moves: int = 8) -> None:
    """Rebalance without changing any rank's token count: the busiest rank gives its
    highest positions of a doc and takes as many of the lowest positions of a doc on the
    lightest rank (``PARTNERS``; a later token carries more work: query i attends i + 1
    keys). The same doc on both ranks is preferred, as both already need its prefix;
    else the partner's longest doc (its lowest positions are its cheapest) against my doc
    that ends earliest among those that can move enough (the partner will need its
    prefix)."""
    n = len(ranks.work)
    mean = sum(ranks.work) / n
    # Each rank's intervals per doc, built when first needed and then kept up to date;
    # the shards of the ranks that changed are rewritten from them at the end.
    cache: dict[int, dict[int, list[tuple[int, int]]]] = {}

    def intervals(rank: int) -> dict[int, list[tuple[int, int]]]:
        if rank not in cache:
            cache[rank] = _intervals(ranks, rank)
        return cache[rank]

    changed: set[int] = set()
    try:
        _exchange_moves(ranks, allowed, max_moves, mean, intervals, changed)
    finally:
        for rank in changed:
            ranks.shards[rank] = [new_shard(Shard, (doc, a, b))
                                  for doc, iv in cache[rank].items() for a, b in iv]


def _exchange_moves(ranks: Ranks, allowed: float, max_moves: int, mean: float,
                    intervals, changed: set[int]) -> None:
    """The moves of ``exchange`` on the ranks' intervals (``intervals(rank)``), recording
    the ranks they change; workloads are updated as they go."""
    n = len(ranks.work)
    for _ in range(max_moves):
        busy = ranks.work.index(max(ranks.work))  # the busiest; ties: the lowest rank
        if ranks.work[busy] <= allowed:
            return
        held = intervals(busy)
        partners = []
        # The PARTNERS lightest, ties by rank (nsmallest is a stable sorted(...)[:k]).
        for other in heapq.nsmallest(PARTNERS, range(n), key=ranks.work.__getitem__):
            # Aim to bring the busiest rank to mean + SETTLE x slack; never push the partner
            # above ``allowed`` or above the busiest rank's new load.
            most = min(allowed - ranks.work[other], ranks.work[busy] - ranks.work[other])
            goal = min(ranks.work[busy] - mean - SETTLE * (allowed - mean), most)
            if other != busy and goal > 0:
                partners.append((other, goal, most, intervals(other)))
        best = _best_move(held, partners, shared=True) or _best_move(held, partners, shared=False)
        if best is None:
            return
        other, x, y, theirs, goal, limit = best
        count = count_for(held[x], theirs[y], goal, limit)
        mine_kept, mine_given = take(held[x], count, True)
        their_kept, their_given = take(theirs[y], count, False)
        cap = next(most for rank, _, most, _ in partners if rank == other)
        folded = fold(held, theirs, x, y, goal, cap, count) if x != y else None
        if folded is not None:
            mine_kept, mine_given, their_kept, their_given = folded
        if x == y:
            ranks.work[busy] += _set_docs(held, {x: mine_kept + their_given})
            ranks.work[other] += _set_docs(theirs, {x: their_kept + mine_given})
        else:
            ranks.work[busy] += _set_docs(held, {x: mine_kept, y: held.get(y, []) + their_given})
            ranks.work[other] += _set_docs(theirs, {y: their_kept, x: theirs.get(x, []) + mine_given})
        changed.update((busy, other))


def _set_docs(held: dict[int, list[tuple[int, int]]],
              docs: dict[int, list[tuple[int, int]]]) -> int:
    """Set a rank's intervals of each doc in ``docs`` (sorted, empty ones dropped; a doc
    left with none leaves the rank); the change in its workload."""
    delta = 0
    for doc, new in docs.items():
        for a, b in held.pop(doc, ()):
            delta -= (a + b + 1) * (b - a) // 2  # cost.shard_workload
        kept = sorted(iv for iv in new if iv[1] > iv[0])
        for a, b in kept:
            delta += (a + b + 1) * (b - a) // 2
        if kept:
            held[doc] = kept
    return delta


def _need(intervals: Sequence[tuple[int, int]]) -> int:
    """KV a rank receives for one doc it holds as these sorted intervals (0 if none)."""
    return intervals[-1][1] - sum(b - a for a, b in intervals) if intervals else 0


FOLD_COUNTS = 6
"""Sizes of the middle stretch tried by ``fold`` (a geometric grid)."""


def fold(held: dict[int, list[tuple[int, int]]], theirs: dict[int, list[tuple[int, int]]],
          x: int, y: int, goal: float, most_work: float, count: int):
    """A cheaper form of the cross-doc exchange, or None. The exchange gives the partner my
    top ``count`` positions of doc x (it then needs x's prefix up to there) for their
    lowest ``count`` of doc y. Giving a middle stretch [a, a + c) of my top stretch
    [s, e) of x instead costs the partner only x's prefix up to a and me the c positions
    given: the fold the exact ILP uses for heavy docs. Taken when it lowers the larger of
    the two ranks' receives and moves at least ``goal`` work (the top move's work at most)
    and at most ``most_work`` (what the partner may take). Returns (my x kept, given;
    their y kept, given) like the top move's ``take``s.
    """
    def receives(mine_x, mine_y, their_x, their_y) -> int:
        mine = base_mine + _need(mine_x) + _need(mine_y)
        their = base_their + _need(their_x) + _need(their_y)
        return max(mine, their)

    mine_iv, their_iv = held[x], theirs[y]
    # Receives without docs x and y, which every candidate changes.
    base_mine = sum(_need(iv) for d, iv in held.items() if d not in (x, y))
    base_their = sum(_need(iv) for d, iv in theirs.items() if d not in (x, y))
    kept, given = take(mine_iv, count, True)
    their_kept, their_given = take(their_iv, count, False)
    top_work = edge_work(mine_iv, count, True) - edge_work(their_iv, count, False)
    best_cost = receives(kept, merged(held.get(y, []) + their_given),
                         merged(theirs.get(x, []) + given), their_kept)
    want = min(goal, top_work)
    s, e = mine_iv[-1]
    most = min(e - s, sum(b - a for a, b in their_iv))
    best = None
    for k in range(FOLD_COUNTS):
        c = max(1, round(most ** ((k + 1) / FOLD_COUNTS)))
        low = edge_work(their_iv, c, False)
        # c positions from a on move c (2a + c + 1) / 2 - low work: the least a moving ``want``.
        a = max(s, math.ceil((want + low) / c - (c + 1) / 2))
        if a + c >= e or c * (2 * a + c + 1) // 2 - low > most_work:
            continue  # the top move, or too much work for the partner
        mine_x = mine_iv[:-1] + ([(s, a)] if a > s else []) + [(a + c, e)]
        their_kept_c, their_given_c = take(their_iv, c, False)
        cost = receives(mine_x, merged(held.get(y, []) + their_given_c),
                        merged(theirs.get(x, []) + [(a, a + c)]), their_kept_c)
        if cost < best_cost:
            best_cost, best = cost, (mine_x, [(a, a + c)], their_kept_c, their_given_c)
    return best


def _best_move(held: dict[int, list[tuple[int, int]]], partners: list, *,
               shared: bool) -> Move | None:
    """The best exchange among the same docs (``shared``) or across docs; None if none
    moves work. ``partners``: (rank, goal, most work it may take, its intervals)."""
    best = None
    if not shared:
        mine = sorted(held, key=lambda d: -held[d][-1][1])[:CROSS_DOCS]
    for other, goal, most, theirs in partners:
        if shared:
            pairs = [(d, d) for d in held.keys() & theirs.keys()]
        else:
            longest = sorted(theirs, key=lambda d: -sum(b - a for a, b in theirs[d]))[:2]
            pairs = [(x, y) for x in mine for y in longest if x != y]
        for x, y in pairs:
            mine_iv, their_iv = held[x], theirs[y]
            # One position moves (my top + 1) - (their bottom + 1); it may already be more
            # than the partner can take.
            if mine_iv[-1][1] - 1 - their_iv[0][0] > most:
                continue
            if len(mine_iv) == 1 and len(their_iv) == 1:
                # One stretch each (most docs are whole): crossing and edge_work in closed
                # form; k pairs move k (my end - their start - k) work.
                span = mine_iv[0][1] - their_iv[0][0]
                limit = max(0, min(mine_iv[0][1] - mine_iv[0][0], their_iv[0][1] - their_iv[0][0],
                                   span // 2))
                potential = limit * (span - limit)
            else:
                limit = crossing(mine_iv, their_iv)
                potential = edge_work(mine_iv, limit, True) - edge_work(their_iv, limit, False)
            if potential <= 0:
                continue
            key = (potential >= goal, 0 if shared else -mine_iv[-1][1], min(goal, potential))
            if best is None or key > best[0]:
                best = (key, Move(other, x, y, theirs, goal, limit))
    return None if best is None else best[1]


def descend(ranks: Ranks, allowed: float, max_steps: int) -> int:
    """Lower the critical-path KV within the balance limit: the rank receiving most gives
    the top stretch of a doc it shares with another rank for as many of that rank's lowest
    positions of the doc, so its need of the doc's prefix shrinks and the partner's grows;
    or it gives a doc it holds whole for the partner's highest positions of a shared doc
    (``_best_absorb``), whichever lowers the larger of the two ranks' new receives most;
    taken when that is below the old maximum and both workloads stay within ``allowed``
    (or the busiest rank's workload, if that is higher). Returns the most KV any rank
    then receives."""
    n = len(ranks.work)
    # Only docs on more than one rank move KV (a rank holding all of a doc needs none).
    owner: dict[int, int] = {}
    shared = set()
    for r, shards in enumerate(ranks.shards):
        for s in shards:
            if owner.setdefault(s.doc, r) != r:
                shared.add(s.doc)
    allowed = max(allowed, max(ranks.work))
    held = [_intervals(ranks, r, shared) for r in range(n)]
    size = [{doc: sum(b - a for a, b in iv) for doc, iv in h.items()} for h in held]
    needs = [{doc: _need(iv) for doc, iv in h.items()} for h in held]  # per rank, per doc
    recv = [sum(need.values()) for need in needs]
    # Each rank's docs held whole and by it alone: doc -> length.
    lengths: list[dict[int, int]] = [{} for _ in range(n)]
    for r, shards in enumerate(ranks.shards):
        for s in shards:
            if s.doc not in shared and s.end > lengths[r].get(s.doc, 0):
                lengths[r][s.doc] = s.end
    changed: set[int] = set()
    for _ in range(max_steps):
        top = recv.index(max(recv))  # the rank receiving most; ties: the lowest
        # A doc I hold as a prefix (need 0) cannot lower my receive: skip it.
        needy = {doc for doc, need in needs[top].items() if need}
        best = None
        for other in range(n):
            if other == top:
                continue
            for doc in sorted(needy & held[other].keys()):
                mine, theirs = held[top][doc], held[other][doc]
                my_end, their_end = mine[-1][1], theirs[-1][1]
                # The partner then needs the prefix up to my end at least: no count can do
                # better than that (prune).
                if recv[other] - their_end + my_end >= (recv[top] if best is None else best[0]):
                    continue
                limit = crossing(mine, theirs)
                if limit <= 0:
                    continue
                # Up to the crossing, more positions move more work: ``most`` is the largest
                # count the partner can take (at least 1, which may already be too much).
                room = allowed - ranks.work[other]
                most = count_for(mine, theirs, room, limit)
                if most == 1 and edge_work(mine, 1, True) - edge_work(theirs, 1, False) > room:
                    continue
                their_size = size[other][doc]
                for count in sorted({min(my_end - mine[-1][0], most), min(limit // 2, most), most}):
                    if count <= 0:
                        continue
                    # Token counts stay, so only the ends (the prefixes needed) change: I keep
                    # my lowest positions and gain their lowest; they gain my top stretch.
                    top_end = max(_end_below(mine, count), _end_of_lowest(theirs, count))
                    other_end = max(their_end if count < their_size else 0, my_end)
                    top_recv = recv[top] - my_end + top_end
                    other_recv = recv[other] - their_end + other_end
                    worst = max(top_recv, other_recv)
                    if worst < recv[top] and (best is None or worst < best[0]):
                        best = (worst, other, doc, count, top_recv, other_recv)
        absorb = _best_absorb(ranks, held, needs, recv, top, allowed, lengths,
                              recv[top] if best is None else best[0])
        if absorb is not None and (best is None or absorb.worst < best[0]):
            worst, other, doc, whole, new_mine, new_theirs, moved = absorb
            size[top][doc] += lengths[top][whole]
            size[other][doc] -= lengths[top][whole]
            lengths[other][whole] = lengths[top].pop(whole)
        elif best is not None:
            _, other, doc, count, _, _ = best
            mine, theirs = held[top][doc], held[other][doc]
            mine_kept, mine_given = take(mine, count, True)
            their_kept, their_given = take(theirs, count, False)
            new_mine, new_theirs = merged(mine_kept + their_given), merged(their_kept + mine_given)
            moved = edge_work(theirs, count, False) - edge_work(mine, count, True)
        else:
            break
        held[top][doc], held[other][doc] = new_mine, new_theirs
        needs[top][doc], needs[other][doc] = _need(new_mine), _need(new_theirs)
        recv[top], recv[other] = sum(needs[top].values()), sum(needs[other].values())
        ranks.work[top] += moved
        ranks.work[other] -= moved
        changed.update((top, other))
    # The changed ranks' shards, from their whole docs and their intervals of shared docs.
    for r in changed:
        ranks.shards[r] = [new_shard(Shard, (doc, 0, length)) for doc, length in lengths[r].items()]
        ranks.shards[r] += [new_shard(Shard, (doc, a, b)) for doc, iv in held[r].items() for a, b in iv]
    return max(recv)


class Absorb(NamedTuple):
    """A move ``_best_absorb`` found: the busiest rank's whole doc for the partner's
    highest positions of a shared doc."""

    worst: int
    """The larger of the two ranks' receives after it."""
    partner: int
    """The rank taking the whole doc."""
    doc: int
    """The shared doc."""
    whole: int
    """The whole doc given."""
    mine: Intervals
    """The busiest rank's new intervals of the shared doc."""
    theirs: Intervals
    """The partner's."""
    moved: int
    """Work the busiest rank gains."""


def _best_absorb(ranks: Ranks, held: list, needs: list, recv: list[int], top: int,
                 allowed: float, lengths: list[dict[int, int]], bound: int) -> Absorb | None:
    """The best move in which the rank receiving most gives a doc it holds whole to a
    partner for as many of the partner's highest positions of a doc both share: the gap
    below my top stretch of that doc fills, so I need less of its prefix, and the partner
    needs no more (its top stretch shrinks). None if no such move lowers the larger of the
    two receives below ``bound`` within ``allowed``. ``needs``: per rank, each shared
    doc's need (``_need``)."""
    best: Absorb | None = None
    if not lengths[top]:
        return None
    mine_whole = sorted(lengths[top].items(), key=lambda item: (item[1], item[0]))
    room = allowed - ranks.work[top]
    for other in range(len(recv)):
        if other == top:
            continue
        for doc in sorted(held[top].keys() & held[other].keys()):
            mine, theirs = held[top][doc], held[other][doc]
            need_mine, need_theirs = needs[top][doc], needs[other][doc]
            if need_mine == 0 or theirs[-1][1] > mine[-1][1] or recv[other] - need_theirs >= bound:
                continue  # nothing to gain, I would need more of the prefix, or no better
            their_size = sum(b - a for a, b in theirs)
            # The whole docs I can give: shorter than their holding, and (the work moved
            # grows with the length) up to the longest whose move I can take: a binary
            # search; the longest ``ABSORB_TRIES`` of them are tried (they fill most).
            lo, hi = 0, len(mine_whole)
            while lo < hi:
                mid = (lo + hi) // 2
                length = mine_whole[mid][1]
                if length < their_size and _absorb_work(theirs, length) <= room:
                    lo = mid + 1
                else:
                    hi = mid
            for whole, length in reversed(mine_whole[max(0, lo - ABSORB_TRIES):lo]):
                moved = _absorb_work(theirs, length)
                if moved > room or ranks.work[other] - moved > allowed:
                    continue
                kept, given = take(theirs, length, True)
                new_mine = merged(mine + given)
                top_recv = recv[top] - need_mine + _need(new_mine)
                other_recv = recv[other] - need_theirs + _need(kept)
                worst = max(top_recv, other_recv)
                if worst < bound and (best is None or worst < best[0]):
                    best = Absorb(worst, other, doc, whole, new_mine, kept, moved)
    return best


def _absorb_work(theirs: Sequence[tuple[int, int]], length: int) -> int:
    """Work I gain taking the ``length`` highest positions of ``theirs`` for a whole doc of
    that length."""
    return edge_work(theirs, length, True) - length * (length + 1) // 2


def _end_below(intervals: Sequence[tuple[int, int]], count: int) -> int:
    """End of what is left of sorted intervals after their ``count`` highest positions go
    (0 if nothing is left)."""
    for a, b in reversed(intervals):
        if count < b - a:
            return b - count
        count -= b - a
    return 0


def _end_of_lowest(intervals: Sequence[tuple[int, int]], count: int) -> int:
    """End of the ``count`` lowest positions of sorted intervals (count >= 1)."""
    for a, b in intervals:
        if count <= b - a:
            return a + count
        count -= b - a
    return intervals[-1][1]


def merged(intervals: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif b > a:
            out.append((a, b))
    return out


def crossing(mine: Sequence[tuple[int, int]], theirs: Sequence[tuple[int, int]]) -> int:
    """How many of my highest positions lie above as many of their lowest: exchanging
    more would move work back, so the exchange moves most work there. One merge walk:
    my positions downwards from the top, theirs upwards from the bottom."""
    if not mine or not theirs:
        return 0
    if len(mine) == 1 and len(theirs) == 1:  # one stretch each (the common case): one step
        return max(0, min(mine[0][1] - mine[0][0], theirs[0][1] - theirs[0][0],
                          (mine[0][1] - theirs[0][0]) // 2))
    count = 0
    for top, bottom, step in _stretches(mine, theirs):
        # The t-th pair of this stretch is top - t > bottom + t - 1 while 2t <= top - bottom.
        fits = (top - bottom) // 2
        if fits < step:
            return count + max(0, fits)
        count += step
    return count


def _stretches(mine: Sequence[tuple[int, int]], theirs: Sequence[tuple[int, int]]):
    """The pairing of my positions, highest first, with theirs, lowest first, as
    stretches (top, bottom, step): my top - 1, top - 2, ... with their bottom, bottom + 1,
    ... for ``step`` pairs, each stretch within one interval on each side."""
    i, j = len(mine) - 1, 0
    top, bottom = mine[i][1], theirs[0][0]
    while True:
        step = min(top - mine[i][0], theirs[j][1] - bottom)
        yield top, bottom, step
        top -= step
        bottom += step
        if top == mine[i][0]:
            i -= 1
            if i < 0:
                return
            top = mine[i][1]
        if bottom == theirs[j][1]:
            j += 1
            if j == len(theirs):
                return
            bottom = theirs[j][0]


def count_for(mine: Sequence[tuple[int, int]], theirs: Sequence[tuple[int, int]], goal: float,
               limit: int) -> int:
    """The largest count up to ``limit`` whose exchange moves at most ``goal`` work (the
    work moved grows with the count up to ``limit``), and at least 1.

    Within a stretch (``_stretches``) where my positions run down from ``top`` and theirs
    up from ``bottom``, k pairs move k (top - bottom - k) work (pair t moves (top - t) -
    (bottom + t + 1)); in the stretch where the goal is passed, k is the smaller root of
    k^2 - k (top - bottom) + rest = 0, settled exactly."""
    count = moved = 0
    for top, bottom, step in _stretches(mine, theirs):
        step = min(step, limit - count)
        if step <= 0:
            break
        span = top - bottom
        if moved + step * (span - step) > goal:
            rest = goal - moved
            disc = span * span - 4 * rest
            k = step if disc < 0 else min(step, int((span - math.sqrt(disc)) / 2))
            while k < step and (k + 1) * (span - k - 1) <= rest:
                k += 1
            while k > 0 and k * (span - k) > rest:
                k -= 1
            return max(1, count + k)
        moved += step * (span - step)
        count += step
    return max(1, count)


def edge_work(intervals: Sequence[tuple[int, int]], count: int, top: bool) -> int:
    """Work of the ``count`` highest (``top``) or lowest positions of sorted intervals."""
    if len(intervals) == 1 and count <= intervals[0][1] - intervals[0][0]:
        lo = intervals[0][1] - count if top else intervals[0][0]  # one stretch: one term
        return (2 * lo + count + 1) * count // 2
    total = 0
    for a, b in reversed(intervals) if top else intervals:
        if count <= 0:
            break
        size = min(count, b - a)
        lo = b - size if top else a
        total += (2 * lo + size + 1) * size // 2
        count -= size
    return total


def _intervals(ranks: Ranks, rank: int, docs: Container[int] | None = None) -> dict[int, list[tuple[int, int]]]:
    """The rank's shards (of ``docs`` only, if given) as sorted position intervals per doc."""
    out: dict[int, list[tuple[int, int]]] = {}
    for s in ranks.shards[rank]:
        if docs is None or s.doc in docs:
            out.setdefault(s.doc, []).append((s.start, s.end))
    for intervals in out.values():
        intervals.sort()
    return out
