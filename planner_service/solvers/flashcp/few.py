"""Runs of equal docs on few ranks (N <= ``place.REFRESH``): ``place``'s loop for a run of
many docs of one length, as it would place them one by one (``runs.py``'s rule: each doc to
the rank with room of least key work - tokens x d, ties to the lowest rank, whole if that
rank stays within the allowed workload; ``place``'s heap yields that rank on so few
ranks).

A block of K docs is predicted (``drift.drift_ranks`` where the density falls along the
block, as longest first; else ``run_ranks``, at the block's first density), then checked
in stretches of ``CHECK_ROWS`` docs (fewer after a miss): every doc's rank against the keys of all N ranks given
the ranks before it (exact: the workload is below ``runs.EXACT``). The docs up to the first
miss are placed, and the miss itself by the keys checked; the prediction after it is
repaired (the rank found moved up to the miss, the rank predicted there put next) and the
check goes on from there. Once a block's misses pass ``MISSES`` (the keys cross too often
for the prediction), the rest of the run goes doc by doc in plain Python (``loop_steps``:
the N keys of every doc, the least taken). The run stops at a doc no rank takes whole
(left to ``place``'s loop).

Complexity per block of K docs on N ranks: the prediction O(M log M + K), M = O(K + N)
(``drift.py``); the checks O((K + c x CHECK_ROWS[1]) N) for c <= ``MISSES`` + 1 misses;
O(K log K + N) to add the shards; O(N) per doc one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner_service.solvers.flashcp.drift import drift_ranks
from planner_service.solvers.flashcp.ranks import Ranks
from planner_service.solvers.flashcp.runs import RUN_BLOCK, RunPlaced, add_run, run_densities

CHECK_ROWS = (32, 512)
"""Fewest and most docs checked at once against every rank: the fewest after a miss,
doubled after each stretch without one."""
FEW_BLOCK = 2048
"""Largest block predicted at once (a prediction's misses grow along a block)."""
MISSES = 1
"""Misses in a block past which the block stops and the rest of the run goes doc by doc
(``loop_steps``): the prediction is poor there, and each miss costs a check of
``CHECK_ROWS[0]`` docs against every rank, more than placing as many one by one."""


def place_run(
    length: int, docs: Sequence[int], ranks: Ranks, allowed: float, rest_tokens: int,
    rest_work: int,
) -> RunPlaced:
    """Place a leading part of a run of equal docs (each ``length`` tokens, in order) as
    ``place``'s loop would on N <= ``REFRESH`` ranks (module docstring). Returns (docs
    placed, the ranks given docs, the tokens and workload left unplaced, the density after
    the last doc placed)."""
    n = len(ranks.work)
    doc_work = length * (length + 1) // 2
    cap = ranks.capacity
    work = np.array(ranks.work, dtype=np.int64)
    tokens = np.array(ranks.tokens, dtype=np.int64)
    densities = run_densities(length, len(docs), rest_tokens, rest_work)
    picks: list[np.ndarray] = []
    placed, block, stop = 0, RUN_BLOCK[0], False
    while placed < len(docs) and not stop:
        k = min(block, len(docs) - placed)
        span = densities[placed:placed + k]
        predicted = drifted(work, tokens, cap, length, span)
        if predicted is None:
            predicted = run_ranks(work, tokens, cap, length, doc_work, float(span[0]), k)
        at, misses, rows = 0, 0, CHECK_ROWS[0]
        while at < k and not stop:
            end = min(at + rows, k)
            chosen, missed, stop = checked(work, tokens, cap, length, allowed,
                                           predicted[at:end], span[at:end])
            if len(chosen):
                given = np.bincount(chosen, minlength=n)
                work += given * doc_work
                tokens += given * length
                picks.append(chosen)
                at += len(chosen)
            rows = CHECK_ROWS[0] if missed else min(2 * rows, CHECK_ROWS[1])
            if missed:
                misses += 1
                if misses > MISSES:
                    break
                predicted = repaired(predicted, at - 1, int(chosen[-1]))
        placed += at
        if stop:
            break
        if at < k:  # the prediction missed too often: the rest of the run doc by doc
            chosen, stop = loop_steps(work, tokens, cap, length, allowed, densities[placed:])
            if len(chosen):
                picks.append(chosen)
                placed += len(chosen)
            break
        block = min(2 * block, FEW_BLOCK)
    if not placed:
        return RunPlaced(0, [], rest_tokens, rest_work, 0.0)
    changed = add_run(ranks, np.concatenate(picks), docs[:placed], length)
    return RunPlaced(placed, changed, rest_tokens - placed * length,
                     rest_work - placed * doc_work, float(densities[placed - 1]))


def checked(work: np.ndarray, tokens: np.ndarray, cap: int, length: int, allowed: float,
            predicted: np.ndarray, densities: np.ndarray) -> tuple[np.ndarray, bool, bool]:
    """The rule's ranks for the next docs (one per density), from the predicted ones: every
    doc's rank by the keys of all ranks given the predicted ranks before it; (the ranks
    up to the first miss and the miss's own, a miss ended them, a doc no rank takes whole
    ended them). O(K N) in numpy."""
    k, n = len(predicted), len(work)
    doc_work = length * (length + 1) // 2
    rows = np.arange(k)
    # Work and tokens of every rank before each doc, given the predicted ranks.
    given = np.zeros((k, n), dtype=np.int64)
    given[rows, predicted] = 1
    before = np.cumsum(given, axis=0) - given
    work_before = work + before * doc_work
    tokens_before = tokens + before * length
    keys = work_before.astype(np.float64) - tokens_before.astype(np.float64) * densities[:, None]
    room = tokens_before <= cap - length
    keys[~room] = np.inf
    best = keys.argmin(axis=1)
    whole = room[rows, best] & (work_before[rows, best] + doc_work <= allowed)
    missed = np.flatnonzero(~whole | (best != predicted))
    if not len(missed):
        return best, False, False
    first = int(missed[0])
    if not whole[first]:  # no rank takes it whole
        return best[:first], False, True
    return best[:first + 1], True, False  # mispredicted: its rank is the one checked


def repaired(predicted: np.ndarray, miss: int, found: int) -> np.ndarray:
    """The prediction after a miss at ``miss``, where the rule chose rank ``found``: that
    rank there, its next predicted doc taken out (it came early), and the rank predicted
    at the miss next (it is still due). The same length. O(K)."""
    rest = predicted[miss + 1:]
    early = np.flatnonzero(rest == found)
    rest = np.delete(rest, early[0]) if len(early) else rest[:-1]
    return np.concatenate((predicted[:miss], [found, predicted[miss]], rest))[:len(predicted)]


def drifted(work: np.ndarray, tokens: np.ndarray, cap: int, length: int,
            densities: np.ndarray) -> np.ndarray | None:
    """``drift.drift_ranks``' prediction where it applies (every density below (L + 1) / 2,
    none above the one before, room for every doc), else None. O(M log M), M = K + 2N."""
    half = (length + 1) / 2
    if not ((densities < half).all() and (densities[1:] <= densities[:-1]).all()):
        return None
    return drift_ranks(work, tokens, np.maximum((cap - tokens) // length, 0), length, densities)


def run_ranks(work: np.ndarray, tokens: np.ndarray, cap: int, length: int, doc_work: int,
              density: float, count: int) -> np.ndarray:
    """The ranks ``place_run`` expects the next ``count`` equal docs to go to, were the
    density to stay at ``density``: each doc to the rank of least key work - tokens x
    density with room, a doc adding doc_work - length x density to its rank's key (the
    same step for every rank), so the ranks take turns in the order of their keys' offsets
    modulo that step; with no positive step, the least key takes docs until it is full.
    Only a prediction (``place_run`` checks it). O(count N) in numpy."""
    n = len(work)
    keys = work.astype(np.float64) - tokens.astype(np.float64) * density
    fits = np.minimum(np.maximum((cap - tokens) // length, 0), count)  # docs each can take
    step = doc_work - length * density
    ranks = np.arange(n)
    with np.errstate(over="ignore", invalid="ignore"):
        phase = (keys - keys.min()) / step if step > 0 else np.full(n, np.inf)
    if not np.isfinite(phase).all():
        by_key = np.lexsort((ranks, keys))
        out = np.repeat(by_key, fits[by_key])
    else:
        lead = np.minimum(np.floor(phase), count).astype(np.int64)  # turns before its first
        turn = np.lexsort((ranks, phase - np.floor(phase)))
        level = np.arange(count)[:, None]
        takes = (lead[turn] <= level) & (level < lead[turn] + fits[turn])
        out = np.broadcast_to(turn, takes.shape)[takes]
    out = out[:count]
    return np.concatenate((out, np.zeros(count - len(out), dtype=np.int64))) if len(out) < count else out


def loop_steps(work: np.ndarray, tokens: np.ndarray, cap: int, length: int, allowed: float,
               densities: np.ndarray) -> tuple[np.ndarray, bool]:
    """The rule's ranks for the next docs (one per density), doc by doc in plain Python
    (the N <= ``REFRESH`` keys of a doc cost less as Python floats than as numpy calls);
    (ranks, a doc no rank takes whole ended them). Each key is work - tokens x d in
    float64 (Python floats round as numpy's; work and tokens, below 2^53, are exact as
    floats), work inf for a rank without room (its key inf); the least wins, the lowest
    rank on ties (``min`` and ``index`` take the first). O(K N)."""
    doc_work = length * (length + 1) // 2
    most = cap - length
    inf = float("inf")
    heavy = [float(w) if t <= most else inf for w, t in zip(work.tolist(), tokens.tolist(),
                                                              strict=True)]
    long = [float(t) for t in tokens.tolist()]
    chosen: list[int] = []
    add = chosen.append
    for density in densities.tolist():
        keys = [a - b * density for a, b in zip(heavy, long, strict=True)]
        least = min(keys)
        if least == inf:
            return np.array(chosen, dtype=np.int64), True
        r = keys.index(least)
        after = heavy[r] + doc_work
        if after > allowed:
            return np.array(chosen, dtype=np.int64), True
        add(r)
        held = long[r] + length
        long[r] = held
        heavy[r] = after if held <= most else inf
    return np.array(chosen, dtype=np.int64), False
