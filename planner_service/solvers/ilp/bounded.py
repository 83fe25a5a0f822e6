"""The ILP held to ``max_kv_tokens_per_rank`` (see ``solvers.kv_bound``).

In order, the first that holds the bound:

1. ``ilp``: the plan the request gets without a bound (``strategy.solve_blocks``);
2. ``ilp bounded`` (gather modes): one more CP-SAT solve of the block model with every
   rank's KV peak (its tokens plus the KV it receives, a linear expression of the model)
   at most the bound, the same objective and caps (R for ``comm``), hinted with the first
   of flashcp's candidates (``flashcp_bounded``) that holds both the bound and the
   workload cap, whose cuts the blocks then include; it gets the rest of ``time_limit_s``.
   Under ``p2p_ring`` the peak does not depend on the placement, and below
   ``kv_floor`` no placement holds the bound: there is no such step then;
3. the first of flashcp's candidates within the bound, with status ``FALLBACK`` (R may
   then be missed: memory before balance).

Otherwise ``KvBoundError`` names the least peak of step 1's plan and flashcp's
candidates: the ILP meets every bound from that figure on. It may meet a smaller one
where step 2 finds a placement in its time limit, which a refusal says it did not.
Cost: step 1's solve; then the flashcp candidates (``flashcp_bounded``) and at most one
more CP-SAT solve; the two solves share ``time_limit_s`` (half each, the second to the
whole limit's deadline).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

from ortools.sat.python import cp_model

from planner_service.core.build import Layout
from planner_service.core.cost import alltoallv_receives, rank_workloads
from planner_service.core.plan import Shard
from planner_service.core.request import PlanRequest
from planner_service.core.step_time import held_kv_mode
from planner_service.solvers.flashcp_bounded import flashcp_candidates
from planner_service.solvers.flashcp_masked import redeclared
from planner_service.solvers.ilp import cpsat
from planner_service.solvers.ilp.blocks import (
    Blocks,
    block_shards,
    cut_blocks,
    layout_cuts,
    place_blocks,
)
from planner_service.solvers.ilp.cpsat import Cp
from planner_service.solvers.ilp.model import BlockModel, add_hint, build_model, canonical_ranks
from planner_service.solvers.ilp.strategy import (
    IlpOptions,
    IlpResult,
    head_docs,
    ilp_layout,
    parse_options,
    result_layout,
    solve_blocks,
    workload_cap,
)
from planner_service.solvers.ilp.tuning import TUNING
from planner_service.solvers.ilp.windowed import masked_ilp_layout
from planner_service.solvers.kv_bound import GATHER_MODES, KvBoundError, group_peak, kv_floor

HOW = "the least KV peak of its plan without the bound and of flashcp's candidate plans"
SEARCHED = "; CP-SAT found no placement within the bound in its time limit"


class Bounded(NamedTuple):
    """``hold_bound``'s answer."""

    result: IlpResult
    candidate: str
    """Which step gave the plan: ``ilp``, ``ilp bounded`` or a flashcp candidate's name."""


def bounded_ilp_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    """The registry's ``ilp``: ``strategy.ilp_layout``, or with a bound the first step of
    the module docstring that holds it (named in the plan's ``info.kv_candidate``).
    Raises ``KvBoundError`` if none does. Under a mask that is not causal:
    ``windowed.masked_ilp_layout`` without a bound; with one, these steps on causal work,
    the balance declared from the layer-weighted work (``flashcp_masked.redeclared``)."""
    masked = not request.mask.is_causal
    if request.max_kv_tokens_per_rank is None:
        if masked:
            return masked_ilp_layout(doc_lengths, request)
        return ilp_layout(doc_lengths, request)
    options = parse_options(request.options, doc_lengths, request.cp_size)
    # Both solves share the request's time limit: the first gets half, the second what
    # is left of the whole limit's deadline.
    deadline = time.monotonic() + cpsat.search_wall_s(options.time_limit_s, TUNING)
    half = options._replace(time_limit_s=options.time_limit_s / 2)
    unbounded = solve_blocks(doc_lengths, request.cp_size, request.imbalance_target, half)
    held = hold_bound(doc_lengths, request, half, unbounded, deadline)
    layout = result_layout(doc_lengths, request, options, held.result)
    layout = Layout(layout.groups, {**layout.info, "kv_candidate": held.candidate})
    return redeclared(layout, request) if masked else layout


class Tried(NamedTuple):
    name: str
    shards: list[list[Shard]]
    peak: int


def hold_bound(doc_lengths: Sequence[int], request: PlanRequest, options: IlpOptions,
               unbounded: IlpResult, deadline: float) -> Bounded:
    """Steps 1 to 3 of the module docstring for ``request.max_kv_tokens_per_rank``.

    Raises ``KvBoundError`` if no step holds the bound."""
    bound = request.max_kv_tokens_per_rank
    assert bound is not None
    n, mode = request.cp_size, held_kv_mode(request.kernel, request.comm_mode or "alltoallv")
    peak = group_peak(unbounded.shards, mode)
    if peak <= bound:
        return Bounded(unbounded, "ilp")
    tried = []
    for candidate in flashcp_candidates(doc_lengths, request):
        shards = [list(rank) for rank in candidate.solve().groups[0].shards]
        tried.append(Tried(candidate.name, shards, group_peak(shards, mode)))
    within = [t for t in tried if t.peak <= bound]
    comm = options.objective == "comm"
    cap = workload_cap(doc_lengths, n, request.imbalance_target) if comm else None
    floor = kv_floor(doc_lengths, n, mode)
    how = HOW
    if mode in GATHER_MODES and bound >= floor:  # below the floor no placement exists
        how += SEARCHED
        hint = next((t for t in within if cap is None or max(rank_workloads(t.shards)) <= cap),
                    None)
        found = _solve(doc_lengths, n, options, bound, cap, unbounded, hint, deadline)
        if found is not None:
            return Bounded(found, "ilp bounded")
    if within:
        fallback = within[0]
        value = (max(alltoallv_receives(fallback.shards)) if comm
                 else max(rank_workloads(fallback.shards)))
        return Bounded(unbounded._replace(shards=fallback.shards, status="FALLBACK",
                                          objective_value=value,
                                          best_bound=min(unbounded.best_bound, value)),
                       fallback.name)
    raise KvBoundError(bound, min([peak] + [t.peak for t in tried]), how, floor)


def _solve(doc_lengths: Sequence[int], n: int, options: IlpOptions, bound: int,
           cap: int | None, unbounded: IlpResult, hint: Tried | None,
           deadline: float) -> IlpResult | None:
    """Step 2 (module docstring): the block model with every rank's KV peak at most
    ``bound``; None if CP-SAT finds no placement. Without a ``hint``, the first half of
    the limit asks for a placement within the bound: the model without it, minimising how
    far the largest peak exceeds it, from the unbounded plan (a solution of that model
    where it meets the caps); a placement that exceeds it by 0 is the hint."""
    cuts = layout_cuts(unbounded.shards)
    if hint is not None:
        for doc, more in layout_cuts(hint.shards).items():
            cuts.setdefault(doc, set()).update(more)
    blocks = cut_blocks(doc_lengths, options.granularity, cuts,
                        head_docs=head_docs(doc_lengths, cuts, options.head_docs))
    token_cap = -(-sum(doc_lengths) // n)
    limit = cpsat.budget_s(options.time_limit_s, TUNING)
    cp = Cp(options.workers, deadline, TUNING)
    comm = options.objective == "comm"
    start = None if hint is None else canonical_ranks(
        blocks, place_blocks(blocks, hint.shards), n)
    spent, deterministic = 0.0, unbounded.deterministic
    if start is None:
        bm = build_model(blocks, n, token_cap=token_cap, work_cap=cap)
        excess = bm.model.NewIntVar(0, sum(doc_lengths), "kv_excess")
        for peak in _peaks(bm, blocks, n):
            bm.model.Add(excess >= peak - bound)
        if cap is None or max(rank_workloads(unbounded.shards)) <= cap:
            seed = canonical_ranks(blocks, place_blocks(blocks, unbounded.shards), n)
            add_hint(bm, blocks, seed, n)
            over = group_peak(block_shards(blocks, seed, n), "alltoallv") - bound
            bm.model.AddHint(excess, max(0, over))
        run = cpsat.run(bm, excess, limit / 2, cp)
        spent, deterministic = run.dtime, deterministic and run.deterministic
        if run.ranks is None or group_peak(block_shards(blocks, run.ranks, n), "alltoallv") > bound:
            return None
        start = run.ranks
    bm = build_model(blocks, n, token_cap=token_cap, work_cap=cap)
    for peak in _peaks(bm, blocks, n):
        bm.model.Add(peak <= bound)
    add_hint(bm, blocks, start, n)
    run = cpsat.run(bm, bm.comm_max if comm else bm.work_max, max(limit - spent, limit / 2), cp)
    ranks = start if run.ranks is None else run.ranks
    shards = block_shards(blocks, ranks, n)
    value = max(alltoallv_receives(shards)) if comm else max(rank_workloads(shards))
    return IlpResult(
        shards=shards,
        status="OPTIMAL" if run.status == "OPTIMAL" and value <= run.bound else "FEASIBLE",
        objective_value=value,
        best_bound=min(run.bound, value),
        num_blocks=len(blocks.blocks),
        hint_value=unbounded.hint_value,
        deterministic=deterministic and run.deterministic,
    )


def _peaks(bm: BlockModel, blocks: Blocks, n: int) -> list[cp_model.LinearExpr]:
    """Per rank, its KV peak in a gather mode as a linear expression of the model: its
    tokens plus the KV it receives. The model's receive is at least the placement's (a
    need flag may be set without cause), so a solution within a cap on these expressions
    has its true peaks within it too; and every placement has a solution with them exact."""
    size = [b.end - b.start for b in blocks.blocks]
    return [cp_model.LinearExpr.WeightedSum([bm.x[b][r] for b in range(len(size))], size)
            + bm.recv[r] for r in range(n)]
