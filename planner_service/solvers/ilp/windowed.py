"""Strategy ``ilp`` under an attention mask that is not causal in every layer.

The block placement of :mod:`.window_model`: layer-weighted work within R x mean and,
for objective ``comm``, the least layer-weighted critical-path exchange
``sum_g count_g max_r recv_g[r]`` (all-to-all-v, a windowed layer moving only the keys
its windows reach); objective ``balance``: the least largest weighted work, then, with it
fixed, the least weighted exchange. The blocks are those of the causal ILP plus the cuts
of the two hints: flashcp's plan under the mask (``flashcp_masked``) and its causal
plan. The hint is the one of them within T tokens a rank and the weighted cap with the
least objective; none: CP-SAT unhinted (a hint that breaks the model's caps aborts its
interleaved search, see ``Subproblems.group_search``).

The search is CP-SAT's on the whole model, hinted, with the request's whole
deterministic budget (``cpsat.budget_s``): the causal ILP's bounds (the longest
document's ends, the fluid relaxation) and rank-group steps price causal prefixes and
are not used here, so the proven bound is CP-SAT's own and gaps on large requests are
wider than the causal ILP's. Status ``FALLBACK`` is the better hint (or flashcp's masked
plan where no hint meets the caps) when CP-SAT finds nothing.

With ``max_kv_tokens_per_rank`` the request takes the causal ILP's bounded path
(``bounded.py``) and its balance is declared from the weighted work (``redeclared``).
Every plan's ``imbalance_target_met`` / ``imbalance_reached`` are computed from the
layer-weighted work (``flashcp_masked.redeclared``).

Cost: two flashcp solves, one model build O(G B N (1 + p)) (window_model.py), one
CP-SAT solve within the budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ortools.sat.python import cp_model

from planner_service.core import window_work as ww
from planner_service.core.build import Layout
from planner_service.core.cost import imbalance
from planner_service.core.errors import FieldError
from planner_service.core.mask import AttentionMask
from planner_service.core.request import PlanRequest
from planner_service.solvers.flashcp import flashcp_shards
from planner_service.solvers.flashcp_bounded import bounded_flashcp_layout
from planner_service.solvers.flashcp_masked import masked_flashcp_layout, redeclared
from planner_service.solvers.ilp import cpsat
from planner_service.solvers.ilp.blocks import (
    Blocks,
    block_shards,
    cut_blocks,
    layout_cuts,
    place_blocks,
)
from planner_service.solvers.ilp.cpsat import Cp, Solve
from planner_service.solvers.ilp.model import MAX_MODEL_BOOLS, canonical_ranks
from planner_service.solvers.ilp.strategy import (
    IlpOptions,
    IlpResult,
    head_docs,
    largest_within,
    parse_options,
    result_layout,
)
from planner_service.solvers.ilp.tuning import TUNING, Tuning
from planner_service.solvers.ilp.window_model import (
    WindowModel,
    acts_causal,
    add_window_hint,
    build_window_model,
    causal_pieces,
    window_pieces,
    window_values,
)
from planner_service.solvers.kv_bound import listed


def weighted_cap(doc_lengths: Sequence[int], num_ranks: int, target: float,
                 mask: AttentionMask) -> int:
    """The largest per-rank layer-weighted work w with ``w N / total <= R``, in
    ``cost.imbalance``'s float arithmetic (``strategy.workload_cap`` on the weighted work).

    Raises FieldError (``imbalance_target``) if R is below what integer tokens allow: some
    rank carries ceil(total / N), and the holder of the longest doc's last token its
    query's ``sum_g count_g min(L, W_g)`` pairs."""
    total = sum(g.layers * ww.shard_window_workload(0, length, g.window)
                for length in doc_lengths for g in mask.groups)
    longest = max(doc_lengths)
    last = sum(g.layers * (longest if g.window is None else min(longest, g.window))
               for g in mask.groups)
    return largest_within(total, max(-(-total // num_ranks), last), num_ranks, target,
                          "these docs under the mask", "layer-weighted pairs")


MAX_WINDOW_SIZE = 4 * MAX_MODEL_BOOLS
"""Most booleans plus need implications of the windowed model (x ranks); above it the
request is refused (raise the granularity) rather than solved."""


def check_size(blocks: Blocks, num_ranks: int, mask: AttentionMask, granularity: int) -> None:
    """FieldError (``options.granularity``) if the windowed model would hold more than
    ``MAX_WINDOW_SIZE`` booleans and need implications: a window far above the
    granularity makes every block reached by about W / g later blocks. O(G B r)."""
    longest = max((b.end for b in blocks.blocks), default=0)
    size = len(blocks.blocks)
    for group in mask.groups:
        if acts_causal(group.window, longest):
            size += 3 * len(causal_pieces(blocks))
        else:
            assert group.window is not None  # acts_causal holds for None
            for pieces in window_pieces(blocks, group.window):
                size += sum(2 + len(p.reachers) - p.first for p in pieces)
    size *= num_ranks
    if size > MAX_WINDOW_SIZE:
        raise FieldError(
            "options.granularity",
            f"options.granularity {granularity} makes a model of about {size} booleans and "
            f"window implications under the mask ({len(blocks.blocks)} blocks x {num_ranks} "
            f"ranks), above the limit of {MAX_WINDOW_SIZE}; raise the granularity")


def masked_ilp_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    """The ``ilp`` plan of a request whose mask is not causal (module docstring)."""
    n = request.cp_size
    options = parse_options(request.options, doc_lengths, n)
    masked = listed(masked_flashcp_layout(doc_lengths, request, bounded_flashcp_layout))
    hints = [[list(rank) for rank in group.shards] for group in masked.groups
             if len(group.ranks) == n]
    hints.append(flashcp_shards(doc_lengths, n, request.imbalance_target)[0])
    result = solve_window_blocks(doc_lengths, n, request.imbalance_target, request.mask,
                                 options, hints)
    layout = result_layout(doc_lengths, request, options, result)
    info: dict[str, Any] = dict(layout.info)
    if options.objective == "comm":
        full = sum(g.layers for g in request.mask.groups) * (n - 1) * -(-sum(doc_lengths) // n)
        info["saving_gap"] = (result.objective_value - result.best_bound) / full if full else 0.0
    info["mask_objective"] = "layer-weighted"
    return redeclared(Layout(layout.groups, info), request)


def window_blocks(doc_lengths: Sequence[int], options: IlpOptions,
                  hints: Sequence[Sequence[Sequence[Any]]]) -> Blocks:
    """The causal ILP's blocks plus every hint's cuts."""
    cuts: dict[int, set[int]] = {}
    for shards in hints:
        for doc, more in layout_cuts(shards).items():
            cuts.setdefault(doc, set()).update(more)
    return cut_blocks(doc_lengths, options.granularity, cuts,
                      head_docs=head_docs(doc_lengths, cuts, options.head_docs))


def solve_window_blocks(doc_lengths: Sequence[int], num_ranks: int, target: float,
                        mask: AttentionMask, options: IlpOptions,
                        hints: Sequence[Sequence[Sequence[Any]]],
                        tuning: Tuning | None = None,
                        blocks: Blocks | None = None) -> IlpResult:
    """Place blocks under ``mask`` (module docstring); ``hints``: shard layouts whose cuts
    the blocks include (``blocks`` given: they must already), the first of them the
    fallback. Raises FieldError (``imbalance_target``) as ``strategy.solve_blocks``."""
    n = num_ranks
    tuning = TUNING if tuning is None else tuning
    cp = Cp.start(options.workers, options.time_limit_s, tuning)
    budget = cpsat.budget_s(options.time_limit_s, tuning)
    blocks = window_blocks(doc_lengths, options, hints) if blocks is None else blocks
    check_size(blocks, n, mask, options.granularity)
    token_cap = -(-sum(doc_lengths) // n)
    comm = options.objective == "comm"
    cap = weighted_cap(doc_lengths, n, target, mask) if comm else None
    placed = [canonical_ranks(blocks, place_blocks(blocks, shards), n) for shards in hints]
    values = [window_values(blocks, ranks, n, mask) for ranks in placed]

    def fits(v: Any, work_cap: int | None) -> bool:
        return max(v.tokens) <= token_cap and (work_cap is None or max(v.loads) <= work_cap)

    def score(v: Any) -> int:
        return v.comm if comm else max(v.loads)

    feasible = [i for i, v in enumerate(values) if fits(v, cap)]
    start = min(feasible, key=lambda i: (score(values[i]), i)) if feasible else None
    hint_value = score(values[start if start is not None else 0])

    def model(work_cap: int | None, seed: list[int] | None) -> WindowModel:
        wm = build_window_model(blocks, n, mask, token_cap=token_cap, work_cap=work_cap)
        if seed is not None:
            add_window_hint(wm, blocks, seed, n, mask)
        return wm

    seed = placed[start] if start is not None else None
    if comm:
        wm = model(cap, seed)
        run = _run(wm, wm.comm_total, budget, cp)
        if run.status == "INFEASIBLE":
            raise FieldError(
                "imbalance_target",
                f"imbalance_target {target} cannot be met with granularity {options.granularity}"
                f" under the mask: CP-SAT proved that no placement of these blocks reaches it "
                f"(flashcp reaches {imbalance(values[0].loads):.4f}); raise imbalance_target "
                "or lower the granularity")
        return _finish(blocks, n, mask, run, placed, values, start, hint_value, comm)
    wm = model(None, seed)
    first = _run(wm, wm.work_max, budget / 2, cp)
    if first.ranks is None:
        return _finish(blocks, n, mask, first, placed, values, start, hint_value, comm)
    wm = model(first.value, first.ranks)
    second = _run(wm, wm.comm_total, max(budget - first.dtime, budget / 2), cp)
    ranks = second.ranks or first.ranks
    status = "OPTIMAL" if first.status == second.status == "OPTIMAL" else "FEASIBLE"
    return IlpResult(
        shards=block_shards(blocks, ranks, n), status=status,
        objective_value=max(window_values(blocks, ranks, n, mask).loads),
        best_bound=first.bound, num_blocks=len(blocks.blocks), hint_value=hint_value,
        deterministic=first.deterministic and second.deterministic)


def _run(wm: WindowModel, target: cp_model.IntVar, limit_s: float, cp: Cp) -> Solve:
    """Minimise ``target`` as ``cpsat.run`` does (the same deterministic configuration)."""
    wm.model.Minimize(target)
    solver, status, dtime, deterministic = cpsat.solve_model(wm.model, limit_s, cp)
    dtime += cpsat.build_charge(wm.x, cp.tuning)
    if status not in ("OPTIMAL", "FEASIBLE"):
        bound = int(math.ceil(solver.BestObjectiveBound())) if status == "UNKNOWN" else 0
        return Solve(status, None, 0, max(bound, 0), dtime, deterministic)
    value = int(round(solver.ObjectiveValue()))
    bound = int(math.ceil(solver.BestObjectiveBound() - 1e-6))
    return Solve(status, cpsat.chosen(solver, wm.x), value, min(bound, value), dtime,
                 deterministic)


def _finish(blocks: Blocks, n: int, mask: AttentionMask, run: Solve, placed: list[list[int]],
            values: list[Any], start: int | None, hint_value: int, comm: bool) -> IlpResult:
    """CP-SAT's placement, or the best hint if CP-SAT found nothing better (FALLBACK if it
    found nothing); the value is the placement's own (core/window_work.py)."""
    def score(ranks: list[int]) -> int:
        v = window_values(blocks, ranks, n, mask)
        return v.comm if comm else max(v.loads)

    ranks, status = run.ranks, run.status
    value = score(ranks) if ranks is not None else 0
    if ranks is None or (start is not None and hint_value < value):
        fallback = start if start is not None else 0
        ranks, value = placed[fallback], score(placed[fallback])
        status = "FEASIBLE" if run.ranks is not None else "FALLBACK"
    return IlpResult(
        shards=block_shards(blocks, ranks, n),
        status=status if status in ("OPTIMAL", "FEASIBLE") else "FALLBACK",
        objective_value=value, best_bound=min(run.bound, value),
        num_blocks=len(blocks.blocks), hint_value=hint_value, deterministic=run.deterministic)
