"""Runs of equal docs placed in blocks: ``place.place``'s rule for a run of many docs of
one length (L tokens, w = L (L + 1) / 2 work each) at once. Each doc goes to the rank with
room of least key work - tokens x d (d: the density of the docs left after it,
``place``'s figure; on many ranks held over a block, below), ties to the lowest rank,
whole if that rank stays within the allowed workload; the run stops at the first doc that
rank cannot take (``place``'s loop takes it on). All figures are exact in float64: the
request's workload is below ``EXACT``.

``run_heads`` finds the runs of at least ``RUN_MIN`` docs, O(D). Two block placements:

- ``few.place_run``, on N <= ``place.REFRESH`` ranks (where ``place``'s heap yields the
  least key, so both agree): ranks predicted (``drift.drift_ranks``, or at a constant
  density), every doc checked against the keys of all ranks. O(K N) per block of K docs,
  in numpy (``few.py``).
- ``place_run_blocks``, on more ranks, where ``place``'s heap refreshes only ``REFRESH``
  stale keys per doc and so is inexact while the density changes from doc to doc: the
  least-key rule with the density held for blocks of docs. A rank's key before its
  (j + 1)-th doc of the run is A - B d with A = work + j w and B = tokens + j L; each doc
  it takes adds s = w - L d.

  * Flat (d = h = (L + 1) / 2, so w = L d: every doc left has length L): taking a doc
    leaves a rank's key unchanged, exactly so in float64 (``FLAT_LIMIT``). The ranks
    with room, by key (ties: lowest rank), each take docs until their room runs out; the
    first whose allowance runs out before its room stops the run. O(N log N + K).
  * Sloped (d below h: s > 0, so a rank's key rises with each doc it takes): blocks of
    up to ``HELD_BLOCK`` docs, each placed at the density after its first doc: the K
    docs of least key among every rank's next docs at that density (``predicted``), in
    key order, ties to the lowest rank: the rule doc by doc at a density that stays put
    for the block. Holding it is what makes a block one sort: at the density after each
    doc, ranks whose token counts differ widely swap places as d falls, and no block of
    more than a few docs is certain (mixed lengths at D = 100,000: 73,000 docs of 2-21
    tokens then go one at a time, most of the layout's time). The density falls by
    little over a block of short docs; ``place``'s own heap, beyond ``REFRESH`` ranks,
    takes stale keys too. O((K + N) log(K + N)) per block.
  * One at a time (``single_steps``: densities above h, which only orders other than
    longest first give, flat keys too large for float64 to hold exactly, and blocks
    whose step s is too small beside the keys for ``predicted``'s phases): every rank's
    key, the least taken, O(N) per doc in numpy.

  The run ends only where the rule ends it: at a doc no rank takes whole (its rank of
  least key has no room or would pass the allowed workload), which ``place``'s loop then
  spills or splits. ``place_run_reference`` is the rule doc by doc, O(K N) in Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import NamedTuple

import numpy as np

from planner_service.core.plan import Shard
from planner_service.solvers.flashcp.drift import docs_by_level, least_whole_level
from planner_service.solvers.flashcp.ranks import Ranks, new_shard

EXACT = 1 << 53
"""Total workload below which int64 figures convert to float64 exactly (both placements)."""
RUN_MIN = 64
"""Equal docs in a row from which ``place`` places them in blocks."""
RUN_RETRY = 64
"""Docs of a run placed one by one after a block placement stops short, before it is
tried again (on more than ``place.REFRESH`` ranks, doubled at each try)."""
RUN_BLOCK = (64, 4096)
"""Smallest and largest block of docs ``few.place_run`` checks at once; the most docs
``place_run_blocks`` places one at a time in one call of ``single_steps``."""
HELD_BLOCK = 1024
"""Most docs ``place_run_blocks`` places at one held density."""
FLAT_LIMIT = 1 << 51
"""Bound on workloads and on tokens x (L + 1) under which flat keys work - tokens x
(L + 1) / 2 are exact in float64 (half-integers below 2^52)."""
STEP_FLOOR = 2.0 ** -40
"""Least step s of a held block relative to its largest key figure (work + tokens x d):
above it, consecutive keys of a rank rise in float64 (each key rounds by at most 2^-52 of
that figure, twice), so ``predicted``'s order is the rule's."""


class RunPlaced(NamedTuple):
    """What a block placement did."""

    placed: int
    """Leading docs of the run placed (whole)."""
    changed: list[int]
    """Ranks given docs, ascending."""
    rest_tokens: int
    """Tokens of the docs not yet placed (this run's and later ones)."""
    rest_work: int
    """Their workload."""
    density: float
    """The density after the last doc placed (``place``'s figure; 0.0 if none)."""


def run_heads(doc_lengths: Sequence[int] | np.ndarray,
              order: Sequence[int]) -> dict[int, tuple[int, int]]:
    """The first doc of every run of at least ``RUN_MIN`` equal lengths in ``order``:
    doc -> (its position in ``order``, the run's length); none on fewer than 4 x
    ``RUN_MIN`` docs (one by one, they take little time). O(D) in numpy."""
    if len(order) < 4 * RUN_MIN:
        return {}
    lengths = np.asarray(doc_lengths, dtype=np.int64)[np.asarray(order, dtype=np.int64)]
    starts = np.flatnonzero(np.concatenate(([True], lengths[1:] != lengths[:-1])))
    sizes = np.diff(np.append(starts, len(lengths)))
    long = sizes >= RUN_MIN
    return {order[at]: (at, size) for at, size in zip(starts[long].tolist(), sizes[long].tolist(),
                                                      strict=True)}


def run_densities(length: int, count: int, rest_tokens: int, rest_work: int,
                  start: int = 0) -> np.ndarray:
    """The density after each of the next ``count`` docs of ``length`` tokens, as ``place``
    computes it (the docs left's workload / tokens, 0.0 once none is left; exact: both
    below 2^53, one rounding), from the ``start``-th doc on (the docs before it placed
    too). O(count) in numpy."""
    steps = np.arange(start + 1, start + count + 1, dtype=np.int64)
    left_tokens = rest_tokens - steps * length
    left_work = rest_work - steps * (length * (length + 1) // 2)
    out = np.zeros(count)
    some = left_tokens > 0
    out[some] = left_work[some] / left_tokens[some]
    return out


def place_run_blocks(
    length: int, docs: Sequence[int], ranks: Ranks, allowed: float, rest_tokens: int,
    rest_work: int,
) -> RunPlaced:
    """Place a leading part of a run of equal docs (each ``length`` tokens, in order) by
    the least-key rule with the density held over blocks (module docstring): the same docs
    to the same ranks as ``place_run_reference``, stopping at the same doc (one no rank
    takes whole).

    Flat docs go in one block, sloped docs in blocks of up to ``HELD_BLOCK`` (each at the
    density after its first doc), others one at a time (``single_steps``, up to
    ``RUN_BLOCK[1]`` per call). O((K + N) log(K + N)) per block of K docs, O(N) per doc one
    at a time, O(N + K) to start and to add the shards. The densities are computed as far
    as the docs looked at, in doubling steps (a run stopped early costs O(docs placed),
    not O(K))."""
    n = len(ranks.work)
    doc_work = length * (length + 1) // 2
    cap = ranks.capacity
    work = np.array(ranks.work, dtype=np.int64)
    tokens = np.array(ranks.tokens, dtype=np.int64)
    densities = run_densities(length, min(len(docs), RUN_BLOCK[1]), rest_tokens, rest_work)

    def known(end: int) -> np.ndarray:
        """The densities after docs placed .. end - 1 (at most to the run's end)."""
        nonlocal densities
        have = len(densities)
        if end > have:
            more = min(len(docs), max(end, 2 * have)) - have
            densities = np.concatenate(
                (densities, run_densities(length, more, rest_tokens, rest_work, have)))
        return densities[placed:end]
    half = (length + 1) / 2
    flat_exact = (int(work.max(initial=0)) + len(docs) * doc_work < FLAT_LIMIT
                  and cap * (length + 1) < FLAT_LIMIT)
    picks: list[np.ndarray] = []
    placed = 0
    while placed < len(docs):
        now = float(known(placed + 1)[0])
        if now == half and flat_exact:
            count = leading(known(len(docs)) == half)
            chosen, stop = flat_block(work, tokens, cap, length, allowed, half, count)
        elif now < half:  # sloped: a block at the density after its first doc
            count = leading(known(placed + HELD_BLOCK) < half)
            chosen, stop = held_block(work, tokens, cap, length, allowed, now, count)
        else:  # one at a time: above h, or flat keys that would round
            count = leading(known(placed + RUN_BLOCK[1]) >= half)
            chosen, stop = single_steps(work, tokens, cap, length, allowed,
                                        known(placed + count))
        if len(chosen):
            given = np.bincount(chosen, minlength=n)
            work += given * doc_work
            tokens += given * length
            picks.append(chosen)
            placed += len(chosen)
        if stop:
            break
    if not placed:
        return RunPlaced(0, [], rest_tokens, rest_work, 0.0)
    changed = add_run(ranks, np.concatenate(picks), docs[:placed], length)
    return RunPlaced(placed, changed, rest_tokens - placed * length,
                     rest_work - placed * doc_work, float(densities[placed - 1]))


def leading(holds: np.ndarray) -> int:
    """How many of ``holds`` are true before the first false one. O(len(holds))."""
    return int(np.argmin(holds)) if not holds.all() else len(holds)


def single_steps(work: np.ndarray, tokens: np.ndarray, cap: int, length: int, allowed: float,
                 densities: np.ndarray) -> tuple[np.ndarray, bool]:
    """The ranks of the next docs (one per density) by the rule one doc at a time: the
    least key work - tokens x d (float64, as ``place`` computes it: both figures exact
    below 2^53; ties: the lowest rank, ``np.argmin``'s first) among the ranks with room;
    (ranks, stopped at a doc no rank takes whole). Only the ranks with room for a doc at
    the start are scanned, in rank order (token counts only grow: the others never have
    room again), so ties still go to the lowest rank; one that runs out of room keeps
    work inf (inf - x is inf: never the least), and once every one has, the stop comes
    as in ``single_steps_reference`` (its least rank has no room). Two numpy calls and an
    argmin per doc over the ranks with room: O(N) per doc."""
    doc_work = length * (length + 1) // 2
    most = cap - length
    room = np.flatnonzero(tokens <= most)
    if not len(room):
        return np.zeros(0, dtype=np.int64), True
    rank_of = room.tolist()
    held, have = work[room].tolist(), tokens[room].tolist()
    heavy = work[room].astype(np.float64)
    long = tokens[room].astype(np.float64)
    keys = np.empty(len(room))
    multiply, subtract = np.multiply, np.subtract
    chosen: list[int] = []
    for density in densities.tolist():
        multiply(long, density, out=keys)
        subtract(heavy, keys, out=keys)
        j = int(keys.argmin())
        if have[j] > most or held[j] + doc_work > allowed:
            return np.array(chosen, dtype=np.int64), True
        chosen.append(rank_of[j])
        held[j] += doc_work
        have[j] += length
        heavy[j] = held[j] if have[j] <= most else np.inf
        long[j] = have[j]
    return np.array(chosen, dtype=np.int64), False


def single_steps_reference(work: np.ndarray, tokens: np.ndarray, cap: int, length: int,
                           allowed: float, densities: np.ndarray) -> tuple[np.ndarray, bool]:
    """The ranks of the next docs (one per density) by the rule one doc at a time: the
    least key work - tokens x d (float64, as ``place`` computes it: both figures exact
    below 2^53; ties: the lowest rank, ``np.argmin``'s first) among the ranks with room;
    (ranks, stopped at a doc no rank takes whole). A rank without room keeps work inf
    (inf - x is inf: never the least); the others' keys are as computed. Two numpy calls
    and an argmin per doc over every rank: O(N) per doc (``single_steps`` over the ranks
    with room only)."""
    doc_work = length * (length + 1) // 2
    most = cap - length
    held, have = work.tolist(), tokens.tolist()
    heavy = np.where(tokens <= most, work.astype(np.float64), np.inf)
    long = tokens.astype(np.float64)
    keys = np.empty(len(work))
    multiply, subtract = np.multiply, np.subtract
    chosen: list[int] = []
    for density in densities.tolist():
        multiply(long, density, out=keys)
        subtract(heavy, keys, out=keys)
        r = int(keys.argmin())
        if have[r] > most or held[r] + doc_work > allowed:
            return np.array(chosen, dtype=np.int64), True
        chosen.append(r)
        held[r] += doc_work
        have[r] += length
        heavy[r] = held[r] if have[r] <= most else np.inf
        long[r] = have[r]
    return np.array(chosen, dtype=np.int64), False


def add_run(ranks: Ranks, chosen: np.ndarray, docs: Sequence[int], length: int) -> list[int]:
    """Add doc ``docs[i]`` whole to rank ``chosen[i]`` for every i, in order (the shards
    from ``ranks.whole`` if set); the ranks given docs, ascending. O(K log K + N)."""
    given = np.bincount(chosen)
    changed = np.flatnonzero(given).tolist()
    shards, tokens, work, whole = ranks.shards, ranks.tokens, ranks.work, ranks.whole
    if len(chosen) < 4 * len(changed):  # few docs per rank: one by one
        if whole is None:
            for doc, r in zip(docs, chosen.tolist(), strict=True):
                shards[r].append(new_shard(Shard, (doc, 0, length)))
        else:  # the docs' shards at hand (``ranks.Whole``)
            for doc, r in zip(docs, chosen.tolist(), strict=True):
                shards[r].append(whole[doc])
    else:  # the docs grouped by rank, in order (a stable sort), one extend per rank
        held = np.asarray(docs, dtype=np.int64)[np.argsort(chosen, kind="stable")].tolist()
        at = 0
        for r, count in zip(changed, given[changed].tolist(), strict=True):
            part = held[at:at + count]
            shards[r].extend(map(new_shard, repeat(Shard), zip(part, repeat(0), repeat(length)))
                             if whole is None else map(whole.__getitem__, part))
            at += count
    doc_work = length * (length + 1) // 2
    for r, count in zip(changed, given[changed].tolist(), strict=True):
        tokens[r] += count * length
        work[r] += count * doc_work
    return changed


def allowances(work: np.ndarray, doc_work: int, allowed: float, most: np.ndarray) -> np.ndarray:
    """Per rank, the most docs of ``doc_work`` it can take within ``allowed``, at most
    ``most`` (compared exactly: int64 figures below 2^53 convert to float64 exactly)."""
    estimate = np.floor((allowed - work.astype(np.float64)) / doc_work)
    count = np.clip(estimate, 0, most).astype(np.int64)
    over = (count > 0) & (work + count * doc_work > allowed)
    count[over] -= 1
    under = (count < most) & (work + (count + 1) * doc_work <= allowed)
    count[under] += 1
    return count


def flat_block(work: np.ndarray, tokens: np.ndarray, cap: int, length: int, allowed: float,
               half: float, count: int) -> tuple[np.ndarray, bool]:
    """The ranks of the next ``count`` docs at density (L + 1) / 2, where a rank's key
    work - tokens x d stays the same as it takes docs: by key (ties: lowest rank), each
    rank with room takes docs until full; the first whose allowance ends first stops the
    run. (ranks, stopped short). O(N log N + count)."""
    doc_work = length * (length + 1) // 2
    fits = (cap - tokens) // length
    active = np.flatnonzero(fits > 0)
    if not len(active):
        return np.zeros(0, dtype=np.int64), True
    keys = work[active].astype(np.float64) - tokens[active].astype(np.float64) * half
    by_key = active[np.lexsort((active, keys))]
    room = fits[by_key]
    allow = allowances(work[by_key], doc_work, allowed, room)
    short = np.flatnonzero(allow < room)
    last = int(short[0]) + 1 if len(short) else len(by_key)  # ranks up to the stopper
    takes = np.minimum(room, allow)[:last]
    chosen = np.repeat(by_key[:last], takes)
    return chosen[:count], len(chosen) < count


def held_block(work: np.ndarray, tokens: np.ndarray, cap: int, length: int, allowed: float,
               density: float, count: int) -> tuple[np.ndarray, bool]:
    """The ranks of the next ``count`` docs at one held ``density`` below (L + 1) / 2: the
    docs of least key among every rank's next docs, in key order (ties: lowest rank),
    up to the first whose rank has no room or would pass ``allowed``; (ranks, stopped
    short). By ``predicted`` where each doc raises its rank's key by more than
    ``STEP_FLOOR`` of the keys' figures, else ``single_steps`` at that density.
    O((K + N) log(K + N))."""
    doc_work = length * (length + 1) // 2
    fits = np.maximum((cap - tokens) // length, 0)
    room = min(count, int(fits.sum()))
    if not room:
        return np.zeros(0, dtype=np.int64), True
    step = doc_work - length * density
    if not step > STEP_FLOOR * (int(work.max()) + room * doc_work + cap * density + 1):
        return single_steps(work, tokens, cap, length, allowed, np.full(count, density))
    rank, heavy, _ = predicted(work, tokens, fits, length, density, room)
    within = heavy + doc_work <= allowed
    if not within.all():
        return rank[:int(np.argmin(within))], True
    return rank, room < count


def predicted(work: np.ndarray, tokens: np.ndarray, fits: np.ndarray, length: int,
              density: float, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``count`` docs of least key at ``density`` among every rank's next docs (the
    j-th, j < its room in docs, keyed A - B x density with A = work + j w, B = tokens +
    j L), in key order (ties: lowest rank, then j): their (ranks, A, B).

    Keys rise by s = w - L x density > 0 per doc, so a rank's j-th doc comes at time
    phase + j, phase = (its key - the least key) / s. The least whole level m with
    ``count`` docs at times <= m is found by bisection; the docs at times <= m - 1 are
    fewer, and the band (m - 1, m] holds one doc per rank at most: the time t at which
    ``count`` docs are reached is found among the band's (np.partition), and the docs
    at times <= t (plus a tolerance for rounding) are sorted by their keys themselves,
    so docs of equal keys go lowest rank first whatever their times' rounding. O(N log(count + phase spread) + count
    log count)."""
    doc_work = length * (length + 1) // 2
    active = np.flatnonzero(fits)
    room = fits[active]
    keys = work[active].astype(np.float64) - tokens[active].astype(np.float64) * density
    step = doc_work - length * density
    phase = (keys - keys.min()) / step

    def docs_by(level: float) -> np.ndarray:
        return docs_by_level(phase, room, level)

    high = least_whole_level(phase, room, count)
    below = docs_by(high - 1)
    band = np.flatnonzero(docs_by(high) > below)
    times = phase[band] + below[band]
    need = count - int(below.sum())
    cut = float(np.partition(times, need - 1)[need - 1])
    tolerance = 1e-6 + 1e-9 * (float(np.abs(keys).max()) + 1) / step
    each = docs_by(cut + tolerance)
    rank = np.repeat(active, each)
    nth = np.arange(len(rank)) - np.repeat(np.cumsum(each) - each, each)
    heavy = work[rank] + nth * doc_work
    long = tokens[rank] + nth * length
    key = heavy.astype(np.float64) - long.astype(np.float64) * density
    first = np.lexsort((nth, rank, key))[:count]
    return rank[first], heavy[first], long[first]


def place_run_reference(
    length: int, docs: Sequence[int], ranks: Ranks, allowed: float, rest_tokens: int,
    rest_work: int, held_docs: int | None = None,
) -> RunPlaced:
    """``place_run_blocks``'s rule doc by doc, every rank scanned: each doc to the rank
    with room of least key work - tokens x d (ties: lowest rank), if it stays within
    ``allowed``; else stop. d is the doc's own density (the docs left's workload per
    token) where that is (L + 1) / 2 or above; below, the density held from the first doc
    of its block: a block starts at a doc below (L + 1) / 2 after one that is not, and
    after ``held_docs`` docs (``HELD_BLOCK`` if None; 1: every doc at its own density,
    the rule of ``place``'s loop and ``few.place_run``). O(K N)."""
    held_docs = HELD_BLOCK if held_docs is None else held_docs
    n = len(ranks.work)
    doc_work = length * (length + 1) // 2
    half = (length + 1) / 2
    cap, tokens, work = ranks.capacity, ranks.tokens, ranks.work
    placed, density, changed = 0, 0.0, set()
    held, held_left = 0.0, 0
    for doc in docs:
        left_tokens, left_work = rest_tokens - length, rest_work - doc_work
        at = left_work / left_tokens if left_tokens else 0.0
        if at < half:
            if not held_left:
                held, held_left = at, held_docs
            held_left -= 1
            key_density = held
        else:
            key_density, held_left = at, 0
        best, best_key = -1, float("inf")
        for r in range(n):
            if tokens[r] <= cap - length:
                key = work[r] - tokens[r] * key_density
                if key < best_key:
                    best, best_key = r, key
        if best < 0 or work[best] + doc_work > allowed:
            break
        ranks.add(best, doc, 0, length)
        changed.add(best)
        rest_tokens, rest_work, density = left_tokens, left_work, at
        placed += 1
    return RunPlaced(placed, sorted(changed), rest_tokens, rest_work, density)
