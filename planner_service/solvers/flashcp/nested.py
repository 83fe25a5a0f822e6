"""Nested zigzag: a doc no rank can hold whole, cut for the least KV on the critical path.

FlashCP's Per-Doc zigzag (``ranks.zigzag``) cuts such a doc into 2m equal chunks,
chunk i and 2m-1-i on the i-th of m ranks: equal workloads, but the rank holding the
outermost pair needs the doc's prefix up to the top minus its two chunks, (m-1)/m of the
doc. The exact ILP's placements of such docs (bench/results/ilp_compare.md) are nested
pairs of *unequal* chunks instead: the outer rank holds a long cheap low chunk and a short
top chunk, the next rank the pair inside them, and so on, with the chunk sizes set so that
no rank needs much more KV than the others.

Roles i = 0 .. m-1 hold a low chunk [l_i, l_{i+1}) and a high chunk [h_{i+1}, h_i) with
l_0 = 0, h_0 = L, l_m = h_m. A role holding k_i tokens of its span [l_i, h_i) needs the
KV of the doc's prefix up to h_i minus what it holds:

    need_i = h_i - k_i = l_i + (h_{i+1} - l_{i+1})

Given a bound D on what any of the m ranks may then need (its need so far plus need_i),
roles are filled outside in: role i takes k_i tokens, at least what keeps need_i within D,
at most its token room and the most its workload budget can hold (all in its low chunk,
the cheapest place), and its low chunk is as short as the budget allows (a short low chunk
keeps l_{i+1}, the next roles' need, small). Two choices of k_i are tried depth first, the
most (least span left for the inner roles) and the fewest (least work, so the shortest low
chunk); the last role takes the whole span left. A binary search over D and a loop over m
keep the least D found. The budget counts that the room a role leaves will be filled later
at ``density`` (work per token of the docs not yet placed), as ``place.ends`` does.

The search is a heuristic: a D it proves feasible is met, but the binary search may miss a
smaller feasible D (feasibility is not monotone in D under the two choices).

Bounds: the depth-first search visits at most ``NODES`` nodes per bound tried (it fails
that bound once they are spent; the full two-choice tree over m roles has 2^(m+1) - 1
nodes, so for m <= 8 the search is exhaustive), each O(1). The loop over m tries the
fewest ranks whose room covers the doc, m0, up to m0 + ``WIDTHS`` - 1 (m = 2 .. N when
N <= ``WIDTHS`` + 1), each with about log2(``STEPS``) + 2 bounds. One doc then costs
O(N log N + WIDTHS x log STEPS x NODES), independent of N beyond the sort of the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from planner_service.core.cost import alltoallv_receives
from planner_service.solvers.flashcp.ranks import Ranks

STEPS = 128
"""The bound is searched to within length / STEPS tokens (about 7 halvings, not 15)."""
NODES = 512
"""Nodes the depth-first search may visit per bound: the whole two-choice tree up to 8
roles (511 nodes), a capped beam beyond."""
WIDTHS = 8
"""Numbers of ranks m tried per doc, from the fewest whose room covers it."""

Chunks = list[tuple[tuple[int, int], tuple[int, int]]]
"""Per role: ((low start, low end), (high start, high end)); empty chunks have start == end."""


class Role(NamedTuple):
    """One rank's limits for the doc."""

    room: int
    """Tokens it may still take."""
    budget: float
    """Most work of the doc's tokens it may take, minus ``density`` x their count."""
    need: int
    """KV it needs so far (before this doc)."""


def nested_chunks(length: int, roles: Sequence[Role], bound: int, density: float) -> Chunks | None:
    """Chunks of a doc of ``length`` tokens over ``roles`` (outermost first) such that every
    role's need so far plus its need of the doc is at most ``bound``, within every role's
    room and budget; None if the search finds none within ``NODES`` nodes (module
    docstring)."""
    return _fill(0, length, roles, 0, bound, density, [NODES])


def _fill(low: int, high: int, roles: Sequence[Role], i: int, bound: int, density: float,
          left: list[int]) -> Chunks | None:
    """Roles i.. take the span [low, high) (depth first over the two choices of k);
    ``left[0]``: nodes the search may still visit."""
    if high <= low:
        return []
    if i == len(roles) or left[0] <= 0:
        return None
    left[0] -= 1
    role = roles[i]
    span = high - low
    fewest = span - (bound - role.need - low)  # need_i = low + span - k <= bound - need
    most = min(role.room, span)
    if i == len(roles) - 1:
        choices = [span] if most == span and fewest <= span else []
    else:
        if role.budget < 0:
            return None
        # The most tokens whose cheapest placement, all low ([low, low + k)), fits the
        # budget: k (2 low + k + 1) / 2 - density k <= budget.
        b = 2 * low + 1 - 2 * density
        most = min(most, int((-b + math.sqrt(b * b + 8 * role.budget)) / 2))
        fewest = max(0, fewest)
        if fewest > most:
            return None
        choices = [most] if fewest == most else [most, fewest]
    for k in choices:
        gap = span - k  # what the inner roles take: need_i = low + gap
        # Work of a low chunk of a tokens and a high chunk of k - a ending at ``high``:
        # k (2 high - k + 1) / 2 - a x gap; the least a within the budget.
        work = k * (2 * high - k + 1) / 2 - density * k
        if work <= role.budget:
            a = 0 if gap else k
        elif gap:
            a = math.ceil((work - role.budget) / gap)
            if a > k:
                continue
        else:
            continue
        inner = _fill(low + a, high - (k - a), roles, i + 1, bound, density, left)
        if inner is not None:
            return [((low, low + a), (high - (k - a), high)), *inner]
    return None


def nested_zigzag(ranks: Ranks, doc: int, length: int, allowed: float, density: float) -> bool:
    """Place the doc by the least-D nested chunks over m = m0 .. m0 + WIDTHS - 1 ranks (the
    roomiest first, then those needing least); False (nothing placed) if no m has a
    solution."""
    n = len(ranks.work)
    cap = ranks.capacity
    needs = alltoallv_receives(ranks.shards)  # KV each rank needs so far
    order = sorted(range(n), key=lambda r: (ranks.tokens[r], needs[r], r))
    best: tuple[int, list[int], Chunks] | None = None
    step = max(1, length // STEPS)
    # m0: the fewest ranks (roomiest first) whose room covers the doc.
    first, covered = n, 0
    for i, r in enumerate(order):
        covered += cap - ranks.tokens[r]
        if covered >= length:
            first = i + 1
            break
    for m in range(max(2, first), min(n, max(2, first) + WIDTHS - 1) + 1):
        chosen = order[:m]
        roles = [Role(cap - ranks.tokens[r],
                      allowed - ranks.work[r] - (cap - ranks.tokens[r]) * density, needs[r])
                 for r in chosen]
        # The least bound this m meets, to within ``step`` tokens and ``step`` below the
        # best so far (binary search). The loosest bound is tried first: most m either
        # fail outright or cannot beat it. The floor is what the outermost role needs if it
        # holds the top and fills its room with the doc (a heuristic floor: a role with a
        # smaller need so far could hold the top instead).
        lo = max(0, needs[chosen[0]] + length - roles[0].room)
        hi = length + max(needs) if best is None else best[0] - step
        chunks = nested_chunks(length, roles, hi, density) if lo <= hi else None
        if chunks is None:
            continue
        found = (hi, chunks)
        hi -= step
        while lo <= hi:
            mid = (lo + hi) // 2
            chunks = nested_chunks(length, roles, mid, density)
            if chunks is None:
                lo = mid + 1
            else:
                found, hi = (mid, chunks), mid - step
        best = (found[0], chosen, found[1])
    if best is None:
        return False
    _, chosen, chunks = best
    for rank, ((a, b), (c, d)) in zip(chosen, chunks, strict=False):  # inner roles may be unused
        if b > a:
            ranks.add(rank, doc, a, b)
        if d > c:
            ranks.add(rank, doc, c, d)
    return True
