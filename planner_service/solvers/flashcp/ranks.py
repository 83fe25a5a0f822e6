"""The layout under construction: per-rank shards, token counts and workloads.

Every operation here is O(1) per shard added (``Ranks.add``), O(N + shards) to copy, and
O(L / m + m) for an equal zigzag of one doc over m ranks; ``zigzagged`` and ``measure``
O(s).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, repeat
from operator import itemgetter

from planner_service.core.cost import rank_receive
from planner_service.core.plan import Shard

new_shard = tuple.__new__
"""``new_shard(Shard, (doc, start, end))``: a Shard without NamedTuple's Python-level
``__new__`` (hot paths)."""


Whole = Sequence[Shard]
"""Each doc's whole shard (doc, 0, its length), indexed by doc: shared by the layouts of one
solve (shards are immutable tuples), so placing a doc whole appends a reference instead of
building a tuple (``whole_shards``)."""


def whole_shards(doc_lengths: Sequence[int]) -> list[Shard]:
    """``Whole`` for every doc: (doc, 0, its length as ``doc_lengths`` holds it), the
    figures a shard made as the doc is placed would hold. O(D)."""
    return list(map(new_shard, repeat(Shard), zip(range(len(doc_lengths)), repeat(0),
                                                  doc_lengths)))


class Ranks:
    """Mutable per-rank state of a layout under construction (plain lists: per-doc numpy
    calls would cost more than they save); ``whole``: the docs' whole shards if at hand
    (``Whole``), which the placements that add whole docs append."""

    def __init__(self, n: int, capacity: int, whole: Whole | None = None) -> None:
        self.shards: list[list[Shard]] = [[] for _ in range(n)]
        self.tokens = [0] * n
        self.work = [0] * n
        self.capacity = capacity
        self.whole = whole

    def copy(self) -> Ranks:
        other = Ranks(0, self.capacity, self.whole)
        other.shards = [list(r) for r in self.shards]
        other.tokens = list(self.tokens)
        other.work = list(self.work)
        return other

    def add(self, rank: int, doc: int, start: int, end: int) -> None:
        self.shards[rank].append(new_shard(Shard, (doc, start, end)))
        self.tokens[rank] += end - start
        # cost.shard_workload inlined (hot path): (2p + s + 1) s / 2 = (p + e + 1)(e - p) / 2.
        self.work[rank] += (start + end + 1) * (end - start) // 2


def zigzag(ranks: Ranks, chosen: Sequence[int], doc: int, length: int) -> None:
    """Cut a doc into 2m chunks over the m ``chosen`` ranks, chunk i and 2m-1-i on the
    i-th (Per-Doc sharding over a subset): near-equal workloads, two shards per rank."""
    m = len(chosen)
    base, extra = divmod(length, 2 * m)
    # The remainder goes one token per rank (low chunks first, then high chunks), so no
    # rank holds more than ceil(L / m) tokens of the doc: the first min(extra, m) low
    # chunks and the last extra - m high chunks (chunk 2m - 1 - (k - m) for the k-th token).
    low_extra, high_extra = min(extra, m), max(0, extra - m)
    sizes = ([base + 1] * low_extra + [base] * (2 * m - low_extra - high_extra)
             + [base + 1] * high_extra)
    starts = list(accumulate(sizes, initial=0))
    top = 2 * m
    # Rank i holds chunks i and 2m - 1 - i: [a, b) and [c, d). ranks.add inlined (a doc
    # over many ranks adds 2m shards).
    columns = zip(chosen, starts[:m], starts[1 : m + 1], starts[top - 1 : m - 1 : -1],
                  starts[top:m:-1], strict=True)
    shards, tokens, work = ranks.shards, ranks.tokens, ranks.work
    for rank, a, b, c, d in columns:
        held = shards[rank]
        if b > a:
            held.append(new_shard(Shard, (doc, a, b)))
        if d > c:
            held.append(new_shard(Shard, (doc, c, d)))
        tokens[rank] += (b - a) + (d - c)
        work[rank] += (a + b + 1) * (b - a) // 2 + (c + d + 1) * (d - c) // 2


_doc_of = itemgetter(0)


def measure(ranks: Ranks) -> tuple[int, list[int]]:
    """(the most KV any rank receives in the exact all-to-all-v, ``zigzagged(ranks)``) in
    one pass over the shards (``cost.rank_receive`` per rank). O(s)."""
    receives, doubled = [], set()
    for shards in ranks.shards:
        receive, repeated = rank_receive(shards)
        receives.append(receive)
        doubled.update(repeated)
    return max(receives), sorted(doubled)


def zigzagged(ranks: Ranks) -> list[int]:
    """Docs held as two or more shards on one rank (zigzag), ascending. O(s): a rank's
    docs are scanned one by one only if some doc repeats on it."""
    out: set[int] = set()
    for shards in ranks.shards:
        if len(set(map(_doc_of, shards))) < len(shards):
            seen: set[int] = set()
            for doc, _, _ in shards:
                if doc in seen:
                    out.add(doc)
                else:
                    seen.add(doc)
    return sorted(out)


def zigzagged_reference(ranks: Ranks) -> list[int]:
    """``zigzagged`` shard by shard."""
    seen: dict[tuple[int, int], int] = {}
    for rank, shards in enumerate(ranks.shards):
        for s in shards:
            seen[s.doc, rank] = seen.get((s.doc, rank), 0) + 1
    return sorted({doc for (doc, _), count in seen.items() if count > 1})
