"""Runs of equal docs placed in blocks: ``place.place``'s rule for a run of many docs of
one length (L tokens, w = L (L + 1) / 2 work each) at once, as it would place them one by
one. Each doc goes to the rank with room of least key work - tokens x d (d: the density of
the docs left after it, ``place``'s figure), ties to the lowest rank, whole if that rank
stays within the allowed workload; the run stops at the first doc that rank cannot take
(``place``'s loop takes it on). All figures are exact in float64: the request's workload
is below ``EXACT``.

``run_heads`` finds the runs of at least ``RUN_MIN`` docs, O(D). Two block placements:

- ``few.place_run``, on N <= ``place.REFRESH`` ranks (where ``place``'s heap yields the
  least key, so both agree): ranks predicted (``drift.drift_ranks``, or at a constant
  density), every doc checked against the keys of all ranks. O(K N) per block of K docs,
  in numpy (``few.py``).
- ``place_run_exact``, on more ranks, where ``place``'s heap refreshes only ``REFRESH``
  stale keys per doc and so is inexact while the density changes from doc to doc: the
  least-key rule itself, without checking every rank per doc. A rank's key before its
  (j + 1)-th doc of the run is A - B d with A = work + j w and B = tokens + j L: a line in
  d, and each doc it takes adds s = w - L d.

  * Flat (d = h = (L + 1) / 2, so w = L d: every doc left has length L): taking a doc
    leaves a rank's key unchanged, exactly so in float64 (``FLAT_LIMIT``). The ranks
    with room, by key (ties: lowest rank), each take docs until their room runs out; the
    first whose allowance runs out before its room stops the run. O(N log N + K).
  * Sloped (every d of the block below h: s > 0, so a rank's key rises with each doc
    it takes): the K docs of a block are predicted as the K least keys at the block's
    first density among every rank's next docs (``predicted``), then certified
    (``sloped_block``): the sequence of the predicted docs followed by each rank's next
    doc after the block must be in order (key, then rank) at every density of the
    block. Two neighbours are checked (``certified``; order is transitive): their key
    difference is linear in d, so it must exceed a margin that bounds both keys'
    rounding (``MARGIN``) at the block's least and greatest density; or both are the
    same (work, tokens) state, whose keys are equal bit for bit, lower rank first. At
    the i-th doc every rank's next doc lies at or after the i-th predicted doc in that
    sequence, so the predicted rank has the least key (the lowest rank among equal
    keys) at the doc's density: the rule. From empty ranks, or ranks holding docs of
    the run's length only (a round robin), blocks pass. Where the ranks' token counts
    differ widely, keys of ranks cross as d falls, and a block across a crossing fails:
    it is halved, and below ``RUN_BLOCK[0]`` docs the next docs go one at a time.
    Before the prediction, ``first_apart`` checks in O(N) conditions the certificate
    implies (the first doc before every rank's next doc; the docs that open the
    sequence, each before the next), so most blocks that would fail cost only that.
    O((K + N) log(K + N)) per block.
  * One at a time (``single_steps``: after failed blocks, for densities above h, which
    only orders other than longest first give, and for flat keys too large for float64
    to hold exactly): every rank's key, the least taken, O(N) per doc in numpy.

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
"""Smallest and largest block of docs ``few.place_run`` checks at once; the smallest block
``place_run_exact`` certifies, and the fewest and most docs it places one at a time
before trying blocks again."""
EXACT_BLOCK = 1 << 16
"""Largest block ``place_run_exact`` certifies at once."""
FLAT_LIMIT = 1 << 51
"""Bound on workloads and on tokens x (L + 1) under which flat keys work - tokens x
(L + 1) / 2 are exact in float64 (half-integers below 2^52)."""
MARGIN = 2.0 ** -50
"""Relative bound of a certified key difference's rounding: the two keys A - B d carry
at most 2^-53 (|A| + 3 |B d|) each, the difference of A and B d at the block's ends
2^-53 (3 |A| + 2 |B d|); 2^-50 (max |A| + max |B| d + 1) covers their sum."""


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


def place_run_exact(
    length: int, docs: Sequence[int], ranks: Ranks, allowed: float, rest_tokens: int,
    rest_work: int,
) -> RunPlaced:
    """Place a leading part of a run of equal docs (each ``length`` tokens, in order) by
    the least-key rule (module docstring): the same docs to the same ranks as
    ``place_run_reference``, stopping at the same doc (one no rank takes whole).

    Flat docs go in one block; sloped docs in blocks of K, from ``RUN_BLOCK[0]`` docs,
    doubled after a block passes its check and halved after one fails; below
    ``RUN_BLOCK[0]`` (and for densities above (L + 1) / 2: not a longest-first order),
    docs go one at a time (``single_steps``), ``RUN_BLOCK[0]`` of them before blocks
    are tried again, twice as many after each block that fails in a row. O((K + N)
    log(K + N)) per block of K docs, O(N) per doc one at a time, O(N + K) to start and
    to add the shards. The densities are computed as far as the docs looked at, in
    doubling steps (a run stopped early costs O(docs placed), not O(K))."""
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
    placed, block, steps, burst = 0, RUN_BLOCK[0], 0, RUN_BLOCK[0]
    while placed < len(docs):
        now = float(known(placed + 1)[0])
        if now == half and flat_exact:
            rest = known(len(docs))
            count = int(np.argmin(rest == half)) if not (rest == half).all() else len(rest)
            chosen, stop = flat_block(work, tokens, cap, length, allowed, half, count)
        elif now < half and not steps:
            # The sloped docs of the block: every density below h.
            span = known(placed + block)
            count = int(np.argmin(span < half)) if not (span < half).all() else len(span)
            found = sloped_block(work, tokens, cap, length, allowed, span[:count])
            if found is None:  # not certified: a smaller block, or docs one at a time
                if block // 2 >= RUN_BLOCK[0]:
                    block //= 2
                else:
                    steps, burst = burst, min(2 * burst, RUN_BLOCK[1])
                continue
            chosen, stop = found
            block, burst = min(2 * block, EXACT_BLOCK), RUN_BLOCK[0]
        else:  # one at a time: after a failed block, above h, or flat keys that would round
            count = min(steps or RUN_BLOCK[1], len(docs) - placed)
            chosen, stop = single_steps(work, tokens, cap, length, allowed,
                                        known(placed + count))
            steps = max(0, steps - count)
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


def sloped_block(work: np.ndarray, tokens: np.ndarray, cap: int, length: int, allowed: float,
                 densities: np.ndarray) -> tuple[np.ndarray, bool] | None:
    """The ranks of the next docs (one per density, every density below (L + 1) / 2),
    predicted and certified (module docstring); (ranks, stopped short), or None if the
    prediction is not certified. O((K + N) log(K + N))."""
    doc_work = length * (length + 1) // 2
    fits = np.maximum((cap - tokens) // length, 0)
    count = min(len(densities), int(fits.sum()))
    if not count:
        return np.zeros(0, dtype=np.int64), True
    if not doc_work - length * float(densities[0]) > 0:
        return None  # keys too close to flat for the prediction's phases
    if not first_apart(work, tokens, fits, cap, length, count, float(densities[0]),
                       float(densities.min()), float(densities.max())):
        return None  # the certificate below would fail (``first_apart``)
    rank, heavy, long = predicted(work, tokens, fits, length, float(densities[0]), count)
    given = np.bincount(rank, minlength=len(work))
    # Each rank's docs in the block are its next ones, in order.
    by_rank = np.argsort(rank, kind="stable")
    ends = np.cumsum(given)
    nth = np.arange(count) - np.repeat(ends - given, given)
    if not np.array_equal((heavy[by_rank] - work[rank[by_rank]]) // doc_work, nth):
        return None
    # Each rank's next doc after the block, if it has room for one.
    after = np.flatnonzero(given < fits)
    after_heavy = work[after] + given[after] * doc_work
    after_long = tokens[after] + given[after] * length
    low, high = float(densities.min()), float(densities.max())
    most = max(int(heavy.max()), int(after_heavy.max(initial=0)))
    margin = MARGIN * (most + cap * high + 1)
    if not (certified(heavy[:-1], long[:-1], rank[:-1], heavy[1:], long[1:], rank[1:],
                      low, high, margin).all()
            and certified(heavy[-1], long[-1], rank[-1], after_heavy, after_long, after,
                          low, high, margin).all()):
        return None
    within = heavy + doc_work <= allowed
    if not within.all():
        return rank[:int(np.argmin(within))], True
    return rank, count < len(densities)


def first_apart(work: np.ndarray, tokens: np.ndarray, fits: np.ndarray, cap: int,
                length: int, count: int, density: float, low: float,
                high: float) -> bool:
    """Necessary conditions of ``sloped_block``'s certificate, cheap to check first, at a
    margin no larger than the certificate's (its largest workload is at least that of any
    rank with room). The first predicted doc (the next doc of the rank of least key at
    ``density``, ties to the lowest rank) must lie before every other rank's next doc by
    ``certified``'s rule: every rank with room has its next doc in the certified
    sequence, where order is transitive. And the ranks' next docs of keys below the least
    plus s = w - L x density (before any rank's second doc: keys rise by s per doc) open
    the predicted sequence in key order, so up to the block's ``count`` docs each must
    lie before the next. A block failing either fails the certificate; False only costs
    the block (docs then go one at a time, by the same rule). O(N) in numpy, plus the
    sort of those first docs."""
    active = np.flatnonzero(fits)
    if len(active) < 2:
        return True
    held, have = work[active], tokens[active]
    keys = held.astype(np.float64) - have.astype(np.float64) * density
    first = int(np.argmin(keys))
    margin = MARGIN * (int(held.max()) + cap * high + 1)
    fine = certified(held[first], have[first], active[first], held, have, active, low, high,
                     margin)
    fine[first] = True
    if not fine.all():
        return False
    step = length * (length + 1) // 2 - length * density
    opening = np.flatnonzero(keys < keys[first] + step)
    if len(opening) < 3:
        return True
    opening = opening[np.lexsort((opening, keys[opening]))][:count]
    a, b = opening[:-1], opening[1:]
    return bool(certified(held[a], have[a], active[a], held[b], have[b], active[b], low, high,
                          margin).all())


def certified(first_heavy: np.ndarray | np.int64, first_long: np.ndarray | np.int64,
              first_rank: np.ndarray | np.int64, heavy: np.ndarray, long: np.ndarray,
              rank: np.ndarray, low: float, high: float, margin: float) -> np.ndarray:
    """Per pair of docs (one placed before the other, keys A - B d with A = ``heavy``, B =
    ``long``): the first's key is below the second's by more than ``margin`` at both
    densities ``low`` and ``high`` (so at every density between: the difference is linear
    in d), or both have the same A and B (keys equal bit for bit) and the first the lower
    rank."""
    d_heavy = (heavy - first_heavy).astype(np.float64)
    d_long = (long - first_long).astype(np.float64)
    apart = (d_heavy - d_long * low > margin) & (d_heavy - d_long * high > margin)
    return apart | ((heavy == first_heavy) & (long == first_long) & (rank > first_rank))


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
    rest_work: int,
) -> RunPlaced:
    """``place_run_exact``'s rule doc by doc, every rank scanned: each doc to the rank
    with room of least key work - tokens x density (ties: lowest rank), if it stays within
    ``allowed``; else stop. O(K N)."""
    n = len(ranks.work)
    doc_work = length * (length + 1) // 2
    cap, tokens, work = ranks.capacity, ranks.tokens, ranks.work
    placed, density, changed = 0, 0.0, set()
    for doc in docs:
        left_tokens, left_work = rest_tokens - length, rest_work - doc_work
        at = left_work / left_tokens if left_tokens else 0.0
        best, best_key = -1, float("inf")
        for r in range(n):
            if tokens[r] <= cap - length:
                key = work[r] - tokens[r] * at
                if key < best_key:
                    best, best_key = r, key
        if best < 0 or work[best] + doc_work > allowed:
            break
        ranks.add(best, doc, 0, length)
        changed.add(best)
        rest_tokens, rest_work, density = left_tokens, left_work, at
        placed += 1
    return RunPlaced(placed, sorted(changed), rest_tokens, rest_work, density)
