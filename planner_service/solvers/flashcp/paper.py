"""FlashCP's Algorithm 1 as published (arXiv:2606.08476, lines 4-24): strategy
``flashcp_paper``, and the fallback of ``flashcp`` when none of its passes meets R.

Try k = 0, 1, 2, ... of the longest docs under Per-Doc sharding over all N ranks, place
the rest by Whole-Doc sharding, stop at the first k whose imbalance is at most R:

- LPT: docs by length, descending, each whole onto the least-loaded (by workload) rank
  that still has room for it. Whole docs move no KV.
- The docs that fit nowhere whole are split adaptively over the free room: the fewest
  ranks whose room covers the doc, the lightest head on the most loaded of them and the
  heavy tail on the least loaded, so workload stays balanced.

If no k reaches R, the most balanced layout found is returned. k stops at ``MAX_PER_DOC``
and at the first doc of at most 2N tokens (Per-Doc cuts it into chunks of one token or
none: it cannot balance anything more).

Complexity: K = min(MAX_PER_DOC, docs longer than 2N) rounds, each O(N log N) for the
Per-Doc doc and O((D + N) log N) for the LPT and the splits (``whole_doc``,
``split_spill``): O(K (D + N) log N).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from planner_service.core.build import GroupLayout, Layout
from planner_service.core.cost import doc_workload, imbalance
from planner_service.core.plan import Shard
from planner_service.core.request import PlanRequest
from planner_service.solvers.balance import declared
from planner_service.solvers.flashcp.ranks import Ranks, Whole, new_shard, whole_shards
from planner_service.solvers.flashcp.runs import add_run

MAX_PER_DOC = 64
"""Upper bound on Per-Doc docs tried; imbalance left after that comes from integrality."""
WHOLE_RUN = 128
"""Equal docs in a row from which ``whole_doc`` places them in one block (``lpt_run``)."""


def whole_doc(ranks: Ranks, docs: Sequence[tuple[int, int]]) -> None:
    """Place (doc, length) pairs, longest first, by Whole-Doc sharding (module docstring).

    Each doc goes to the rank of least (workload, rank) among those with room for it, a
    choice that depends on the ranks' state alone. A min-heap of (workload, rank) over the
    ranks with room for the current doc; a rank without room is parked (a max-heap by
    room) until a doc short enough for it comes, at most once per doc it receives:
    O((D + N) log N). Runs of at least ``WHOLE_RUN`` equal docs go in one block
    (``lpt_run``), after which the heap is rebuilt from the state: O(N log(work) + K log K)
    per run of K docs."""
    spill: list[tuple[int, int]] = []
    lengths = np.fromiter((length for _, length in docs), dtype=np.int64, count=len(docs))
    starts = np.flatnonzero(np.concatenate(([True], lengths[1:] != lengths[:-1]))) if len(
        docs) else np.zeros(0, dtype=np.int64)
    sizes = np.diff(np.append(starts, len(docs)))
    at = 0
    for start, size in zip(starts[sizes >= WHOLE_RUN].tolist(), sizes[sizes >= WHOLE_RUN].tolist(),
                           strict=True):
        if start > at:
            lpt_docs(ranks, docs[at:start], spill)
        length = docs[start][1]
        placed = lpt_run(ranks, [doc for doc, _ in docs[start:start + size]], length)
        spill.extend(docs[start + placed:start + size])
        at = start + size
    if at < len(docs):
        lpt_docs(ranks, docs[at:], spill)
    split_spill(ranks, spill, tail_largest=False)


def lpt_docs(ranks: Ranks, docs: Sequence[tuple[int, int]], spill: list[tuple[int, int]]) -> None:
    """``whole_doc``'s heap over the given docs, from the ranks' state; the docs no rank
    has room for are appended to ``spill``. O((D + N) log N)."""
    cap = ranks.capacity
    shards, tokens, work, whole = ranks.shards, ranks.tokens, ranks.work, ranks.whole
    heap = [(w, r) for r, w in enumerate(work) if tokens[r] < cap]
    heapq.heapify(heap)
    parked: list[tuple[int, int]] = []  # (-room, rank)
    heappush, heappop, heapreplace = heapq.heappush, heapq.heappop, heapq.heapreplace
    # Every rank has at most one entry, so the entries are distinct and each heap pops the
    # least of its entries whatever their order in the list (heapreplace: pop, then push).
    for doc, length in docs:
        while parked and -parked[0][0] >= length:
            _, rank = heappop(parked)
            heappush(heap, (work[rank], rank))
        while heap and cap - tokens[heap[0][1]] < length:
            _, rank = heappop(heap)
            heappush(parked, (tokens[rank] - cap, rank))
        if heap:
            rank = heap[0][1]
            # ranks.add(rank, doc, 0, length) inlined.
            shards[rank].append(new_shard(Shard, (doc, 0, length)) if whole is None
                                else whole[doc])
            tokens[rank] += length
            work[rank] += length * (length + 1) // 2
            if tokens[rank] < cap:
                heapreplace(heap, (work[rank], rank))
            else:
                heappop(heap)
        else:
            spill.append((doc, length))


def lpt_run(ranks: Ranks, docs: Sequence[int], length: int) -> int:
    """Place the leading docs of a run of equal docs (``length`` tokens each, in order) as
    ``lpt_docs`` would, one by one: each to the rank of least (workload, rank) with room;
    the docs placed (the others fit no rank). Rank r can take f_r = (cap - tokens) // L
    more, its j-th at workload work + j w (w = L (L + 1) / 2, exact int64 figures), so the
    K docs go to the K least (work + j w, rank) over r and j < f_r, in that order: the
    least level v holding K of them is found by bisection (those below v, then the ranks
    at v by rank). O(N log(the workloads' spread) + K log K)."""
    doc_work = length * (length + 1) // 2
    work = np.array(ranks.work, dtype=np.int64)
    fits = np.maximum((ranks.capacity - np.array(ranks.tokens, dtype=np.int64)) // length, 0)
    take = min(len(docs), int(fits.sum()))
    if not take:
        return 0
    active = np.flatnonzero(fits)
    held, room = work[active], fits[active]

    def below(level: int) -> np.ndarray:  # per active rank, its docs at workload <= level
        return np.clip((level - held) // doc_work + 1, 0, room)

    low = int(held.min()) - 1  # no doc at or below it
    high = int((held + (room - 1) * doc_work).max())  # every doc at or below it
    while high - low > 1:
        mid = (low + high) // 2
        if int(below(mid).sum()) >= take:
            high = mid
        else:
            low = mid
    each = below(low)
    at_level = np.flatnonzero(below(high) > each)  # one doc each at workload ``high``
    each[at_level[:take - int(each.sum())]] += 1
    rank = np.repeat(active, each)
    nth = np.arange(len(rank)) - np.repeat(np.cumsum(each) - each, each)
    chosen = rank[np.lexsort((rank, work[rank] + nth * doc_work))]
    add_run(ranks, chosen, docs[:take], length)
    return take


def split_spill(ranks: Ranks, spill: Sequence[tuple[int, int]], *, tail_largest: bool) -> None:
    """Split each doc that fits no rank whole over the roomiest ranks (fewest pieces).

    Piece order: ``tail_largest`` puts the largest piece last (its rank receives only the
    pieces before it); otherwise the lightest head goes to the most loaded rank and the
    heavy tail to the least loaded (Algorithm 1's Whole-Doc sharding, for balance).
    The roomiest ranks come from a max-heap of (room, rank): O(N + k log N) per doc for
    its k pieces; a doc the roomiest rank holds whole goes there in one piece (both
    orders give that), O(log N).
    """
    if not spill:
        return
    cap = ranks.capacity
    shards, tokens, work, whole = ranks.shards, ranks.tokens, ranks.work, ranks.whole
    roomiest = [(t - cap, r) for r, t in enumerate(tokens) if t < cap]  # (-room, rank)
    heapq.heapify(roomiest)
    # Each rank has at most one entry, so the entries are distinct and the heap pops the
    # least of its entries whatever their order in the list (heapreplace: pop, then push).
    heapreplace, heappop = heapq.heapreplace, heapq.heappop
    for doc, length in spill:
        if roomiest and 0 < length <= -roomiest[0][0]:
            # The roomiest rank holds the doc: one piece, whole, in either piece order.
            rank = roomiest[0][1]
            shards[rank].append(new_shard(Shard, (doc, 0, length)) if whole is None
                                else whole[doc])
            tokens[rank] += length
            work[rank] += (length + 1) * length // 2
            if tokens[rank] < cap:
                heapreplace(roomiest, (tokens[rank] - cap, rank))
            else:
                heappop(roomiest)
            continue
        chosen = []
        covered = 0
        while roomiest and covered < length:
            minus_room, rank = heapq.heappop(roomiest)
            chosen.append(rank)
            covered -= minus_room
        room = {rank: cap - ranks.tokens[rank] for rank in chosen}
        if tail_largest:
            # The roomiest rank takes the tail, as much as it can hold; then the next.
            pieces = []
            left = length
            for rank in chosen:
                take = min(room[rank], left)
                pieces.append((rank, take))
                left -= take
            pieces.reverse()
        else:
            chosen.sort(key=lambda r: (-ranks.work[r], r))
            pieces = []
            left = length
            for i, rank in enumerate(chosen):
                take = left if i == len(chosen) - 1 else min(left, room[rank])
                pieces.append((rank, take))
                left -= take
        start = 0
        for rank, take in pieces:
            if take > 0:  # ranks.add inlined
                ranks.shards[rank].append(new_shard(Shard, (doc, start, start + take)))
                ranks.tokens[rank] += take
                ranks.work[rank] += (2 * start + take + 1) * take // 2
            start += take
        for rank in chosen:
            if ranks.tokens[rank] < cap:
                heapq.heappush(roomiest, (ranks.tokens[rank] - cap, rank))


def per_doc_zigzag(ranks: Ranks, doc: int, length: int) -> None:
    """Add one doc by Per-Doc sharding over all N ranks: ``common.zigzag_doc_shards`` (the
    L mod 2N extra tokens one per chunk to the ranks holding fewest tokens, low chunks
    first) with the shards added rank by rank. O(N log N)."""
    n = len(ranks.tokens)
    base, extra = divmod(length, 2 * n)
    low, high = [base] * n, [base] * n
    if extra:
        fewest = np.argsort(np.array(ranks.tokens), kind="stable").tolist()
        for rank in fewest[:min(extra, n)]:
            low[rank] += 1
        for rank in fewest[:max(0, extra - n)]:
            high[rank] += 1
    # Chunk order: the low chunks of ranks 0 .. N-1, then the high ones of ranks N-1 .. 0.
    low_start = [0] * n
    at = 0
    for rank in range(n):
        low_start[rank] = at
        at += low[rank]
    high_start = [0] * n
    for rank in range(n - 1, -1, -1):
        high_start[rank] = at
        at += high[rank]
    shards, tokens, work = ranks.shards, ranks.tokens, ranks.work
    for rank in range(n):
        held = shards[rank]
        for a, size in ((low_start[rank], low[rank]), (high_start[rank], high[rank])):
            if size:
                held.append(new_shard(Shard, (doc, a, a + size)))
                tokens[rank] += size
                work[rank] += (2 * a + size + 1) * size // 2


def _must_exceed(length: int, per_doc: Ranks, allowed: float) -> bool:
    """True if Whole-Doc placement provably exceeds the allowed max workload: the longest
    remaining doc fits whole on some rank (so LPT places it whole) and alone weighs more
    than allowed."""
    fits = per_doc.capacity - min(per_doc.tokens) >= length
    return fits and doc_workload(length) > allowed


def algorithm1(
    doc_lengths: Sequence[int], n: int, target: float, *, max_per_doc: int = MAX_PER_DOC,
    whole: Whole | None = None,
) -> tuple[float, Ranks, list[int]]:
    """Algorithm 1 (module docstring): (imbalance, layout, Per-Doc docs ascending);
    ``whole``: the docs' whole shards, if at hand (``ranks.whole_shards``)."""
    # Longest first, ties by index (a stable sort of the negated lengths; lengths < 2^31).
    order = np.argsort(-np.array(doc_lengths, dtype=np.int64), kind="stable").tolist()
    allowed = target * sum(map(doc_workload, doc_lengths)) / n
    # The Per-Doc part, one more doc per k.
    per_doc = Ranks(n, -(-sum(doc_lengths) // n),
                    whole_shards(doc_lengths) if whole is None else whole)
    best: tuple[float, Ranks, list[int]] | None = None
    for k in range(min(len(order), max_per_doc) + 1):
        if k:
            per_doc_zigzag(per_doc, order[k - 1], doc_lengths[order[k - 1]])
        last = k == len(order) or k == max_per_doc or doc_lengths[order[k]] <= 2 * n
        if not last and _must_exceed(doc_lengths[order[k]], per_doc, allowed):
            continue
        ranks = per_doc.copy()
        whole_doc(ranks, [(d, doc_lengths[d]) for d in order[k:]])
        imb = imbalance(ranks.work)
        if best is None or imb < best[0]:
            best = (imb, ranks, sorted(order[:k]))
        if imb <= target or last:
            break
    assert best is not None
    return best


def paper_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    """Strategy ``flashcp_paper``: Algorithm 1's layout at the request's R; the info
    declares a missed R (``balance.declared``)."""
    imb, ranks, per_doc = algorithm1(doc_lengths, request.cp_size, request.imbalance_target)
    return Layout(
        groups=[GroupLayout(tuple(range(request.cp_size)), ranks.shards)],
        info=declared({"per_doc_docs": per_doc, "imbalance_target": request.imbalance_target},
                      (imb,), request.imbalance_target),
    )
