"""flashcp's balanced pass: place the docs in a given order (step 1 of ``solve.py``'s
docstring up to the spill), then finish the layout (spill, token-neutral rebalance).

Each doc goes whole to the rank that lags most behind its share of the work, counting
that every rank will still be filled to T tokens (lag = mean - load - room x the workload
per token of the docs not yet placed), if the doc fits its token room and keeps it within
R x mean. A doc that no rank can take within R x mean is zigzagged over the fewest
lagging ranks (or, in the nested pass, cut by ``nested.nested_zigzag``); docs that are
light enough but fit no rank's room are left to the spill.

Complexity, D docs on N ranks: the most lagging rank comes from a heap of ranks keyed by
load - tokens x density. The density of the docs not yet placed falls as docs are placed
longest first, so a stored key is a lower bound of the rank's current key: the top is
refreshed until it is current, at most ``REFRESH`` times per doc (exact while N <=
``REFRESH``; beyond, the refreshed top is taken), and the heap is rebuilt whenever the
density rises (another order). Ranks without room for a doc are parked until a shorter
doc fits them, which happens at most once per doc they receive. Whole docs: O((D + N)
log N). A doc that must be split (at most about 2N of them: longer than T or heavier than
R x mean) costs O(N log N) for its zigzag width (m = 2 .. ``LINEAR_WIDTHS`` one by one,
then a geometric grid of ``WIDTH_GROWTH``, each checked in O(N)), so O(N^2 log N) over a
request in the worst case, and O(N) to cut it. ``finish``: ``refine.exchange``.

Runs of at least ``runs.RUN_MIN`` equal docs (many short docs) go in blocks
(``runs.py``). On N <= ``REFRESH`` ranks, where the heap yields the rank of least current
key, ``few.place_run`` places them as the heap would, O(N) numpy work per doc. On more
ranks the density changes from doc to doc along a run, every stored key goes stale and
the heap would spend its ``REFRESH`` steps on most docs and still be inexact;
``runs.place_run_blocks`` places them by the least current key (lowest rank on ties) with
the density held over blocks of up to ``runs.HELD_BLOCK`` docs: O((K + N) log(K + N)) per
block of K docs, O(N) per doc for the few docs it places one at a time. A run stops
short at a doc no rank takes whole; the heap goes on from there, and the run is tried
again after ``runs.RUN_RETRY`` docs (on more than ``REFRESH`` ranks, twice as many at
each try: at most log D tries of O(N + K) per run).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from itertools import chain, islice

import numpy as np

from planner_service.core.cost import alltoallv_receives, imbalance
from planner_service.core.plan import Shard
from planner_service.solvers.flashcp.few import place_run
from planner_service.solvers.flashcp.nested import nested_zigzag
from planner_service.solvers.flashcp.paper import split_spill
from planner_service.solvers.flashcp.ranks import Ranks, Whole, new_shard, zigzag
from planner_service.solvers.flashcp.refine import exchange
from planner_service.solvers.flashcp.runs import (
    EXACT,
    RUN_MIN,
    RUN_RETRY,
    place_run_blocks,
    run_heads,
)

REFRESH = 8
"""Stale heap tops refreshed per doc before the top is taken (every rank at N <= 8)."""
REBUILD_ARRAYS = 64
"""Ranks above which ``place`` computes a rebuilt heap's keys in numpy."""
LINEAR_WIDTHS = 16
"""Zigzag widths tried one by one; wider ones on a geometric grid."""
WIDTH_GROWTH = 1.25
"""Ratio of consecutive zigzag widths above ``LINEAR_WIDTHS``."""
LAG_PREFIX = 64
"""Most lagging ranks ``zigzag_ranks`` orders first where the narrow widths are tried (a
zigzag's ranks are the most lagging with room; narrow ones take a few)."""


def widths(n: int) -> Iterator[int]:
    """Zigzag widths tried for a doc that must be split: 2 .. LINEAR_WIDTHS, then a
    geometric grid up to n (always ending at n); O(LINEAR_WIDTHS + log N) values."""
    m = 2
    while m < n:
        yield m
        m = m + 1 if m < LINEAR_WIDTHS else max(m + 1, int(m * WIDTH_GROWTH))
    if n >= 2:
        yield n


def ends(ranks: Ranks, rank: int, share: float, load: float, density: float) -> float:
    """A rank's expected final workload after taking a share (tokens, load) of a doc and
    then filling its remaining room at ``density`` (work per token)."""
    room = max(0.0, ranks.capacity - ranks.tokens[rank] - share)
    return ranks.work[rank] + load + room * density


def place(
    doc_lengths: Sequence[int], order: Sequence[int], n: int, allowed: float, fill_aware: bool,
    total_work: int, nested: bool = False, lengths: np.ndarray | None = None,
    whole: Whole | None = None, fill_share: float = 1.0, fill_reserve: float = 0,
    whole_limit: float | None = None,
) -> tuple[Ranks, list[tuple[int, int]]]:
    """The layout so far and the docs left to split for tokens (module docstring;
    ``total_work``: the docs' total workload; ``lengths``: ``doc_lengths`` as an int64
    array, if at hand; ``whole``: the docs' whole shards, if at hand: ``ranks.Whole``,
    else each made as its doc is placed; ``fill_share``: the share of the density of the
    docs left that fill-aware zigzag widths count for a rank's later fill;
    ``fill_reserve``: workload per token of room a rank keeps free for its later fill
    when it takes a doc whole, e.g. 1, the least a token weighs, where every rank is
    filled to T tokens later; then runs of equal docs go one by one, since the block
    placements do not count it); ``whole_limit``: the workload a rank taking a doc whole
    may reach with that reserve counted (default ``allowed``)."""
    rest_tokens = sum(doc_lengths)
    rest_work = total_work
    limit = allowed if whole_limit is None else whole_limit
    cap = -(-rest_tokens // n)
    ranks = Ranks(n, cap, whole)
    shards, tokens, work = ranks.shards, ranks.tokens, ranks.work
    spill: list[tuple[int, int]] = []
    version = [0] * n  # an entry (key, rank, version) is stale once the rank changes
    heap: list[tuple[float, int, int]] = [(0.0, r, 0) for r in range(n)]
    parked: list[tuple[int, int, int]] = []  # (-room, rank, version): no room for the docs so far
    lightest: list[tuple[int, int]] = [(0, r) for r in range(n)]  # (work, rank), lazily current
    dirty: list[int] = []  # ranks given a whole doc since ``lightest`` was last read
    density = float("inf")
    need = [0] * n  # KV each rank needs so far (cost.alltoallv_receives, kept up to date)
    # The workloads and token counts as float arrays for ``zigzag_ranks``, brought up to
    # date from the ranks changed since (``touched``) when a doc must be split.
    mirror: tuple[np.ndarray, np.ndarray] | None = None
    touched: list[int] = []
    heappush, heappop, heapreplace = heapq.heappush, heapq.heappop, heapq.heapreplace

    def rebuild() -> None:
        if n > REBUILD_ARRAYS:  # the same keys (float64 either way), from arrays
            keys = np.array(work, dtype=np.int64) - np.array(tokens, dtype=np.int64) * density
            heap[:] = zip(keys.tolist(), range(n), version, strict=True)
        else:
            heap[:] = [(work[r] - tokens[r] * density, r, version[r]) for r in range(n)]
        heapq.heapify(heap)
        parked.clear()

    # Long runs of equal docs go in blocks (``runs.py``): by ``place_run`` on few ranks,
    # where the heap is exact, else by ``place_run_blocks``. docs -> (position in
    # ``order``, docs left in its run, tries so far) for the docs where it is tried next.
    heads = {doc: (at, left, 0) for doc, (at, left) in run_heads(
        doc_lengths if lengths is None else lengths, order).items()} if (
        total_work < EXACT and not fill_reserve) else {}
    run_placement = place_run if n <= REFRESH else place_run_blocks
    docs = iter(order)
    for doc in docs:
        if heads and doc in heads:
            at, left, tries = heads.pop(doc)
            placed, changed, rest_tokens, rest_work, last = run_placement(
                doc_lengths[doc], order[at:at + left], ranks, allowed, rest_tokens, rest_work)
            # Stopped short (a doc no rank takes whole): tried again after some docs one by
            # one (on many ranks, twice as many at each try: tries placing nothing, as
            # when no rank has room left, cost O(N + K) each, log D of them per run).
            gap = RUN_RETRY if n <= REFRESH else RUN_RETRY << tries
            if left - placed - gap >= RUN_MIN:
                heads[order[at + placed + gap]] = (at + placed + gap, left - placed - gap,
                                                   tries + 1)
            if placed:
                density = last
                for r in changed:
                    version[r] += 1
                dirty += changed
                rebuild()
                next(islice(docs, placed - 1, placed - 1), None)  # skip the docs placed
                continue
        length = doc_lengths[doc]
        doc_work = length * (length + 1) // 2
        rest_tokens -= length
        rest_work -= doc_work
        previous, density = density, rest_work / rest_tokens if rest_tokens else 0.0
        if density > previous:
            rebuild()  # stored keys are lower bounds only while the density falls
        while parked and -parked[0][0] >= length:
            _, r, v = heappop(parked)
            if v == version[r]:
                heappush(heap, (work[r] - tokens[r] * density, r, v))
        most = cap - length  # tokens a rank may hold to have room for the doc
        if most < 0 and heap:
            # No rank has room: the loop below would park every current entry one by one.
            moving = [(tokens[r] - cap, r, v) for _, r, v in heap if v == version[r]]
            heap.clear()
            if len(moving) + len(parked) > 2 * n:
                # Drop the stale parked entries (popped and skipped otherwise): at most one
                # current entry per rank is left.
                parked[:] = [e for e in parked if e[2] == version[e[1]]]
                parked.extend(moving)
                heapq.heapify(parked)
            elif len(moving) > len(parked) // 8:
                parked.extend(moving)
                heapq.heapify(parked)  # the same entries as pushed one by one
            else:
                for entry in moving:
                    heapq.heappush(parked, entry)
        best, refreshed = -1, 0
        while heap:
            key, r, v = heap[0]
            if v != version[r]:
                heappop(heap)
            elif tokens[r] > most:
                heappop(heap)
                heappush(parked, (tokens[r] - cap, r, v))
            else:
                current = work[r] - tokens[r] * density
                if current != key and refreshed < REFRESH:
                    heapreplace(heap, (current, r, v))
                    refreshed += 1
                    continue
                best = r
                break
        if best >= 0 and work[best] + doc_work + (
                fill_reserve * (cap - tokens[best] - length) if fill_reserve else 0) <= limit:
            # ranks.add(best, doc, 0, length) inlined: most docs take this path.
            shards[best].append(new_shard(Shard, (doc, 0, length)) if whole is None
                                else whole[doc])
            tokens[best] += length
            work[best] += doc_work
            version[best] += 1
            heapreplace(heap, (work[best] - tokens[best] * density, best, version[best]))
            dirty.append(best)
            continue
        # The lightest heap gets the ranks whole docs went to since it was last read.
        touched += dirty
        if len(dirty) > n // 4:
            lightest[:] = [(w, r) for r, w in enumerate(work)]
            heapq.heapify(lightest)
        else:
            for r in dirty:
                heappush(lightest, (work[r], r))
        dirty.clear()
        while lightest[0][0] != work[lightest[0][1]]:
            heappop(lightest)
        if lightest[0][0] + doc_work <= allowed or length < 2:
            spill.append((doc, length))  # light enough (or one token) but no room: split for tokens
            continue
        if nested and nested_zigzag(ranks, doc, length, allowed, density):
            mirror = None
            need[:] = alltoallv_receives(shards)
            for r in range(n):
                version[r] += 1
                heapq.heappush(lightest, (work[r], r))
            rebuild()
            continue
        mirror = mirrored(mirror, work, tokens, touched)
        touched.clear()
        chosen = zigzag_ranks(*mirror, cap, length, doc_work, allowed,
                               density * fill_share if fill_aware else 0.0, density)
        if chosen is None:
            spill.append((doc, length))  # no m ranks have room for shares: split for tokens
            continue
        # The outer chunk pair (most KV: the prefix up to the top) to the rank needing least.
        chosen.sort(key=need.__getitem__)
        before = [tokens[r] for r in chosen]
        zigzag(ranks, chosen, doc, length)
        touched += chosen
        for r, held in zip(chosen, before, strict=True):
            if tokens[r] > held:  # the prefix up to its top chunk, less its own tokens
                need[r] += shards[r][-1][2] - (tokens[r] - held)
            version[r] += 1
        # Each chosen rank's new entry in both heaps; many at once are added by one heapify
        # (the same entries: the heaps pop the same), and the lightest heap, whose every
        # rank's current entry is all that counts, is then rebuilt.
        entries = [(work[r] - tokens[r] * density, r, version[r]) for r in chosen]
        if len(entries) > len(heap) // 8:
            heap.extend(entries)
            heapq.heapify(heap)
        else:
            for keyed in entries:
                heapq.heappush(heap, keyed)
        if len(chosen) > n // 4:
            lightest[:] = [(w, r) for r, w in enumerate(work)]
            heapq.heapify(lightest)
        else:
            for r in chosen:
                heapq.heappush(lightest, (work[r], r))
    return ranks, spill


def mirrored(mirror: tuple[np.ndarray, np.ndarray] | None, work: list[int], tokens: list[int],
            touched: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The ranks' workloads and token counts as float64 arrays (through int64, exact:
    workloads stay below 2^62), ``mirror`` updated at the ``touched`` ranks (repeats
    allowed) where that is cheaper than converting every rank. O(N) or O(touched)."""
    if mirror is None or len(touched) > len(work) // 4:
        # Through int64: twice as fast as straight to float.
        return (np.array(work, dtype=np.int64).astype(np.float64),
                np.array(tokens, dtype=np.int64).astype(np.float64))
    if touched:
        work_f, tokens_f = mirror
        work_f[touched] = np.array([work[r] for r in touched], dtype=np.int64)
        tokens_f[touched] = np.array([tokens[r] for r in touched], dtype=np.int64)
    return mirror


def zigzag_ranks(work: np.ndarray, tokens: np.ndarray, capacity: int, length: int,
                  doc_work: int, allowed: float, fill: float,
                  density: float) -> list[int] | None:
    """The fewest most lagging ranks with room for equal shares of the doc whose expected
    final workloads (``ends``, filled at ``fill``) stay within ``allowed`` (the widest
    width tried, min(N, length), is taken regardless); None if no width has enough ranks
    with room. Lag order: ascending work - tokens x density, ties by rank.

    Where the narrowest width tried is at most ``LINEAR_WIDTHS``, the order is built for
    the ``LAG_PREFIX`` most lagging ranks first (with every rank tied with the last of
    them: exactly the first ranks of the whole order), O(N) to select them, and for
    every rank only where a width needs more; widths up to ``LINEAR_WIDTHS`` are checked
    in plain Python floats (the same operations as numpy's, element by element), O(ranks
    scanned) each, wider ones in numpy, O(N) each. Widths too narrow for any rank's room,
    or too narrow for even the lightest rank to stay within ``allowed``, are skipped
    (they cannot succeed). ``zigzag_ranks_reference`` sorts every rank and checks every
    width in numpy."""
    n = len(work)
    room = capacity - tokens
    narrowest = _narrowest(room, work, length, doc_work, allowed)
    widest = min(n, max(2, length))  # more ranks than tokens would hold nothing
    lag = work - tokens * density
    tried = (m for m in widths(widest) if m >= narrowest or m >= widest)
    first_width = next(tried, None)
    if first_width is None:
        return None
    # The partial order where the narrowest width tried is checked in Python.
    whole = n <= LAG_PREFIX or first_width > LINEAR_WIDTHS
    if whole:
        by_lag = np.argsort(lag, kind="stable")
    else:
        # The ranks up to the LAG_PREFIX-th least lag, ties included, by (lag, rank).
        first = np.flatnonzero(lag <= np.partition(lag, LAG_PREFIX - 1)[LAG_PREFIX - 1])
        by_lag = first[np.argsort(lag[first], kind="stable")]
    room_by_lag, work_by_lag = room[by_lag], work[by_lag]
    rooms: list[float] = []  # ``room_by_lag`` and ``work_by_lag`` as lists, once needed
    works: list[float] = []
    for m in chain((first_width,), tried):
        share = -(-length // m)
        if m <= LINEAR_WIDTHS:
            if not rooms:
                rooms, works = room_by_lag.tolist(), work_by_lag.tolist()
            picked = (room_by_lag >= share).nonzero()[0][:m].tolist()
            if len(picked) == m:
                if m == widest:
                    return by_lag[picked].tolist()
                # ``_within`` in Python floats, element by element.
                per_token, per_share = length / m, doc_work / m
                if all(works[i] + per_share + max(0.0, rooms[i] - per_token) * fill <= allowed
                       for i in picked):
                    return by_lag[picked].tolist()
                continue
        fit = (room_by_lag >= share).nonzero()[0][:m]
        if len(fit) < m and not whole:
            # Too few in the partial order: the whole order (whose first ranks it is).
            whole = True
            by_lag = np.argsort(lag, kind="stable")
            room_by_lag, work_by_lag = room[by_lag], work[by_lag]
            rooms = works = []
            fit = (room_by_lag >= share).nonzero()[0][:m]
        if len(fit) < m:
            continue
        if m == widest or _within(room_by_lag[fit], work_by_lag[fit], length, doc_work, m,
                                  fill, allowed):
            return by_lag[fit].tolist()
    return None


def zigzag_ranks_reference(work: np.ndarray, tokens: np.ndarray, capacity: int,
                           length: int, doc_work: int, allowed: float, fill: float,
                           density: float) -> list[int] | None:
    """``zigzag_ranks`` from the whole lag order (a stable argsort of every rank's lag):
    O(N log N), then O(N) per width tried."""
    n = len(work)
    room = capacity - tokens
    narrowest = _narrowest(room, work, length, doc_work, allowed)
    widest = min(n, max(2, length))  # more ranks than tokens would hold nothing
    # Lag order: ascending work - tokens x density, ties by rank (a stable sort).
    by_lag = np.argsort(work - tokens * density, kind="stable")
    room_by_lag, work_by_lag = room[by_lag], work[by_lag]
    for m in widths(widest):
        if m < narrowest and m < widest:
            continue
        share = -(-length // m)
        fit = (room_by_lag >= share).nonzero()[0][:m]
        if len(fit) < m:
            continue
        if m == widest or _within(room_by_lag[fit], work_by_lag[fit], length, doc_work, m,
                                  fill, allowed):
            return by_lag[fit].tolist()
    return None


def _narrowest(room: np.ndarray, work: np.ndarray, length: int, doc_work: int,
               allowed: float) -> int:
    """The narrowest zigzag width that can succeed: enough for the roomiest rank's room,
    and for the lightest rank to stay within ``allowed`` (at least 2). O(N)."""
    most_room, lightest = float(room.max()), float(work.min())
    narrowest = 2
    if most_room > 0:
        narrowest = max(narrowest, -(-length // int(most_room)))
    if allowed > lightest:
        narrowest = max(narrowest, int(doc_work / (allowed - lightest)))
    return narrowest


def _within(room: np.ndarray, work: np.ndarray, length: int, doc_work: int, m: int,
            fill: float, allowed: float) -> bool:
    """Whether m ranks (their ``room`` and ``work``) taking equal shares of the doc stay
    within ``allowed`` at their expected final workloads (``ends``): (work + doc_work /
    m) + max(0, room - length / m) x fill, in float64. O(m)."""
    after = room - length / m
    np.maximum(0.0, after, out=after)
    after *= fill
    ends = work + doc_work / m
    ends += after
    return bool(ends.max() <= allowed)


def finish(ranks: Ranks, spill: Sequence[tuple[int, int]], allowed: float, tail_largest: bool) -> None:
    """The rest of the pass: split the spill for tokens, then rebalance if R is missed."""
    split_spill(ranks, spill, tail_largest=tail_largest)
    if imbalance(ranks.work) > allowed * len(ranks.work) / sum(ranks.work):
        exchange(ranks, allowed)
