"""Strategy ``ilp``: exact block placement with OR-Tools CP-SAT (FlashCP, ILP sharding).

Docs are cut into blocks (:mod:`.blocks`: granularity g, a geometric head, and the
flashcp plan's cuts) and CP-SAT places every block on one rank (:mod:`.model`), every
rank holding at most T = ceil(S / N) tokens (so padding is the minimum, N T - S tokens).

Objectives (option ``objective``):

- ``comm`` (default): minimise the critical-path KV received in the exact all-to-all-v
  (max over ranks of ``rank_stats.alltoallv_recv``) subject to imbalance <= R, the
  request's ``imbalance_target`` (the same R flashcp gets, so the two compare at equal
  balance); the search is :mod:`.search`;
- ``balance``: minimise the largest workload, then, with that workload fixed, the
  critical-path KV (two solves, the time limit split between them).

Greedy first, exact second: the flashcp plan is the solution hint and the fallback when
CP-SAT finds nothing in time. Deterministic: the limit is CP-SAT's deterministic time
(:mod:`.cpsat`), so the same request gives the same plan byte for byte; a plan cut short
by the wall-clock guard says ``"deterministic": false`` in its info.

Plan info: ``status`` (OPTIMAL, FEASIBLE or FALLBACK), ``objective``,
``objective_value``, ``best_bound``, ``gap`` = (value - bound) / max(1, value) and
``saving_gap`` = (value - bound) / full-exchange tokens (for ``comm``: how far the comm
saving could still rise), plus the block count and the limits used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from planner_service.core.build import GroupLayout, Layout
from planner_service.core.cost import doc_workload, imbalance
from planner_service.core.errors import FieldError
from planner_service.core.plan import Shard
from planner_service.core.request import PlanRequest, check_time_limit
from planner_service.solvers.flashcp import flashcp_shards
from planner_service.solvers.ilp import cpsat
from planner_service.solvers.ilp.blocks import (
    Blocks,
    block_shards,
    cut_blocks,
    layout_cuts,
    place_blocks,
)
from planner_service.solvers.ilp.cpsat import Cp, Solve
from planner_service.solvers.ilp.model import (
    MAX_MODEL_BOOLS,
    OBJECTIVES,
    BlockModel,
    add_hint,
    build_model,
    canonical_ranks,
    placement_values,
)
from planner_service.solvers.ilp.search import solve_comm
from planner_service.solvers.ilp.subproblems import Subproblems
from planner_service.solvers.ilp.tuning import TUNING, Tuning

DEFAULT_GRANULARITY = 2048
DEFAULT_TIME_LIMIT_S = 10.0
MAX_TIME_LIMIT_S = 60.0
"""Cap on ``time_limit_s``, read at every solve."""
DEFAULT_WORKERS = 2
HEAD_DOCS_PER_RANK = 2
MAX_WORKERS = 16

OPTIONS = {
    "granularity": f"block size in tokens, >= 1 and at most the longest doc (default {DEFAULT_GRANULARITY})",
    "time_limit_s": f"wall-time limit of the solve in seconds, > 0 (default {DEFAULT_TIME_LIMIT_S}, "
    f"capped at {MAX_TIME_LIMIT_S}); the search's budget is a fixed amount of CP-SAT deterministic "
    "time per second of it, so the plan does not depend on the machine's load",
    "objective": "'comm' (min critical-path KV at imbalance <= R, default) or 'balance' "
    "(min max workload, then comm)",
    "workers": f"CP-SAT workers, 1 to {MAX_WORKERS} (default {DEFAULT_WORKERS})",
    "head_docs": "how many of the longest docs get a geometric head (fine blocks for exact "
    f"token counts) besides those flashcp splits, >= 0 (default {HEAD_DOCS_PER_RANK} x cp_size)",
}


class IlpOptions(NamedTuple):
    granularity: int
    time_limit_s: float
    """Effective limit, after the cap."""
    objective: str
    workers: int
    head_docs: int
    """The longest docs that get a geometric head (besides the docs flashcp splits)."""


class IlpResult(NamedTuple):
    """Placement and solver figures of one ILP solve."""

    shards: list[list[Shard]]
    status: str
    """OPTIMAL, FEASIBLE or FALLBACK (the flashcp plan, CP-SAT found nothing in time)."""
    objective_value: int
    """Critical-path KV tokens (comm) or max workload (balance) of ``shards``."""
    best_bound: int
    """Proven lower bound on the objective."""
    num_blocks: int
    hint_value: int
    """The objective value of the flashcp hint."""
    deterministic: bool
    """False if the wall-clock guard, not the deterministic limit, ended a solve."""


def parse_options(options: Mapping[str, Any], doc_lengths: Sequence[int], num_ranks: int) -> IlpOptions:
    """Validate the ilp options; raise FieldError naming the option and its allowed range."""
    longest = max(doc_lengths)
    g = options.get("granularity", min(DEFAULT_GRANULARITY, longest))
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise FieldError("options.granularity",
                         f"options.granularity must be an integer >= 1, got {g!r}")
    if g > longest:
        raise FieldError(
            "options.granularity",
            f"options.granularity {g} is larger than the longest doc ({longest} tokens): every "
            f"doc would be one block; use a granularity of at most {longest}"
        )
    limit = check_time_limit(options.get("time_limit_s", DEFAULT_TIME_LIMIT_S),
                             "options.time_limit_s")
    objective = options.get("objective", "comm")
    if objective not in OBJECTIVES:
        raise FieldError("options.objective", f"options.objective must be one of "
                         f"{', '.join(OBJECTIVES)}, got {objective!r}")
    workers = options.get("workers", DEFAULT_WORKERS)
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise FieldError("options.workers", f"options.workers must be an integer in "
                         f"[1, {MAX_WORKERS}], got {workers!r}")
    # Blocks per doc: L / g plus the geometric head (log2 g) plus a few reference cuts.
    approx_blocks = sum(-(-length // g) + min(length, g).bit_length() + 1 for length in doc_lengths)
    if approx_blocks * num_ranks > MAX_MODEL_BOOLS:
        raise FieldError(
            "options.granularity",
            f"options.granularity {g} makes about {approx_blocks} blocks x {num_ranks} ranks, above "
            f"the limit of {MAX_MODEL_BOOLS} placement variables; raise the granularity"
        )
    heads = options.get("head_docs", HEAD_DOCS_PER_RANK * num_ranks)
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 0:
        raise FieldError("options.head_docs",
                         f"options.head_docs must be an integer >= 0, got {heads!r}")
    return IlpOptions(g, min(limit, MAX_TIME_LIMIT_S), objective, workers, heads)


def head_docs(doc_lengths: Sequence[int], cuts: Mapping[int, set[int]], longest: int) -> set[int]:
    """Docs that get a geometric head: the ``longest`` longest and those the hint splits."""
    order = sorted(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
    split = {d for d, c in cuts.items() if len(c) > 2}
    return set(order[:longest]) | split


def workload_cap(doc_lengths: Sequence[int], num_ranks: int, target: float) -> int:
    """The largest per-rank workload w with imbalance w N / W <= R, computed with the same
    float arithmetic as ``cost.imbalance`` so a plan within the cap passes R exactly.

    Raises FieldError (``imbalance_target``) if R is below what integer workloads allow:
    some rank carries at least ceil(W / N) and the rank holding the last token of the
    longest doc at least L.
    """
    total = sum(doc_workload(length) for length in doc_lengths)
    return largest_within(total, max(-(-total // num_ranks), max(doc_lengths)), num_ranks,
                          target, "these docs", "query-key pairs")


def largest_within(total: int, floor: int, num_ranks: int, target: float, what: str,
                   pairs: str) -> int:
    """The largest integer w with ``w N / total <= R`` in ``cost.imbalance``'s float
    arithmetic; FieldError (``imbalance_target``) if it is below ``floor``, the least
    workload some rank must carry (``what`` and ``pairs`` name the docs and the unit)."""
    cap = int(target * total / num_ranks)
    while cap * num_ranks / total > target:
        cap -= 1
    while (cap + 1) * num_ranks / total <= target:
        cap += 1
    if cap < floor:
        raise FieldError(
            "imbalance_target",
            f"imbalance_target {target} is below what integer tokens allow for {what}: the "
            f"busiest rank carries at least {floor} {pairs}, imbalance "
            f"{floor * num_ranks / total:.6f}; raise imbalance_target"
        )
    return cap


def solve_blocks(
    doc_lengths: Sequence[int], num_ranks: int, target: float, options: IlpOptions,
    tuning: Tuning | None = None, deadline: float | None = None,
) -> IlpResult:
    """Place blocks optimally (or as well as the time limit allows); see the module docstring.

    ``tuning`` defaults to this module's ``TUNING``, read at every solve. The search gets
    ``tuning.dtime_per_s * options.time_limit_s`` deterministic seconds and stops at
    ``deadline`` (``time.monotonic()``; default: ``cpsat.Cp.start``'s, from now) whatever
    it has spent.

    Raises FieldError (``imbalance_target``) if R is below what integer tokens allow, or if
    CP-SAT proves that no placement at this granularity meets R.
    """
    n = num_ranks
    tuning = TUNING if tuning is None else tuning
    cp = Cp.start(options.workers, options.time_limit_s, tuning) if deadline is None \
        else Cp(options.workers, deadline, tuning)
    budget = cpsat.budget_s(options.time_limit_s, tuning)
    cap = workload_cap(doc_lengths, n, target) if options.objective == "comm" else None
    hint_shards, _ = flashcp_shards(doc_lengths, n, target)
    cuts = layout_cuts(hint_shards)
    blocks = cut_blocks(doc_lengths, options.granularity, cuts,
                        head_docs=head_docs(doc_lengths, cuts, options.head_docs))
    hint = canonical_ranks(blocks, place_blocks(blocks, hint_shards), n)
    tokens_cap = -(-sum(doc_lengths) // n)
    _, hint_loads, hint_recv = placement_values(blocks, hint, n)
    hint_ok = cap is None or max(hint_loads) <= cap

    def model(extra_work_cap: int | None = None) -> BlockModel:
        caps = [c for c in (cap, extra_work_cap) if c is not None]
        bm = build_model(blocks, n, token_cap=tokens_cap, work_cap=min(caps) if caps else None)
        return bm

    if options.objective == "comm":
        def hinted(ranks: list[int]) -> BlockModel:
            bm = model()
            add_hint(bm, blocks, ranks, n)
            return bm

        def comm_of(ranks: list[int]) -> int:
            return max(placement_values(blocks, ranks, n).recv)

        if hint_ok:
            assert cap is not None
            run = solve_comm(hint, hinted, comm_of,
                             Subproblems(blocks, doc_lengths, n, tokens_cap, cap, cp),
                             budget, cp)
        else:  # flashcp misses R: no incumbent to question from, and no hint: a hint that
            # breaks the model's caps, on a model CP-SAT proves infeasible, aborts CP-SAT
            # 9.10's interleaved search (see ``Subproblems.group_search``).
            bm = model()
            run = cpsat.run(bm, bm.comm_max, budget, cp)
        if run.status == "INFEASIBLE":
            raise FieldError(
                "imbalance_target",
                f"imbalance_target {target} cannot be met with granularity {options.granularity}: "
                f"CP-SAT proved that no placement of these blocks reaches it (flashcp reaches "
                f"{imbalance(hint_loads):.4f}); raise imbalance_target or lower the granularity"
            )
        hint_value = max(hint_recv)
        return _finish(blocks, n, run, hint, hint_value if hint_ok else None, hint_value,
                       comm_of, run.deterministic)

    # Balance: min max workload, then min comm at that workload.
    bm = model()
    add_hint(bm, blocks, hint, n)
    first = cpsat.run(bm, bm.work_max, budget / 2, cp)
    if first.ranks is None:
        return _finish(blocks, n, first, hint, max(hint_loads), max(hint_loads),
                       lambda ranks: max(placement_values(blocks, ranks, n).loads), first.deterministic)
    best_work = first.value
    bm = model(extra_work_cap=best_work)
    add_hint(bm, blocks, first.ranks, n)
    rest = max(budget - first.dtime, budget / 2)
    second = cpsat.run(bm, bm.comm_max, rest, cp)
    ranks = second.ranks or first.ranks
    status = "OPTIMAL" if first.status == second.status == "OPTIMAL" else "FEASIBLE"
    return IlpResult(
        shards=block_shards(blocks, ranks, n),
        status=_status_name(status),
        objective_value=max(placement_values(blocks, ranks, n).loads),  # <= best_work
        best_bound=first.bound,
        num_blocks=len(blocks.blocks),
        hint_value=max(hint_loads),
        deterministic=first.deterministic and second.deterministic,
    )


def _status_name(status: str) -> str:
    """The plan's status: CP-SAT's if it found a placement, else FALLBACK (the hint)."""
    return status if status in ("OPTIMAL", "FEASIBLE") else "FALLBACK"


def _finish(blocks: Blocks, n: int, run: Solve, hint: list[int], hint_feasible_value: int | None,
            hint_value: int, value_of: Any, deterministic: bool) -> IlpResult:
    """The solver's placement, or the hint if CP-SAT found nothing (or nothing better)."""
    # The solver's value can exceed the placement's own when a need flag off the critical
    # path is set without cause; report the placement's exact figure.
    ranks, status = run.ranks, run.status
    value = value_of(ranks) if ranks is not None else 0
    if ranks is None or (hint_feasible_value is not None and hint_feasible_value < value):
        ranks, value = hint, value_of(hint)
        status = "FEASIBLE" if run.ranks is not None else "FALLBACK"
    return IlpResult(
        shards=block_shards(blocks, ranks, n),
        status=_status_name(status),
        objective_value=value,
        best_bound=min(run.bound, value),
        num_blocks=len(blocks.blocks),
        hint_value=hint_value,
        deterministic=deterministic,
    )


def ilp_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    """The strategy without a KV bound (the registry's entry point is
    ``bounded.bounded_ilp_layout``): options from the request, figures into the plan's info."""
    n = request.cp_size
    options = parse_options(request.options, doc_lengths, n)
    result = solve_blocks(doc_lengths, n, request.imbalance_target, options)
    return result_layout(doc_lengths, request, options, result)


def result_layout(doc_lengths: Sequence[int], request: PlanRequest, options: IlpOptions,
                  result: IlpResult) -> Layout:
    """A solve's placement as the strategy's layout, its figures in the plan's info."""
    n = request.cp_size
    full = (n - 1) * -(-sum(doc_lengths) // n)
    value, bound = result.objective_value, result.best_bound
    info: dict[str, Any] = {
        "status": result.status,
        "objective": options.objective,
        "objective_value": value,
        "best_bound": bound,
        "gap": (value - bound) / max(1, value),
        "hint_objective_value": result.hint_value,
        "granularity": options.granularity,
        "num_blocks": result.num_blocks,
        "time_limit_s": options.time_limit_s,
        "workers": options.workers,
        "deterministic": result.deterministic,
        "imbalance_target": request.imbalance_target,
    }
    if options.objective == "comm":
        info["saving_gap"] = (value - bound) / full if full else 0.0
    return Layout(groups=[GroupLayout(tuple(range(n)), result.shards)], info=info)
