"""flashcp's bulk pass for requests with many documents: the longest docs by the balanced
pass (``place.place``), the many short ones by a two-run fill computed from prefix sums.

Above ``BULK_DOCS`` docs and ``BULK_PER_RANK`` docs per rank, placing every doc through
the heap costs microseconds a doc (hundreds of milliseconds on 100,000 docs), yet most of
them are short. The bulk pass places the head (``bulk_head``: the ``HEAD_PER_RANK`` x N
longest docs, on many ranks extended to every doc too long for the fill) as the
balanced pass does, splits its spill for tokens, then fills the rooms with the rest
(``stream_intervals``): the short docs, longest first, are laid end to end; rank by rank
(those needing the densest fill first) each takes its room as a run from the front (dense)
and a run from the back (light), split so its workload comes nearest the mean at or below
it; the last rank takes the middle. ``cut`` turns the runs into shards: every rank ends
with exactly T tokens (the last ranks' shortfall aside), at most 2 short docs split per
rank. It is tried only where the short docs are at most 1 / ``BULK_ROOM`` of a rank's
tokens. On many ranks the head is laid out for the fill (``bulk_layout``): whole docs
only where the rank's room left still fits within R, fill-aware zigzag widths, its
spill zigzagged, the fill serving the ranks from both ends of the need order.
If R is missed, ``refine.exchange`` rebalances as ``place.finish`` does; where it still
is, the caller tries the layout with the fill counted at the short docs' own density
(``bulk_layout``'s ``at_density``), then falls back to the full passes.

Complexity, D docs on N ranks: the head O((H + N) log N) for its H <= ``HEAD_CAP`` N docs,
plus ``place``'s cost for docs that must be split and, on many ranks, O(N log N) per
spilled doc; the fill O(D) prefix sums, O(N log D log T) bisections, O(D log D) numpy
to cut and O(D + N) Python to append the shards; then at most max(8, N / 8) exchange
moves (``exchange_moves``). At most three such layouts per request (``bulk_tries``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import repeat
from typing import NamedTuple

import numpy as np

from planner_service.core.cost import imbalance
from planner_service.core.plan import Shard
from planner_service.solvers.flashcp.paper import split_spill
from planner_service.solvers.flashcp.place import mirrored, place, zigzag_ranks
from planner_service.solvers.flashcp.ranks import Ranks, new_shard, zigzag
from planner_service.solvers.flashcp.refine import exchange

BULK_DOCS = 4096
"""Docs above which the bulk pass is tried (the quality benchmark's sequences hold tens to
hundreds; ``solve.PAPER_RETRY_DOCS`` draws the same line for the published algorithm)."""
BULK_PER_RANK = 16
"""Docs per rank from which the bulk pass is tried: fewer, and each rank's fill is too few
docs to be a fair sample of the tail."""
HEAD_PER_RANK = 4
"""Longest docs per rank placed by the balanced pass before the fill, at least."""
HEAD_CAP = 16
"""Docs per rank the head may hold at most (``bulk_head``)."""
HEAD_FILL_SHARE = 0.25
"""Share of the short docs' mean density the head's zigzag widths count for a
rank's later fill (``place``'s ``fill_share``): the fill brings each rank to the mean
from both ends of the stream, so a rank's room may take much lighter tokens than the
mean; counting the mean density (a share of 1) makes the zigzags wider than balance
needs, and every rank a zigzag adds receives KV (on 100,000 mixed docs at N = 1,024: up
to 4x the most KV any rank receives at a share of 1; 0.2 to 0.33 alike; at 0.1 some
layouts miss R)."""
EXTEND_RANKS = 64
"""Ranks from which the head is extended to every doc too long for the fill
(``bulk_head``) and the bulk layout made for the fill (``bulk_layout``). On fewer ranks
the plans stay those of the 4N head where it meets R, and the layout made for the fill
is tried only where the 4N head's plain layout misses R. From 64 ranks the full passes
take over 200 ms on many mixed-length inputs (2M tokens, 30,000 or 100,000 docs of the
shared data sets and families at N = 64, 128 and 192: up to 290 ms, placing runs of
equal docs one at a time), the bulk layouts 20-90 ms; on a grid of 495 such inputs (N =
8 .. 1,024, 1,000 to 100,000 docs) moving the line from 256 to 64 ranks changed 106
plans, all within R as before (and one that missed it now meets it), with the most KV a
rank receives lower on 52 and higher on 53 (0.16x to 1.8x, and 0 to 293 tokens on one;
geometric mean 0.84x)."""
BULK_ROOM = 48
"""A rank's T tokens over the longest short doc, at least: each rank's fill is two runs
of the short docs, cut at doc granularity, so its density misses by about two short docs
(2 / BULK_ROOM of its tokens, within R = 1.05's slack); with longer short docs the head's
imbalance cannot be corrected by the fill (100,000 mixed docs at N = 1,024)."""


DENSE_FILL_PER_RANK = 2
"""Short docs per rank, at least, past the 4N longest for the layout with the fill counted
at its own density (``bulk_tries``): with fewer, the fill cannot bring every rank to the
mean (mixed docs of 2M tokens at N = 1,024: 4,200 docs miss R on 8 of 10 sources, 6,000
docs meet it on all ten)."""
EXCHANGE_MOVES = 8
"""Moves of ``refine.exchange`` on a bulk layout over R (its default)."""
FEW_OVER = 16
"""Ranks per rank over R at least for more exchange moves (``exchange_moves``)."""
OVER_MOVES = 2
"""Exchange moves per rank over R where few are (``exchange_moves``)."""
FEW_LENGTHS = 4
"""Distinct short-doc lengths below which the bulk pass is not tried: the balanced pass
places each run of equal docs in blocks (``runs.py``), faster than the fill for a few runs
(100,000 docs of 2M tokens: lengths 20 and 21)."""


def bulk_head(lengths_by_length: np.ndarray, n: int) -> int:
    """Docs the bulk pass places by the balanced pass (its head), or 0 if it is not tried.

    The head is the ``HEAD_PER_RANK`` x N longest docs (``lengths_by_length``: the
    lengths longest first); on at least ``EXTEND_RANKS`` ranks it is extended to every doc
    longer than 1 / ``BULK_ROOM`` of a rank's T tokens, so the fill only sees docs short
    enough for its density argument, up to ``HEAD_CAP`` x N docs, which bounds the head's
    cost: O(HEAD_CAP N log N) in the balanced pass's heap, plus its cost for docs that must
    be split. Not tried on few docs, few per rank, fewer than ``BULK_PER_RANK`` -
    ``HEAD_PER_RANK`` short docs per rank, or short docs of fewer than ``FEW_LENGTHS``
    lengths. Where the 4N longest leave short docs only, the head is 4N on any N. O(D)."""
    d = len(lengths_by_length)
    if n < 2 or d <= BULK_DOCS or d < BULK_PER_RANK * n or d <= HEAD_PER_RANK * n:
        return 0
    cap = -(-int(lengths_by_length.sum()) // n)
    # Docs longer than cap / BULK_ROOM (BULK_ROOM x length > cap), a prefix of the order.
    long_docs = int(np.count_nonzero(BULK_ROOM * lengths_by_length > cap))
    head = max(HEAD_PER_RANK * n, long_docs)
    if head > HEAD_PER_RANK * n and n < EXTEND_RANKS:
        return 0
    if head > HEAD_CAP * n or d - head < (BULK_PER_RANK - HEAD_PER_RANK) * n:
        return 0
    short = lengths_by_length[head:]
    if np.count_nonzero(short[1:] != short[:-1]) < FEW_LENGTHS:
        return 0  # a few runs of equal short docs: the balanced pass places them in blocks
    return head


class BulkTry(NamedTuple):
    """One bulk layout to try (``bulk_layout``'s arguments)."""

    head: int
    """Docs placed by the balanced pass (the longest)."""
    for_fill: bool
    """The head laid out for the fill."""
    at_density: bool
    """The fill counted at its own density."""


def bulk_tries(lengths_by_length: np.ndarray, n: int) -> list[BulkTry]:
    """The bulk layouts flashcp tries before its full passes, in order, until one meets R
    (``lengths_by_length``: the lengths longest first). Where the bulk pass applies
    (``bulk_head``): on at least ``EXTEND_RANKS`` ranks the layout made for the fill, on
    fewer the plain one, then the one made for the fill. Then, there and on any request
    of at least ``EXTEND_RANKS`` ranks, over ``BULK_DOCS`` docs, at least
    ``DENSE_FILL_PER_RANK`` short docs per rank past the ``HEAD_PER_RANK`` x N longest and
    ``FEW_LENGTHS`` short lengths: the one with the 4N head and the fill counted at its
    own density (``bulk_layout``'s ``at_density``), which meets R where the others leave
    the fill ranks it cannot serve, and on many ranks with fewer than ``BULK_PER_RANK``
    docs a rank, where the full passes take 200-280 ms on 6,000-14,000 mixed docs at N =
    1,024 and mostly miss R (it meets R there on every mixed source in 50-110 ms). O(D)."""
    head = bulk_head(lengths_by_length, n)
    tries = ([BulkTry(head, True, False)] if n >= EXTEND_RANKS else
             [BulkTry(head, False, False), BulkTry(head, True, False)]) if head else []
    d, base = len(lengths_by_length), HEAD_PER_RANK * n
    if ((head or n >= EXTEND_RANKS) and n >= 2 and d > BULK_DOCS
            and d - base >= DENSE_FILL_PER_RANK * n):
        short = lengths_by_length[base:]
        if np.count_nonzero(short[1:] != short[:-1]) >= FEW_LENGTHS:
            tries.append(BulkTry(base, True, True))
    return tries


def stream_intervals(ranks: Ranks, stream: Sequence[int] | np.ndarray, goal: float,
                     both_ends: bool = False) -> list[tuple[int, int, int]]:
    """(start, end, rank) token intervals of the ``stream`` (the short docs' lengths,
    longest first, laid end to end) that fill every rank's room: each rank but the last
    takes its room as a run from the front (dense) and a run from the back (light) whose
    split brings its workload nearest ``goal`` at or below it; the last rank takes the
    middle. A token at doc offset t weighs t + 1, so prefix sums of the stream give any
    run's exact workload. Ranks go by need (workload per token of room to reach ``goal``),
    densest first; with ``both_ends``, alternately the densest and the lightest need left,
    so the ranks that need the lightest fill reach the back before the ranks that need a
    dense one have taken it (``need_order``). O(D) numpy for the prefix sums (int64: the
    short docs' workload is far below 2^63), O(N log D log T) Python for the bisections
    per rank."""
    lengths = np.asarray(stream, dtype=np.int64)
    tokens_at = [0, *np.cumsum(lengths).tolist()]
    work_at = [0, *np.cumsum(lengths * (lengths + 1) // 2).tolist()]

    def prefix(pos: int) -> int:  # workload of the stream's first pos tokens
        i = bisect_right(tokens_at, pos) - 1
        o = pos - tokens_at[i]
        return work_at[i] + o * (o + 1) // 2

    n, cap = len(ranks.tokens), ranks.capacity
    front, back = 0, tokens_at[-1]
    out = []
    for i, r in enumerate(need_order(ranks, goal, both_ends)):
        room = min(max(0, cap - ranks.tokens[r]), back - front)
        if i == n - 1 or room == back - front:
            if back > front:
                out.append((front, back, r))
            front = back
            continue
        budget = goal - ranks.work[r]
        front_w, back_w = prefix(front), prefix(back)
        lo, hi = 0, room  # the most front tokens x whose run pair stays within budget
        while lo < hi:
            x = (lo + hi + 1) // 2
            if prefix(front + x) - front_w + back_w - prefix(back - room + x) <= budget:
                lo = x
            else:
                hi = x - 1
        if lo:
            out.append((front, front + lo, r))
        if room > lo:
            out.append((back - room + lo, back, r))
        front, back = front + lo, back - room + lo
    return out


def need_order(ranks: Ranks, goal: float, both_ends: bool) -> list[int]:
    """The ranks in the order the fill serves them (``stream_intervals``): by need (the
    workload per token of room that brings a rank to ``goal``), greatest first, ties by
    rank; with ``both_ends``, the first, the last, the second, the second last, ... of
    that order, so the median needs come last, when the stream's middle is left.
    O(N log N)."""
    n, cap = len(ranks.tokens), ranks.capacity
    need = [(goal - ranks.work[r]) / max(1, cap - ranks.tokens[r]) for r in range(n)]
    by_need = sorted(range(n), key=lambda r: (-need[r], r))
    if not both_ends:
        return by_need
    out = [0] * n
    out[0::2] = by_need[:(n + 1) // 2]
    out[1::2] = by_need[::-1][:n // 2]
    return out


def cut(ranks: Ranks, docs: np.ndarray, lengths: np.ndarray,
        intervals: Sequence[tuple[int, int, int]]) -> None:
    """Add to each interval's rank the shards of its stream tokens (``docs`` laid end to
    end, ``lengths`` theirs; the intervals disjoint, covering the stream). O(D + N) numpy,
    O(pieces) Python to append the shards."""
    n = len(ranks.tokens)
    ends = np.cumsum(lengths, dtype=np.int64)
    total = int(ends[-1]) if len(ends) else 0
    if not intervals or total == 0:
        return
    spans = np.array(sorted(intervals), dtype=np.int64)
    spans = spans[spans[:, 0] < total]  # empty runs at the stream's end
    starts = ends - lengths
    points = sorted_union(starts[lengths > 0], spans[:, 0])
    stops = np.append(points[1:], total)
    piece_doc = np.searchsorted(ends, points, side="right")
    piece_rank = spans[np.searchsorted(spans[:, 0], points, side="right") - 1, 2]
    offset = points - starts[piece_doc]
    size = stops - points
    by_rank = np.argsort(piece_rank, kind="stable")
    piece_rank, offset, size, piece_doc = (piece_rank[by_rank], offset[by_rank],
                                           size[by_rank], piece_doc[by_rank])
    added_work = np.zeros(n, dtype=np.int64)
    np.add.at(added_work, piece_rank, (2 * offset + size + 1) * size // 2)
    added_tokens = np.zeros(n, dtype=np.int64)
    np.add.at(added_tokens, piece_rank, size)
    triples = list(map(new_shard, repeat(Shard), zip(docs[piece_doc].tolist(), offset.tolist(),
                                                    (offset + size).tolist(), strict=True)))
    edges = np.searchsorted(piece_rank, np.arange(n + 1), side="left").tolist()
    shards, tokens, work = ranks.shards, ranks.tokens, ranks.work
    for r, (w, t) in enumerate(zip(added_work.tolist(), added_tokens.tolist(), strict=True)):
        if edges[r + 1] > edges[r]:
            shards[r].extend(triples[edges[r]:edges[r + 1]])
            tokens[r] += t
            work[r] += w


def sorted_union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.union1d(a, b)`` (the sorted distinct values of both) by one stable sort, which
    merges the two sorted runs ``cut`` passes in linear time, then a mask of repeats:
    O(n) on sorted inputs, O(n log n) on any (``np.unique``'s sort takes longer on 100,000
    values)."""
    both = np.concatenate((a, b))
    if not len(both):
        return both
    both.sort(kind="stable")
    return both[np.concatenate(([True], both[1:] != both[:-1]))]


def cut_reference(ranks: Ranks, docs: Sequence[int], lengths: Sequence[int],
                  intervals: Sequence[tuple[int, int, int]]) -> None:
    """``cut`` doc by doc and interval by interval, in plain Python."""
    position = 0
    for doc, length in zip(docs, lengths, strict=True):
        for a, b, r in sorted(intervals):
            lo, hi = max(a, position), min(b, position + length)
            if lo < hi:
                ranks.add(r, doc, lo - position, hi - position)
        position += length


def bulk_layout(doc_lengths: Sequence[int], order: list[int], lengths: np.ndarray, n: int,
                allowed: float, total_work: int, head: int, for_fill: bool,
                at_density: bool = False) -> Ranks:
    """The bulk pass's layout (module docstring): ``order`` is longest first, ``lengths``
    the lengths as int64, ``head`` the docs placed by the balanced pass (``bulk_tries``);
    the caller checks R.

    With ``for_fill`` (on at least ``EXTEND_RANKS`` ranks, where the head may be
    extended: long docs among many short ones leave the ranks' needs far apart; on fewer
    where the plain layout misses R) the layout is made for the fill: the balanced pass
    takes a doc whole only if the rank's room left, at 1 a token (the least a token
    weighs), stays within R (``place``'s ``fill_reserve``), and zigzags with part of the
    fill counted (fill-aware widths, at ``HEAD_FILL_SHARE`` of the density of the docs
    left); its spill (docs no rank takes whole) is zigzagged too (``zigzag_spill``)
    rather than split for tokens onto the roomiest ranks, which the fill could not bring
    back within R; and the fill serves the ranks from both ends of the need order.
    Without it the head is placed without the fill counted, its spill split for tokens,
    the fill by need order.

    With ``at_density`` (tried last, with the 4N head) the layout is made for the fill,
    the fill counted at the short docs' own density (``stream_density``), not at 1 a
    token: a doc goes whole only where the rank's room, filled at that density, keeps it
    within the mean, and zigzag widths count the whole of that density. The fill must
    bring every rank to the mean from the short docs, whose densities lie in a narrow
    band; a head that leaves some ranks needing a much lighter fill (docs near a rank's
    mean taken whole, their room to be filled almost for free) leaves the others needing
    a denser one than the docs hold (WLB-LLM lengths, 100,000 docs, 2M tokens at N = 512:
    needs from 0 to 22 a token against short docs of 2 to 21; the layout made for the
    fill reaches 1.126, this one 1.014 and 1,080 tokens of KV a rank at most)."""
    head = min(len(order), head)
    tail = np.array(order[head:], dtype=np.int64)
    stream = lengths[tail]
    share, reserve, whole_limit = HEAD_FILL_SHARE, 1.0 if for_fill else 0.0, None
    if at_density:
        # Every rank's room counted at the fill's own density: a doc goes whole only where
        # the rank, its room then filled at that density, stays within the mean.
        for_fill, share, whole_limit = True, 1.0, total_work / n
        reserve = stream_density(stream)
    ranks, spill = place(doc_lengths, order[:head], n, allowed, for_fill, total_work,
                         lengths=lengths, fill_share=share, fill_reserve=reserve,
                         whole_limit=whole_limit)
    if for_fill:
        spill = zigzag_spill(ranks, spill, allowed, stream, share)
    split_spill(ranks, spill, tail_largest=False)
    cut(ranks, tail, stream, stream_intervals(ranks, stream, total_work / n, for_fill))
    if imbalance(ranks.work) > allowed * n / sum(ranks.work):
        exchange(ranks, allowed, exchange_moves(ranks.work, allowed))
    return ranks


def exchange_moves(work: Sequence[int], allowed: float) -> int:
    """Moves ``refine.exchange`` may make on a bulk layout over ``allowed``: each brings
    the busiest rank down, so with few ranks over (at most 1 / ``FEW_OVER`` of them) up
    to ``OVER_MOVES`` per rank over, which is cheaper than the next layout (WLB-LLM
    lengths, 100,000 docs, 2M tokens at N = 768: 45 ranks over, R met in about 45 moves,
    25 ms); with many over the fill missed at its root, and the default 8. O(N)."""
    over = sum(1 for w in work if w > allowed)
    return max(EXCHANGE_MOVES, OVER_MOVES * over) if over * FEW_OVER <= len(work) else (
        EXCHANGE_MOVES)


def stream_density(stream: np.ndarray) -> float:
    """The mean workload per token of the short docs' ``stream`` (0 if empty). O(D)."""
    tokens = int(stream.sum())
    return float((stream * (stream + 1) // 2).sum()) / tokens if tokens else 0.0


def zigzag_spill(ranks: Ranks, spill: Sequence[tuple[int, int]], allowed: float,
                 stream: np.ndarray, share: float = HEAD_FILL_SHARE) -> list[tuple[int, int]]:
    """Zigzag each spilled (doc, length) of at least 2 tokens over the fewest most lagging
    ranks with room whose expected workloads, their rooms then filled at ``share`` of
    the ``stream``'s density, stay within ``allowed``
    (``place.zigzag_ranks``); the docs left (1-token docs, or no ranks with room for
    equal shares) are returned, for ``split_spill``. O(N log N) per doc."""
    density = stream_density(stream)
    left = []
    mirror = None  # the ranks' figures as float64 arrays (``place.mirrored``)
    for doc, length in spill:
        if length < 2:
            left.append((doc, length))
            continue
        if mirror is None:
            mirror = mirrored(None, ranks.work, ranks.tokens, [])
        chosen = zigzag_ranks(*mirror, ranks.capacity, length, length * (length + 1) // 2,
                               allowed, share * density, density)
        if chosen is None:
            left.append((doc, length))
        else:
            zigzag(ranks, chosen, doc, length)
            mirror = mirrored(mirror, ranks.work, ranks.tokens, chosen)
    return left
