"""Repair a layout's layer-weighted balance by moving shard tails to light ranks.

flashcp balances causal work. Under a mask its plan can miss R on the layer-weighted
work (``sum_g count_g work_g``) by a few percent: the ranks holding the expensive tails
of long documents hold few tokens, so they do little work in the windowed layers. The
other candidates of ``flashcp_masked`` that meet R cut the packed sequence anew and
usually move more KV. Here the flashcp plan is kept and only the excess is moved, one
shard tail at a time:

- the heaviest rank h (ties: the lowest index) sheds ``x = load_h - goal``, goal = R
  times the mean weighted work, at most what the lightest rank can take;
- each of h's shards ``[s, e)`` is cut at the greatest m whose tail ``[m, e)`` carries at
  least x (the whole shard if it carries less; ``WeightedPrefix.doc_reach``);
- among the ``LIGHT_RANKS`` lightest ranks and h's shards, the pair whose tail fits the
  light rank's work and token room and adds it the least KV wins: the layer-weighted
  KV of the tail's prefix it does not hold, ``m`` minus its own tokens of the document
  below m (a window g's layers at most ``W_g - 1`` of it; ``added_receive``); ties by
  more work moved, then the lighter rank, then shard order.

It stops once h is within R, when no pair fits, or after ``MAX_MOVES`` moves; it does
not start when more than ``MAX_MOVES`` ranks are over the goal (each must shed) or the
layout has more than ``MAX_SHARDS`` shards. A move never raises the heaviest load (the
tail fits the light rank's room). The result is a candidate like any other:
``flashcp_masked`` prices it exactly under the mask and keeps it only if it is the best.

O(N + S + M (N log N + K s (log G + t))) for S <= MAX_SHARDS shards, M <= MAX_MOVES
moves, N ranks, K = LIGHT_RANKS, s shards on the heavy rank, G windows and t shards of
one document on a light rank; deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from planner_service.core.build import GroupLayout, Layout
from planner_service.core.mask import AttentionMask
from planner_service.core.plan import Shard
from planner_service.solvers.contiguous_halo import WeightedPrefix

MAX_MOVES = 32
"""Most tails moved per repair (the time bound; a repair that needs more is dropped by
the caller when it still misses R)."""
LIGHT_RANKS = 4
"""Lightest ranks tried as receivers of each move."""
MAX_SHARDS = 16384
"""Most shards of a layout repaired (each move reads every shard of the heavy rank)."""


def tail_cut(prefix: WeightedPrefix, shard: Shard, work: int) -> int:
    """The greatest m in ``[start, end]`` whose tail ``[m, end)`` carries at least
    ``work`` layer-weighted pairs; ``start`` when the whole shard carries less.
    O(log G)."""
    value = prefix.doc_prefix(shard.end) - work
    if value < 0:
        return shard.start
    return max(shard.start, prefix.doc_reach(value, shard.end))


def window_limits(mask: AttentionMask) -> list[tuple[int, int | None]]:
    """Per layer group, (layers, W - 1, or None for a causal group): ``added_receive``'s
    ``limits``."""
    return [(g.layers, None if g.window is None else g.window - 1) for g in mask.groups]


def added_receive(pieces: Sequence[Shard], cut: int, limits: Sequence[tuple[int, int | None]]
                  ) -> int:
    """The layer-weighted KV a tail starting at ``cut`` needs that a rank holding
    ``pieces`` (of the tail's document) does not hold: the prefix ``[0, cut)`` less the
    rank's own tokens below the cut, at most ``W - 1`` keys in a window's layers
    (``limits``: (layers, W - 1 or None) per layer group). Exact for a rank without the
    document, else at least what the move adds to the rank's receive (part of it may
    already come for another piece). O(t + G)."""
    need = cut
    for p in pieces:
        if p.start < cut:
            need -= min(p.end, cut) - p.start
    total = 0
    for layers, limit in limits:
        total += layers * (need if limit is None or need < limit else limit)
    return total


def repaired_layout(layout: Layout, loads: Sequence[int], prefix: WeightedPrefix,
                    mask: AttentionMask, target: float, max_tokens: int) -> Layout | None:
    """``layout`` (one group; ``loads`` its ranks' layer-weighted work, in group order)
    with tails moved until its layer-weighted imbalance is at most ``target`` (module
    docstring), no rank above ``max_tokens`` tokens; None when nothing moves, the layout
    has several groups or more than ``MAX_SHARDS`` shards."""
    if len(layout.groups) != 1:
        return None
    group = layout.groups[0]
    n = len(group.shards)
    goal = math.floor(target * sum(loads) / n) if n else 0
    if sum(1 for w in loads if w > goal) > MAX_MOVES:
        return None  # every rank over the goal sheds at least once
    ranks = [list(rank) for rank in group.shards]
    if sum(map(len, ranks)) > MAX_SHARDS:
        return None
    exact = list(loads)  # Python ints; ``mirror`` holds them for the selection
    mirror = np.array(exact, dtype=object if max(exact, default=0) >= 1 << 62 else np.int64)
    tokens = [sum(s.end - s.start for s in rank) for rank in ranks]
    by_doc: dict[int, dict[int, list[Shard]]] = {}  # a rank's shards by doc, when read

    def held(r: int) -> dict[int, list[Shard]]:
        if r not in by_doc:
            own: dict[int, list[Shard]] = {}
            for s in ranks[r]:
                own.setdefault(s.doc, []).append(s)
            by_doc[r] = own
        return by_doc[r]

    works: dict[Shard, int] = {}

    def work(s: Shard) -> int:
        w = works.get(s)
        if w is None:
            w = works[s] = prefix.doc_prefix(s.end) - prefix.doc_prefix(s.start)
        return w

    limits = window_limits(mask)
    moves = 0
    while moves < MAX_MOVES:
        h = int(np.argmax(mirror))
        lights = [r for r in np.argsort(mirror, kind="stable")[:LIGHT_RANKS].tolist() if r != h]
        if exact[h] <= goal or not lights:
            break
        shed = min(exact[h] - goal, goal - exact[lights[0]])
        if shed <= 0:
            break
        rows = [(order, r, goal - exact[r], max_tokens - tokens[r], held(r))
                for order, r in enumerate(lights)]
        best: tuple[tuple[int, int, int, int], int, int, int] | None = None
        for j, s in enumerate(ranks[h]):
            whole = work(s)
            if whole <= shed:
                cut, moved = s.start, whole
            else:
                cut = tail_cut(prefix, s, shed)
                if cut >= s.end:
                    continue
                moved = work(Shard(s.doc, cut, s.end))
            size = s.end - cut
            bare = added_receive((), cut, limits) if cut else 0  # a rank without the doc
            for order, r, room, token_room, docs in rows:
                if moved > room or size > token_room:
                    continue
                own = docs.get(s.doc) if cut else None  # a whole doc needs no KV
                key = (added_receive(own, cut, limits) if own else bare, -moved, order, j)
                if best is None or key < best[0]:
                    best = (key, j, cut, r)
        if best is None:
            break
        _, j, cut, r = best
        s = ranks[h][j]
        tail = Shard(s.doc, cut, s.end)
        moved = work(tail)
        kept = Shard(s.doc, s.start, cut)
        pieces = held(h)[s.doc]
        pieces.remove(s)
        if cut > s.start:
            ranks[h][j] = kept
            pieces.append(kept)
        else:
            del ranks[h][j]
        ranks[r].append(tail)
        held(r).setdefault(s.doc, []).append(tail)
        exact[h] -= moved
        exact[r] += moved
        mirror[h], mirror[r] = exact[h], exact[r]
        tokens[h] -= s.end - cut
        tokens[r] += s.end - cut
        moves += 1
    if not moves:
        return None
    return Layout([GroupLayout(tuple(group.ranks), ranks)],
                  {**layout.info, "weighted_moves": moves})
