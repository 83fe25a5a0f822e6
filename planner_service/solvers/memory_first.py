"""A layout for the least KV per rank, balance aside: the last candidate of the bounded
strategies (``kv_bound``) when their balanced layouts hold too much KV.

A rank's KV peak in the gather modes is the sum, over the docs it holds, of the end of
its last shard of the doc; so a doc held whole costs its length, and a piece [a, b)
costs b: its own b - a tokens plus the a tokens before it. Every rank holds at most
T = ceil(S / N) tokens, as in every other strategy (minimal padding).

1. A doc longer than T keeps its head of L mod T tokens (or none) as an item, and its
   other k = floor(L / T) x T tokens go to k empty ranks in zigzag pairs (the i-th rank
   holds the i-th low and the i-th high chunk, T tokens): rank i's peak is L - i x
   ceil(T / 2), at most L, which any rank holding the doc's last token needs anyway, and
   the pairs balance the work of the doc's ranks. There are at most S / T <= N such ranks.
2. The items (whole docs up to T tokens, and the heads) go longest first, whole, to the
   rank with the least room that fits them (best fit, so large rooms stay open).
3. An item that fits no room is cut over the rooms left: its tail goes into the largest
   room, so the largest start of its pieces, l - room, is the least possible; its head
   fills the smallest rooms (leaving the larger ones to the next items' tails).

Where step 3 has nothing to cut, the peak is max(longest doc, T): the smallest any plan
can have (``kv_bound.kv_floor``).

Complexity, D docs on N ranks: O(D log D) to sort, then per item a binary search and a
list insertion among the at most N rooms (O(log N) compares, an O(N) pointer move), and
per piece of step 3 the same: O(D log D + (D + N) N) in all, the N factor a memmove.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from planner_service.core.plan import Shard


def memory_first_shards(doc_lengths: Sequence[int], num_ranks: int) -> list[list[Shard]]:
    """Per-rank shards of the layout (module docstring)."""
    n = num_ranks
    cap = -(-sum(doc_lengths) // n)
    shards: list[list[Shard]] = [[] for _ in range(n)]
    order = sorted(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
    items: list[tuple[int, int]] = []  # (length, doc): whole docs and heads, from position 0
    empty = 0  # the next rank no doc has touched
    low, high = cap // 2, cap - cap // 2  # a zigzag pair: low chunk + high chunk = T tokens
    for doc in order:
        length = doc_lengths[doc]
        k = length // cap if length > cap else 0
        head = length - k * cap
        for i in range(k):
            rank = empty + i
            if low:
                shards[rank].append(Shard(doc, head + i * low, head + (i + 1) * low))
            shards[rank].append(Shard(doc, length - (i + 1) * high, length - i * high))
        empty += k
        if head:
            items.append((head, doc))
    items.sort(key=lambda item: (-item[0], item[1]))
    rooms = [(cap, r) for r in range(empty, n)]  # (room, rank), ascending

    def take(room: int, rank: int, doc: int, start: int, stop: int) -> None:
        shards[rank].append(Shard(doc, start, stop))
        if room > stop - start:
            bisect.insort(rooms, (room - (stop - start), rank))

    spill = []
    for length, doc in items:
        at = bisect.bisect_left(rooms, (length, -1))
        if at == len(rooms):
            spill.append((length, doc))
            continue
        room, rank = rooms.pop(at)
        take(room, rank, doc, 0, length)
    for length, doc in spill:
        # The rooms hold N T - (tokens placed) >= the tokens left, so they never run out.
        room, rank = rooms.pop()
        tail = min(room, length)
        take(room, rank, doc, length - tail, length)
        start = 0
        while start < length - tail:
            room, rank = rooms.pop(0)
            stop = min(length - tail, start + room)
            take(room, rank, doc, start, stop)
            start = stop
    return shards
