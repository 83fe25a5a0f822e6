"""FlashCP heuristic sharding (FlashCP, arXiv:2606.08476), with comm-aware balanced passes
and token-neutral refinement that bring it close to the exact ILP's comm saving, and an
objective that follows the request's exchange. Entry points: ``flashcp_shards`` and the
strategy's ``flashcp_layout``.

Every rank ends with at most T = ceil(S / N) tokens (exactly T but for the last ranks'
shortfall, which is explicit padding) and workload at most R x mean where it can.

1. Balanced passes (``place.place`` then ``place.finish``), each placing the docs in a
   given order (``place.py``): whole docs to the most lagging rank; docs no rank can take
   within R zigzagged over the fewest lagging ranks (or cut into nested pairs,
   ``nested.py``); docs that fit no rank's room split over the free room at the end; if
   R is missed, ``refine.exchange`` rebalances without changing any token count.

   The passes (``passes``): docs longest first, finished with the spill for balance and,
   on small requests, also with the spill for less KV; and, when some docs must be split
   and others are heavy but fit whole, the heavy docs first, so the must-split docs are
   cut into the room left rather than splitting a heavy doc too; and, on small requests
   with a doc that must be split, the nested pass (fill-aware, spill for less KV).

2. The layout that meets R with the least critical-path volume of the request's exchange
   wins (``objective``):

   - ``alltoallv``: the most KV any rank receives. ``refine.descend`` first trades
     positions of shared docs to lower it, within R (on requests with many docs, within
     part of R's slack: ``DESCENT_SLACK``), on the ``DESCENDED`` layout that receives
     least before it.
   - ``compact_allgather``: the largest buffer any rank contributes (every rank receives
     N - 1 of them, padded). Algorithm 1's layout (``paper.algorithm1``) is a candidate
     too, so flashcp never sends more than the published algorithm at the same R, and so
     is the descended layout.
   - ``full`` and ``p2p_ring``: every layout moves (N - 1) x T tokens; the most balanced
     layout wins (ties: the all-to-all-v receive).

0. Requests of many short docs try the bulk layouts first, in the order of
   ``bulk.bulk_tries``: where the bulk pass applies (``bulk.bulk_head``: over
   ``bulk.BULK_DOCS`` docs, the docs past the 4N longest each at most 1 /
   ``bulk.BULK_ROOM`` of a rank's tokens; on at least ``bulk.EXTEND_RANKS`` ranks, past
   every doc longer than that, up to ``bulk.HEAD_CAP`` x N docs; ``bulk.py``: that head
   by the balanced pass, the rest by a vectorised two-run fill) the layout made for the
   fill on many ranks, the plain one then that on fewer; then, there and on many ranks
   with few docs a rank, the one counting the fill at the short docs' own density. If
   one meets R it is the only layout found (step 2 still chooses, e.g. against
   Algorithm 1 under compact all-gather), else the steps below run and the most balanced
   bulk layout counts as a fallback.

3. If no pass meets R, Algorithm 1 (``paper.py``) within ``PAPER_WORK``; if that misses R
   too, Algorithm 1 again with more Per-Doc docs (up to ``paper.MAX_PER_DOC``, within
   ``PAPER_RETRY_WORK``, on at most ``PAPER_RETRY_DOCS`` docs and ``PAPER_RETRY_RANKS``
   ranks: on packed sequences of a few hundred short docs at N = 64, the published
   algorithm needs 40-60 Per-Doc docs to reach R). The most balanced layout
   found (pass or Algorithm 1) is returned; if it misses R, the strategy's info says so
   (``balance.declared``: ``imbalance_target_met`` false and ``imbalance_reached``).

Complexity, D docs on N ranks: the bulk pass O(log N) per head doc (at most
``bulk.HEAD_CAP`` N of them) and O(N log N) per head doc that must be split, plus
O(D log D) numpy and O(D + N log D log T) Python for the fill (``bulk.py``); each pass
O((D + N) log N) plus O(N log N) per doc that must be split (``place.py``); the extra
passes, the descent and the nested pass run only on requests of at most
``SEARCH_BUDGET``, ``SPILL_BUDGET`` and ``NESTED_BUDGET`` docs x ranks; measuring a layout is O(s) for its s shards; Algorithm 1 runs K + 1 rounds with
K (D + N K) within ``PAPER_WORK`` (``paper_rounds``; at least one round), each
O((D + N) log N + N K), and where it misses R once more within ``PAPER_RETRY_WORK``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from planner_service.core.build import GroupLayout, Layout
from planner_service.core.cost import alltoallv_receives, comm_volumes, doc_workload, imbalance
from planner_service.core.paths import COMM_MODES
from planner_service.core.plan import Shard
from planner_service.core.request import PlanRequest
from planner_service.solvers.balance import declared
from planner_service.solvers.flashcp.bulk import bulk_layout, bulk_tries
from planner_service.solvers.flashcp.paper import MAX_PER_DOC, algorithm1
from planner_service.solvers.flashcp.place import finish, place
from planner_service.solvers.flashcp.ranks import Ranks, measure, whole_shards, zigzagged
from planner_service.solvers.flashcp.refine import descend
from planner_service.solvers.gc_pause import paused_gc


class Pass(NamedTuple):
    """One run of the balanced pass's placement loop and the layouts finished from it."""

    order: list[int]
    """Docs in the order they are placed."""
    fill_aware: bool
    """Zigzag width counts the ranks' later fill (wider, more balanced)."""
    spills: tuple[bool, ...]
    """One finished layout per entry: spill splits put the largest piece last (True: less
    KV) or balance workload (False)."""
    descend: bool = True
    """Run ``refine.descend`` on the finished layouts (else only measure them)."""
    nested: bool = False
    """Cut the docs no rank can hold whole by ``nested.nested_zigzag`` (equal zigzag if
    it finds no cut)."""


DESCENT_STEPS = 8
"""``refine.descend`` moves per candidate layout."""
DESCENDED = 1
"""Layouts descended per request: the one receiving least before descent."""
SEARCH_BUDGET = 256
"""Docs x ranks up to which the heavy-first pass and ``refine.descend`` run (their cost
grows with both; larger requests, with many short docs, gain least from them)."""
DESCENT_SLACK = 0.6
"""Share of R's slack (R x mean - mean) the descent may fill on requests above
``FULL_SLACK_BUDGET`` docs x ranks: there, many docs give it many small trades of balance
for KV."""
FULL_SLACK_BUDGET = 64
"""Docs x ranks up to which the descent may fill all of R's slack (few docs: the KV is in
the docs that must be split, and the slack buys most there)."""
SPILL_BUDGET = 48
"""Docs x ranks up to which the longest-first layout is also finished with the spill for
less KV."""
NESTED_BUDGET = 64
"""Docs x ranks up to which the nested pass runs when some doc must be split."""
HEAVY = 0.25
"""A doc that fits a rank whole and weighs more than HEAVY x the allowed max workload is
placed before the docs that must be split in the heavy-first order."""
PAPER_WORK = 1 << 15
"""Work Algorithm 1 may spend inside flashcp: round k places D docs and copies the 2N k
shards of its k Per-Doc docs, so K rounds cost about K (D + N K); K is the largest within
PAPER_WORK (at least one round)."""

PAPER_RETRY_WORK = 1 << 19
"""Work the second run of Algorithm 1 may spend (step 3 of the module docstring), when
neither the passes nor the first run within ``PAPER_WORK`` meet R."""
PAPER_RETRY_DOCS = 4096
"""Docs up to which that second run is tried (above, each of its rounds places every doc
again: hundreds of milliseconds on 100,000 docs)."""
PAPER_RETRY_RANKS = 128
"""Ranks up to which that second run is tried (above, each round copies and cuts over
every rank: a quarter second for 20 rounds at N = 1,024)."""

def passes(doc_lengths: Sequence[int], order: list[int], n: int, allowed: float) -> tuple[list[Pass], list[Pass]]:
    """(the balanced passes always run, those run only if no layout of the first meets R).

    The longest-first order's layout is finished both ways (spill for balance, spill for
    less KV) on small requests (docs x ranks within ``SPILL_BUDGET``), where the second
    gains most; large ones finish it for balance only. The heavy-first pass runs within
    ``SEARCH_BUDGET``; the nested pass (longest first, must-split docs by
    ``nested.nested_zigzag``) within ``NESTED_BUDGET`` when some doc must be split.

    The heavy-first order places the heavy docs that fit a rank whole before the docs no
    rank can hold (longer than the rank's T tokens or heavier than ``allowed``), so those
    are cut into the room the heavy docs leave instead of taking the room a heavy doc needs
    whole. It exists only when both kinds of doc do. Both kinds are runs of the
    longest-first ``order`` (the must-split docs first, then the heavy ones), so the
    heavy-first order swaps the two runs. O(D).
    """
    cap = -(-sum(doc_lengths) // n)
    first = [Pass(order, False, (False, True) if len(order) * n <= SPILL_BUDGET else (False,))]
    must = heavy = 0  # ends of the two runs in ``order``
    for doc in order:
        length = doc_lengths[doc]
        if length > cap or doc_workload(length) > allowed:
            must = heavy = must + 1
        elif doc_workload(length) > HEAVY * allowed:
            heavy += 1
        else:
            break
    if must and len(order) * n <= NESTED_BUDGET:
        first.append(Pass(order, True, (True,), nested=True))
    if 0 < must < heavy and len(order) * n <= SEARCH_BUDGET:
        # Not descended: it shares little beyond the zigzagged must-split docs.
        first.append(Pass(order[must:heavy] + order[:must] + order[heavy:], True, (True,), False))
    return first, [Pass(order, True, (False, True))]


def objective(comm_mode: str) -> Callable[[Ranks], tuple[int, ...]]:
    """The critical-path figure a layout is chosen by under ``comm_mode`` (lower wins);
    O(s) for s shards."""
    if comm_mode == "alltoallv":
        return lambda ranks: (max(alltoallv_receives(ranks.shards)),)
    if comm_mode == "compact_allgather":
        def allgather(ranks: Ranks) -> tuple[int, ...]:
            volumes = comm_volumes(ranks.shards)
            return max(volumes.allgather_send), max(volumes.alltoallv_recv)
        return allgather
    if comm_mode in ("full", "p2p_ring"):
        return lambda ranks: (max(ranks.work), max(alltoallv_receives(ranks.shards)))
    raise ValueError(f"comm_mode must be one of {', '.join(COMM_MODES)}, got {comm_mode!r}")


def paper_rounds(num_docs: int, n: int, work: int = PAPER_WORK) -> int:
    """Per-Doc docs Algorithm 1 may try inside flashcp: k = 0 .. K with K + 1 rounds of
    about D + N K work each within ``work`` (at most ``MAX_PER_DOC``)."""
    k = 0
    while k < MAX_PER_DOC and (k + 2) * (num_docs + n * (k + 1)) <= work:
        k += 1
    return k


class Found(NamedTuple):
    """A finished layout that meets R, as the passes found it."""

    receive: int
    """The most KV any rank receives in the exact all-to-all-v (``ranks.measure``)."""
    position: int
    """Its place among the layouts found (ties go to the first)."""
    ranks: Ranks
    """The layout."""
    descend: bool
    """It may be descended (``refine.descend``)."""
    doubled: list[int]
    """Its zigzagged docs (``ranks.zigzagged``)."""


class Candidate(NamedTuple):
    """A layout ``_choose`` picks from."""

    ranks: Ranks
    """The layout."""
    tie: tuple[int, int]
    """Tie-break among equal costs (lower wins): (the found layout's index, 1 for its
    copy kept before descent, else 0)."""
    known: tuple[int, ...] | None
    """Its cost if already known (the receive found measured, under all-to-all-v, for a
    layout not descended since)."""
    doubled: list[int] | None
    """Its zigzagged docs if known."""


class Solved(NamedTuple):
    """flashcp's layout: per-rank shards, the docs held as zigzag pairs, its imbalance."""

    shards: list[list[Shard]]
    per_doc: list[int]
    imbalance: float


def flashcp_shards(
    doc_lengths: Sequence[int], num_ranks: int, target: float, *, comm_mode: str = "alltoallv",
) -> tuple[list[list[Shard]], list[int]]:
    """Per-rank shards and the docs held as zigzag pairs (module docstring)."""
    solved = flashcp_solve(doc_lengths, num_ranks, target, comm_mode=comm_mode)
    return solved.shards, solved.per_doc


def flashcp_solve(
    doc_lengths: Sequence[int], num_ranks: int, target: float, *, comm_mode: str = "alltoallv",
) -> Solved:
    """``flashcp_shards`` and the layout's imbalance (module docstring)."""
    n = num_ranks
    cost = objective(comm_mode)
    # Longest first, ties by index (a stable sort of the negated lengths; lengths < 2^31).
    lengths = np.array(doc_lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable").tolist()
    if len(lengths) and int(lengths.sum()) < 1 << 31:
        # The sum of doc_workload, exact in int64: below (2^31)^2 / 2.
        total_work = int((lengths * (lengths + 1) // 2).sum())
    else:
        total_work = sum(length * (length + 1) for length in doc_lengths) // 2
    allowed = target * total_work / n
    fallback: tuple[float, Ranks] | None = None
    steps = DESCENT_STEPS if len(order) * n <= SEARCH_BUDGET and comm_mode not in (
        "full", "p2p_ring") else 0
    # The bulk layouts, in order, before the full passes (bulk.bulk_tries).
    for head, for_fill, at_density in bulk_tries(lengths[order], n):
        ranks = bulk_layout(doc_lengths, order, lengths, n, allowed, total_work, head,
                            for_fill, at_density)
        imb = imbalance(ranks.work)
        if imb <= target:
            receive, doubled = measure(ranks)
            return _choose([Found(receive, 0, ranks, False, doubled)], doc_lengths, n, target,
                           total_work, allowed, steps, comm_mode, cost)
        if fallback is None or imb < fallback[0]:
            fallback = (imb, ranks)
    # Every doc's whole shard, shared by the layouts after the first (``ranks.Whole``):
    # made once a second layout is to be built (most large requests need one).
    whole: list[Shard] | None = None
    if n > 1:
        for count, batch in enumerate(passes(doc_lengths, order, n, allowed)):
            if count and whole is None:
                whole = whole_shards(doc_lengths)
            found: list[Found] = []
            for spec in batch:
                placed, spill = place(doc_lengths, spec.order, n, allowed, spec.fill_aware,
                                      total_work, spec.nested, lengths=lengths, whole=whole)
                # Without docs to spill, the spill orders give the same layout: finish one.
                spills = spec.spills if spill else spec.spills[:1]
                for i, tail_largest in enumerate(spills):
                    ranks = placed.copy() if i + 1 < len(spills) else placed
                    finish(ranks, spill, allowed, tail_largest)
                    imb = imbalance(ranks.work)
                    if imb <= target:
                        receive, doubled = measure(ranks)
                        found.append(Found(receive, len(found), ranks,
                                           spec.descend and steps > 0, doubled))
                    elif fallback is None or imb < fallback[0]:
                        fallback = (imb, ranks)
            if found:
                return _choose(found, doc_lengths, n, target, total_work, allowed, steps,
                               comm_mode, cost)
    if whole is None:
        whole = whole_shards(doc_lengths)
    rounds = paper_rounds(len(doc_lengths), n)
    imb, ranks, _ = algorithm1(doc_lengths, n, target, max_per_doc=rounds, whole=whole)
    more = paper_rounds(len(doc_lengths), n, PAPER_RETRY_WORK)
    if (imb > target and more > rounds and len(doc_lengths) <= PAPER_RETRY_DOCS
            and n <= PAPER_RETRY_RANKS):
        retried, again, _ = algorithm1(doc_lengths, n, target, max_per_doc=more, whole=whole)
        if retried < imb:
            imb, ranks = retried, again
    if fallback is not None and fallback[0] < imb:
        return Solved(fallback[1].shards, zigzagged(fallback[1]), fallback[0])
    return Solved(ranks.shards, zigzagged(ranks), imb)


def _choose(
    found: list[Found], doc_lengths: Sequence[int], n: int,
    target: float, total_work: int, allowed: float, steps: int, comm_mode: str,
    cost: Callable[[Ranks], tuple[int, ...]],
) -> Solved:
    """The layout meeting R with the least ``cost`` (module docstring, step 2): the
    descended layouts count, and under compact all-gather Algorithm 1's layout too."""
    # Descend the DESCENDED layouts that receive least before it; the first found wins ties.
    found.sort(key=lambda c: (c.receive, c.position))
    mean = total_work / n
    slack = 1.0 if len(doc_lengths) * n <= FULL_SLACK_BUDGET else DESCENT_SLACK
    pool: list[Candidate] = []
    descended = 0
    for receive, index, ranks, descend_it, doubled in found:
        known: tuple[int, ...] | None = (receive,) if comm_mode == "alltoallv" else None
        kept: list[int] | None = doubled
        if descend_it and descended < DESCENDED:
            if comm_mode == "compact_allgather":
                # The descent may add buffer tokens.
                pool.append(Candidate(ranks.copy(), (index, 1), None, doubled))
            descend(ranks, mean + slack * (allowed - mean), steps)
            descended += 1
            known = kept = None
        pool.append(Candidate(ranks, (index, 0), known, kept))
    if comm_mode == "compact_allgather":
        imb, paper, _ = algorithm1(doc_lengths, n, target,
                                   max_per_doc=paper_rounds(len(doc_lengths), n))
        if imb <= target:
            pool.append(Candidate(paper, (len(found), 0), None, None))
    best = min(pool, key=lambda c: (cost(c.ranks) if c.known is None else c.known, c.tie))
    return Solved(best.ranks.shards,
                  zigzagged(best.ranks) if best.doubled is None else best.doubled,
                  imbalance(best.ranks.work))


def flashcp_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    """Strategy ``flashcp``: the request's R and exchange (``comm_mode``, default
    all-to-all-v); the info declares a missed R (``balance.declared``)."""
    mode = request.comm_mode or "alltoallv"
    # The collector paused as ``registry.solve`` pauses it (``gc_pause.py``), also for
    # callers of the strategy itself: a large request builds hundreds of thousands of
    # shard tuples, and each young-generation collection would scan them for nothing.
    with paused_gc():
        solved = flashcp_solve(doc_lengths, request.cp_size, request.imbalance_target,
                               comm_mode=mode)
    return Layout(
        groups=[GroupLayout(tuple(range(request.cp_size)), solved.shards)],
        info=declared({"per_doc_docs": solved.per_doc,
                       "imbalance_target": request.imbalance_target, "objective": mode},
                      (solved.imbalance,), request.imbalance_target),
    )
