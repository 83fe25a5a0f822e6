"""Strategy ``flashcp`` held to ``max_kv_tokens_per_rank`` (see ``kv_bound``).

Without a bound it is ``flashcp_layout`` unchanged. With one, it returns the first of a
fixed list of candidate layouts whose KV peak is within the bound (``kv_bound.first_within``),
from the most balanced to the least KV, so the bound costs balance only where it binds:

1. ``flashcp``: the plan the request gets without a bound (R, the request's exchange);
2. ``flashcp alltoallv``: at the request's R with the all-to-all-v objective (least KV
   received by the neediest rank, which is what a gather mode's peak adds to the rank's
   own tokens), if the request's exchange is ``full`` or ``compact_allgather``;
3. ``flashcp alltoallv R=<r>``: the same at each looser R in ``LOOSER_TARGETS`` above the
   request's (fewer docs split for balance, so less KV received; not monotone, hence all);
4. ``memory_first``: ``memory_first.memory_first_shards``, least KV and balance aside.

Under ``p2p_ring`` every candidate peaks alike (own tokens plus ``min(N - 1, 2)`` blocks
of T = ceil(S / N), and every rank of a flashcp layout holds at most T, one exactly T),
so only the first is tried; its peak is then the minimum over one-group plans.

The candidates do not depend on the bound: flashcp meets a bound exactly when it is at
least the least peak of the list, the figure its ``KvBoundError`` names. Chosen: the plan's
``info.kv_candidate`` (and ``info.imbalance_target`` the R that candidate ran at); a
candidate over the request's R says so (``balance.declared``). Cost:
up to ``2 + len(LOOSER_TARGETS)`` flashcp solves and one ``memory_first`` pass, each
measured in O(s) (s shards); only the first runs when it meets the bound.

Under a mask that is not causal in every layer, the strategy is
``flashcp_masked.masked_flashcp_layout``: this module's layout is its first candidate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from planner_service.core.build import GroupLayout, Layout
from planner_service.core.cost import imbalance, rank_workloads
from planner_service.core.request import PlanRequest
from planner_service.core.step_time import held_kv_mode
from planner_service.solvers.balance import declared
from planner_service.solvers.flashcp import flashcp_layout
from planner_service.solvers.flashcp_masked import masked_flashcp_layout
from planner_service.solvers.kv_bound import Candidate, first_within
from planner_service.solvers.memory_first import memory_first_shards

LOOSER_TARGETS = (1.25, 1.5, 2.0, 4.0)
"""The looser imbalance targets R tried, in order, where the request's R gives too much KV."""


def flashcp_candidates(doc_lengths: Sequence[int], request: PlanRequest) -> list[Candidate]:
    """The candidate list of the module docstring, for the request's exchange."""
    mode = request.comm_mode or "alltoallv"
    n = request.cp_size

    def at(target: float, objective: str) -> Candidate:
        bounded = replace(request, imbalance_target=target, comm_mode=objective)
        name = "flashcp" if (target, objective) == (request.imbalance_target, mode) else (
            f"flashcp {objective}" + ("" if target == request.imbalance_target else f" R={target}"))
        return Candidate(name, lambda: flashcp_layout(doc_lengths, bounded))

    out = [at(request.imbalance_target, mode)]
    if mode == "p2p_ring":
        return out
    if mode != "alltoallv":
        out.append(at(request.imbalance_target, "alltoallv"))
    out += [at(r, "alltoallv") for r in LOOSER_TARGETS if r > request.imbalance_target]
    out.append(Candidate("memory_first", lambda: Layout(
        [GroupLayout(tuple(range(n)), memory_first_shards(doc_lengths, n))],
        {"objective": "kv_peak"})))
    return out


def bounded_flashcp_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    """The registry's ``flashcp``: ``flashcp_layout``, or with a bound the first candidate
    within it (module docstring), chosen among more candidates by the layer-weighted
    objective under a mask (``flashcp_masked``). Raises ``kv_bound.KvBoundError`` if none
    is within the bound."""
    if not request.mask.is_causal:
        return masked_flashcp_layout(doc_lengths, request, causal_flashcp_layout)
    return causal_flashcp_layout(doc_lengths, request)


def causal_flashcp_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    """``flashcp_layout``, or with a bound the first candidate within it."""
    bound = request.max_kv_tokens_per_rank
    if bound is None:
        return flashcp_layout(doc_lengths, request)
    layout = first_within(flashcp_candidates(doc_lengths, request), bound=bound,
                          comm_mode=held_kv_mode(request.kernel, request.comm_mode or "alltoallv"),
                          doc_lengths=doc_lengths,
                          num_ranks=request.cp_size).layout
    # A looser candidate (or memory_first) is measured against the request's R: O(s).
    worst = (imbalance(rank_workloads([list(r) for r in g.shards])) for g in layout.groups)
    return Layout(layout.groups, declared(layout.info, worst, request.imbalance_target))
