"""Strategy ``ilp``: exact block placement with OR-Tools CP-SAT (FlashCP, ILP sharding).

Docs are cut into blocks (:mod:`.ilp_blocks`: granularity g, a geometric head, and the
flashcp plan's cuts) and CP-SAT places every block on one rank (:mod:`.ilp_model`), every
rank holding at most T = ceil(S / N) tokens (so padding is the minimum, N T - S tokens).

Objectives (option ``objective``):

- ``comm`` (default): minimise the critical-path KV received in the exact all-to-all-v
  (max over ranks of ``rank_stats.alltoallv_recv``) subject to imbalance <= R, the
  request's ``imbalance_target`` (the same R flashcp gets, so the two compare at equal
  balance);
- ``balance``: minimise the largest workload, then, with that workload fixed, the
  critical-path KV (two solves, the time limit split between them).

Search for ``comm`` (``_solve_comm``): CP-SAT's LP bound on a maximum of received KV is
near 0 (the LP spreads every block over all ranks), so the bound comes from smaller
models: a branch and bound on where each rank's part of the longest doc ends
(:mod:`.ilp_ends`: an LP per node, CP-SAT on the leaves), a relaxation
(:mod:`.ilp_relax`: the docs that cannot stay whole as blocks, the rest as a fluid of
token positions, then of blocks) solved to optimality where the time allows, and the
question "can every doc stay whole?"
(``ilp_model.whole_doc_model``). Placements come from a restricted model asked for one
within 1% of the bound (:mod:`.ilp_fill`: every other doc whole or cut once, where the
longest doc fits on a rank), from rank-group steps (:mod:`.ilp_lns`: the blocks of the
rank receiving most and one or two partners re-placed exactly by a small model, the
other ranks fixed), then from CP-SAT's LNS on the full model; a last
bisection of yes/no questions "is there a placement whose
critical-path KV is at most v?" (hard constraint, strong propagation) raises the bound.

Greedy first, exact second: the flashcp plan is the solution hint and the fallback when
CP-SAT finds nothing in time. Deterministic: one worker searches sequentially; several
workers use CP-SAT's interleaved search; either way the limit is CP-SAT's deterministic
time, so the same request gives the same plan byte for byte. A wall-clock guard
(``WALL_GUARD`` x the limit + ``WALL_GUARD_BASE_S``) stops a solve on an overloaded
machine, twice over: each CP-SAT call stops at the guard of its own limit, and no call runs
past the guard of the whole solve's limit (from its start; so a solve of many short calls,
each within its own guard, still ends in bounded time); a plan cut short by it says
``"deterministic": false`` in its info.

Plan info: ``status`` (OPTIMAL, FEASIBLE or FALLBACK), ``objective``,
``objective_value``, ``best_bound``, ``gap`` = (value - bound) / max(1, value) and
``saving_gap`` = (value - bound) / full-exchange tokens (for ``comm``: how far the comm
saving could still rise), plus the block count and the limits used. The comm search logs
its incumbent and bound after each step at DEBUG (``PROGRESS``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

from ortools.sat.python import cp_model

from planner_service.core.build import GroupLayout, Layout
from planner_service.core.cost import doc_workload, imbalance
from planner_service.core.plan import Shard
from planner_service.core.request import PlanRequest
from planner_service.solvers.flashcp import flashcp_shards
from planner_service.solvers.ilp_blocks import (
    Blocks,
    block_shards,
    cut_blocks,
    layout_cuts,
    place_blocks,
)
from planner_service.solvers.ilp_ends import ends_bound
from planner_service.solvers.ilp_fill import fill_model, fill_ranks, option_count
from planner_service.solvers.ilp_lns import GroupModel, Step, descend
from planner_service.solvers.ilp_model import (
    OBJECTIVES,
    BlockModel,
    add_hint,
    build_model,
    canonical_ranks,
    placement_values,
    token_floor,
    whole_doc_model,
)
from planner_service.solvers.ilp_relax import GRAINS, must_split, relaxation, sub_blocks
from planner_service.solvers.registry import Strategy, register

log = logging.getLogger(__name__)
PROGRESS = "ilp progress: %s: value %d, bound %d, %.3f deterministic s"
"""The DEBUG record ``_solve_comm`` logs after each step (args: the step's name, the
incumbent's critical-path KV, the proven bound and the deterministic seconds spent), so
an operator or a benchmark (``bench.ilp_compare``: the wall time at which the gap first
fell under 1%) can follow the search; the plan itself carries no timings."""

DEFAULT_GRANULARITY = 2048
DEFAULT_TIME_LIMIT_S = 10.0
MAX_TIME_LIMIT_S = 60.0
"""Cap on ``time_limit_s``, read at every solve: the service may lower it."""
DEFAULT_WORKERS = 2
HEAD_DOCS_PER_RANK = 2
MAX_WORKERS = 16
MAX_MODEL_BOOLS = 50_000
"""Blocks x ranks above this are refused (raise the granularity) rather than solved."""
WALL_GUARD = 3.0
WALL_GUARD_BASE_S = 2.0
"""The wall-clock guard of a limit of deterministic time: ``WALL_GUARD`` x the limit +
``WALL_GUARD_BASE_S``, for each CP-SAT call and for the whole solve. Normal runs must stay
well inside it: the full model's interleaved LNS overshoots its deterministic limit about
2x, and on this 2-core machine its wall time
reached 3.1 x its limit (Pile-like 128K, N = 8, sequence 2: 2.84 s for 0.909 s), which the
earlier guard of 2 x + 1 s cut short in 5 of 100 Pile-like solves there."""
GROUP_SHARE = 0.4
"""The rank-group search from the hint runs until this share of the limit is spent."""
RELAX_SHARE = 0.4
"""Most of the time limit the comm objective spends on its relaxation's bound."""
ENDS_SHARE = 0.25
"""Most of the time limit the bound of :mod:`.ilp_ends` (branching on the longest doc's
ends) may take, out of ``RELAX_SHARE``."""
ENDS_LP_SHARE = 0.5
"""The share of that budget its LPs may take (the rest goes to its leaves)."""
ENDS_LEAF_SHARE = 0.1
"""Most of the leaves' budget any one leaf's CP-SAT solve may take."""
ZERO_SHARE = 0.15
"""Most of the time limit the question "can every doc stay whole?" may take."""
FILL_SHARE = 0.2
"""The least share of the time limit the question of :mod:`.ilp_fill` (a placement within
``FILL_GAP`` of the bound) gets."""
FILL_UNTIL = 0.7
"""The fill question may run until this share of the limit is spent (from where the bound
left it, and at least ``FILL_SHARE``): where it finds a placement it often needs 2 to 6
deterministic seconds, and the bound before it is usually proven in 1 or 2. Measured at
128K, N = 4, 10 s on every sequence whose longest doc fits on a rank (scratch runs: 56
code, 76 Pile-like, 80 WLB-LLM sequences), gaps under 1% went from 28 to 32, 48 to 57 and
56 to 55 with 0.7 instead of ``FILL_SHARE`` alone; where the question finds nothing, the
rank-group steps after it have less time and the gap grows (by up to 27 points there).
On a sample of 48 of them, 0.6 closed fewer, and 0.8 one more with larger losses. At
N = 8, 128K it costs more than it gives on WLB-LLM and Pile-like (``bench.ilp_compare``:
6 and 5 of 100 under 1%, 7 and 8 without the fill question)."""
FILL_RELAX_SHARE = 0.55
"""``RELAX_SHARE`` where the bound comes first and the fill question follows (the
longest doc fits on a rank, ``_solve_comm``)."""
FILL_GAP = Fraction(1, 100)
"""The relative gap the fill question asks for: the acceptance target of the ILP."""
SEARCH_SHARE = 0.8
"""The rank-group search resumes after the bound until this share of the limit is spent."""
BISECT_SHARE = 0.1
"""The share of the limit left to ``_bisect`` questions after the full optimisation."""
PROBE_SHARE = 0.06
"""Most of the time limit any one yes/no question may take."""
GROUP_STEP_SHARE = 0.01
"""The first limit of one rank-group step (``ilp_lns.descend`` doubles it when stuck)."""
MAX_UNDECIDED = 2
"""``_bisect`` stops after this many undecided questions in a row."""
# Full-problem subsolvers whose interleaved chunks overrun their deterministic budget
# by seconds of wall time on this model (heavy LP); the rest plus LNS remain.
_SLOW_SUBSOLVERS = ("max_lp", "reduced_costs", "pseudo_costs", "quick_restart", "default_lp")

OPTIONS = {
    "granularity": f"block size in tokens, >= 1 and at most the longest doc (default {DEFAULT_GRANULARITY})",
    "time_limit_s": f"CP-SAT deterministic time limit in seconds, > 0 (default {DEFAULT_TIME_LIMIT_S}, "
    f"capped at {MAX_TIME_LIMIT_S})",
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
    """Validate the ilp options; raise ValueError naming the option and its allowed range."""
    longest = max(doc_lengths)
    g = options.get("granularity", min(DEFAULT_GRANULARITY, longest))
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ValueError(f"options.granularity must be an integer >= 1, got {g!r}")
    if g > longest:
        raise ValueError(
            f"options.granularity {g} is larger than the longest doc ({longest} tokens): every "
            f"doc would be one block; use a granularity of at most {longest}"
        )
    limit = options.get("time_limit_s", DEFAULT_TIME_LIMIT_S)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit) \
            or limit <= 0:
        raise ValueError(f"options.time_limit_s must be a number > 0, got {limit!r}")
    objective = options.get("objective", "comm")
    if objective not in OBJECTIVES:
        raise ValueError(f"options.objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    workers = options.get("workers", DEFAULT_WORKERS)
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"options.workers must be an integer in [1, {MAX_WORKERS}], got {workers!r}")
    # Blocks per doc: L / g plus the geometric head (log2 g) plus a few reference cuts.
    approx_blocks = sum(-(-length // g) + min(length, g).bit_length() + 1 for length in doc_lengths)
    if approx_blocks * num_ranks > MAX_MODEL_BOOLS:
        raise ValueError(
            f"options.granularity {g} makes about {approx_blocks} blocks x {num_ranks} ranks, above "
            f"the limit of {MAX_MODEL_BOOLS} placement variables; raise the granularity"
        )
    heads = options.get("head_docs", HEAD_DOCS_PER_RANK * num_ranks)
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 0:
        raise ValueError(f"options.head_docs must be an integer >= 0, got {heads!r}")
    return IlpOptions(g, float(min(limit, MAX_TIME_LIMIT_S)), objective, workers, heads)


def head_docs(doc_lengths: Sequence[int], cuts: Mapping[int, set[int]], longest: int) -> set[int]:
    """Docs that get a geometric head: the ``longest`` longest and those the hint splits."""
    order = sorted(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
    split = {d for d, c in cuts.items() if len(c) > 2}
    return set(order[:longest]) | split


def workload_cap(doc_lengths: Sequence[int], num_ranks: int, target: float) -> int:
    """The largest per-rank workload w with imbalance w N / W <= R, computed with the same
    float arithmetic as ``cost.imbalance`` so a plan within the cap passes R exactly.

    Raises ValueError if R is below what integer workloads allow: some rank carries at
    least ceil(W / N) and the rank holding the last token of the longest doc at least L.
    """
    total = sum(doc_workload(length) for length in doc_lengths)
    floor = max(-(-total // num_ranks), max(doc_lengths))
    cap = int(target * total / num_ranks)
    while cap * num_ranks / total > target:
        cap -= 1
    while (cap + 1) * num_ranks / total <= target:
        cap += 1
    if cap < floor:
        raise ValueError(
            f"imbalance_target {target} is below what integer tokens allow for these docs: the "
            f"busiest rank carries at least {floor} query-key pairs, imbalance "
            f"{floor * num_ranks / total:.6f}; raise imbalance_target"
        )
    return cap


class _Cp(NamedTuple):
    """How one solve runs CP-SAT: its workers and its wall-clock deadline."""

    workers: int
    deadline: float
    """``time.monotonic()`` after which no CP-SAT call of the solve runs on (the whole
    solve's wall-clock guard, module docstring)."""

    @classmethod
    def start(cls, workers: int, limit_s: float) -> _Cp:
        """The configuration of a solve of ``limit_s`` deterministic seconds starting now."""
        return cls(workers, time.monotonic() + WALL_GUARD * limit_s + WALL_GUARD_BASE_S)


def _solver(limit_s: float, cp: _Cp) -> cp_model.CpSolver:
    """A deterministic CP-SAT configuration (module docstring)."""
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.max_deterministic_time = limit_s
    p.max_time_in_seconds = max(0.0, min(WALL_GUARD * limit_s + WALL_GUARD_BASE_S,
                                         cp.deadline - time.monotonic()))
    p.random_seed = 0
    p.num_workers = cp.workers
    if cp.workers > 1:
        p.interleave_search = True
        p.ignore_subsolvers.extend(_SLOW_SUBSOLVERS)
    return solver


class _Solve(NamedTuple):
    status: str
    """CP-SAT's status name: OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN or MODEL_INVALID."""
    ranks: list[int] | None
    value: int
    bound: int
    dtime: float
    deterministic: bool


def _run(bm: BlockModel, target: cp_model.IntVar | None, limit_s: float, cp: _Cp) -> _Solve:
    """Minimise ``target`` (None: find any solution) with the hint already set; the
    solution's rank per block."""
    if target is not None:
        bm.model.Minimize(target)
    # A yes/no question runs CP-SAT's default sequential search: its LP and probing refute
    # a v fastest (and interleaving every subsolver with a hint trips a CP-SAT check).
    solver, status, dtime, deterministic = _solve_model(
        bm.model, limit_s, cp if target is not None else cp._replace(workers=1))
    if status not in ("OPTIMAL", "FEASIBLE"):
        bound = int(math.ceil(solver.BestObjectiveBound())) if status == "UNKNOWN" else 0
        return _Solve(status, None, 0, max(bound, 0), dtime, deterministic)
    ranks = _chosen(solver, bm.x)
    if target is None:
        return _Solve(status, ranks, 0, 0, dtime, deterministic)
    value = int(round(solver.ObjectiveValue()))
    bound = int(math.ceil(solver.BestObjectiveBound() - 1e-6))
    return _Solve(status, ranks, value, min(bound, value), dtime, deterministic)


def _chosen(solver: cp_model.CpSolver, rows: Sequence[Sequence[cp_model.IntVar]]) -> list[int]:
    """Per row of exactly-one booleans, the index of the one that is true."""
    return [next(i for i, v in enumerate(row) if solver.BooleanValue(v)) for row in rows]


def _solve_model(model: cp_model.CpModel, limit_s: float,
                 cp: _Cp) -> tuple[cp_model.CpSolver, str, float, bool]:
    """Solve with the deterministic configuration: the solver, CP-SAT's status name, the
    deterministic time spent (the whole limit if the wall-clock guard ended it) and
    whether the limit (not the guard) ended it."""
    solver = _solver(limit_s, cp)
    status = solver.StatusName(solver.Solve(model))
    assert status != "MODEL_INVALID", solver.SolutionInfo()
    response = solver.ResponseProto()
    guard_hit = response.wall_time >= 0.999 * solver.parameters.max_time_in_seconds
    deterministic = status in ("OPTIMAL", "INFEASIBLE") or not guard_hit
    # A solve cut short by the guard counts its whole limit: the callers loop until their
    # budget is spent, and a machine so loaded that CP-SAT does no deterministic work
    # before the guard must still end the search.
    spent = response.deterministic_time if deterministic else max(response.deterministic_time, limit_s)
    return solver, status, spent, deterministic


class _Search(NamedTuple):
    """Where the comm search stands: the incumbent and the proven bound."""

    ranks: list[int]
    """The best placement found."""
    value: int
    """Its critical-path KV."""
    bound: int
    """Proven: no placement has a critical-path KV below this."""
    spent: float
    """Deterministic seconds used so far."""
    deterministic: bool
    found: bool = False
    """Whether CP-SAT has returned a placement (else the plan is the fallback)."""


def _ask(state: _Search, v: int, build: Callable[[list[int]], BlockModel],
         value_of: Callable[[list[int]], int], limit: float, cp: _Cp) -> tuple[_Search, bool]:
    """One yes/no question: is there a placement whose critical-path KV is at most v?
    Returns the new state and whether the question was decided."""
    bm = build(state.ranks)
    bm.model.Add(bm.comm_max <= v)
    run = _run(bm, None, limit, cp)
    state = state._replace(spent=state.spent + run.dtime,
                           deterministic=state.deterministic and run.deterministic)
    if run.status == "INFEASIBLE":
        return state._replace(bound=max(state.bound, v + 1)), True
    if run.ranks is not None:
        found = value_of(run.ranks)
        if found < state.value:
            state = state._replace(ranks=run.ranks, value=found)
        return state._replace(found=True), True
    return state, False


def _bisect(state: _Search, build: Callable[[list[int]], BlockModel],
            value_of: Callable[[list[int]], int], budget: float, limit: float,
            cp: _Cp) -> _Search:
    """Narrow [bound, value) with yes/no questions at its midpoint until ``budget``
    deterministic seconds are spent or ``MAX_UNDECIDED`` questions in a row stay open.

    Why: CP-SAT's LP bound on a maximum of received KV is weak (the relaxation spreads
    every block over all ranks and proves little above 0), but with ``comm_max <= v`` as
    a hard constraint propagation is strong: a v well below the optimum is refuted in a
    fraction of a second. YES moves the incumbent down, NO moves the bound up to v + 1,
    and an undecided v is not asked again: the next question is the midpoint of the lower
    half, which can still raise the bound.
    """
    high, undecided = state.value, 0  # questions ask about v < high
    while state.bound < high and budget - state.spent > 1e-3 and undecided < MAX_UNDECIDED:
        v = (state.bound + high - 1) // 2
        state, decided = _ask(state, v, build, value_of,
                              min(PROBE_SHARE * limit, budget - state.spent), cp)
        high = min(high, state.value, v) if decided else v
        undecided = 0 if decided else undecided + 1
    return state


class _Subproblems(NamedTuple):
    """The smaller models the comm search solves besides the full one (``_solve_comm``)."""

    relaxation: Callable[[list[int] | None, str, int], BlockModel]
    """The relaxation of :mod:`.ilp_relax` with the fluid of a grain (``GRAINS``) and a floor
    on its critical-path KV, hinted with a placement of its blocks if given."""
    relaxed_value: Callable[[list[int]], int]
    """The critical-path KV of a placement of the relaxation's blocks."""
    relaxed_ranks: Callable[[list[int]], list[int]]
    """The placement of the relaxation's blocks in a placement of the full model's."""
    ends_bound: Callable[[int, float], tuple[int, float, bool]]
    """``ilp_ends.ends_bound`` on the longest doc, stopping at the given incumbent value,
    within the given deterministic seconds: the bound, the time spent and whether the
    deadline left it alone."""
    group_search: Callable[[_Search, float, float], _Search]
    """Improves the incumbent by ``ilp_lns.descend`` until the given deterministic second
    of the limit."""
    fill: Callable[[int, float], _Solve]
    """Asks, within the given deterministic seconds, the restricted model of
    :mod:`.ilp_fill` for a placement whose critical-path KV is at most the given value."""
    fill_first: bool
    """Whether the longest doc fits on a rank (at most T tokens): then the relaxation is
    usually solved, and the bound and the fill question come before the rank-group
    steps (``_solve_comm``)."""
    whole_docs: Callable[[float], _Solve]
    """Asks, within the given deterministic seconds, whether every doc can stay whole
    (``ilp_model.whole_doc_model``); a YES comes as a placement of the full model's blocks."""
    all_fit: bool
    """Whether every doc fits whole on a rank (tokens and workload): only then can every
    doc stay whole."""


def _ask_whole(state: _Search, subs: _Subproblems, limit_s: float,
               value_of: Callable[[list[int]], int]) -> _Search:
    """The question "can every doc stay whole?": YES is a placement of KV 0, NO raises the
    bound to 1."""
    run = subs.whole_docs(limit_s)
    state = state._replace(spent=state.spent + run.dtime,
                           deterministic=state.deterministic and run.deterministic)
    if run.status == "INFEASIBLE":
        return state._replace(bound=max(state.bound, 1))
    if run.ranks is not None:
        return state._replace(ranks=run.ranks, value=value_of(run.ranks), found=True)
    return state


def _fill(state: _Search, subs: _Subproblems, limit_s: float,
          value_of: Callable[[list[int]], int]) -> _Search:
    """The question of :mod:`.ilp_fill`: a placement within ``FILL_GAP`` of the bound (the
    largest v with (v - bound) / v < FILL_GAP)? A NO proves nothing about the full model."""
    v = math.ceil(state.bound / (1 - FILL_GAP)) - 1  # exact: FILL_GAP is a fraction
    if not 0 < state.bound <= v < state.value:
        return state
    run = subs.fill(v, limit_s)
    state = state._replace(spent=state.spent + run.dtime,
                           deterministic=state.deterministic and run.deterministic)
    if run.ranks is not None and value_of(run.ranks) < state.value:
        return state._replace(ranks=run.ranks, value=value_of(run.ranks), found=True)
    return state


def _relaxed_bound(build: Callable[[list[int] | None, str, int], BlockModel],
                   value_of: Callable[[list[int]], int], budget: float, limit: float,
                   cp: _Cp, hint: list[int], floor: int) -> tuple[int, float, bool]:
    """A proven lower bound on the full model's critical-path KV from the relaxations of
    :mod:`.ilp_relax`, at least ``floor`` (a bound already proven), within ``budget``
    deterministic seconds: first with the fluid as token positions, then, in what is
    left, as blocks with the first bound as a floor (the blocks' optimum is never below
    the positions'; CP-SAT can prove the looser bound where it cannot prove the tighter
    one in the same time, see :mod:`.ilp_relax`). Returns the bound, the time spent and
    whether every solve was deterministic."""
    bound, spent, deterministic = floor, 0.0, True
    for grain in GRAINS:
        if budget - spent <= 1e-3:
            break

        def model(ranks: list[int] | None, grain: str = grain, floor: int = bound) -> BlockModel:
            return build(ranks, grain, floor)

        stage, stage_spent, stage_deterministic = _relaxed_stage(
            model, value_of, budget - spent, limit, cp, hint)
        bound, spent = max(bound, stage), spent + stage_spent
        deterministic = deterministic and stage_deterministic
    return bound, spent, deterministic


def _relaxed_stage(build: Callable[[list[int] | None], BlockModel],
                   value_of: Callable[[list[int]], int], budget: float, limit: float,
                   cp: _Cp, hint: list[int]) -> tuple[int, float, bool]:
    """One relaxation's bound within ``budget``: one optimisation run, then the question
    "below its value?" (usually refuted at once, and then the relaxation is solved), then
    ``_bisect``. Returns the bound, the time spent and whether it was deterministic."""
    bm = build(hint)
    run = _run(bm, bm.comm_max, budget / 2, cp)
    if run.ranks is None:
        return run.bound, run.dtime, run.deterministic
    state = _Search(run.ranks, value_of(run.ranks), run.bound, run.dtime, run.deterministic)
    if state.bound < state.value and budget - state.spent > 1e-3:
        state, _ = _ask(state, state.value - 1, build, value_of,
                        min(PROBE_SHARE * limit, budget - state.spent), cp)
    state = _bisect(state, build, value_of, budget, limit, cp)
    return min(state.bound, state.value), state.spent, state.deterministic


def _progress(step: str, state: _Search) -> _Search:
    """Log ``PROGRESS`` for ``state`` after ``step``; returns ``state``."""
    log.debug(PROGRESS, step, state.value, state.bound, state.spent)
    return state


def _solve_comm(hint: list[int], build: Callable[[list[int]], BlockModel],
                value_of: Callable[[list[int]], int], subs: _Subproblems, limit: float,
                cp: _Cp) -> _Solve:
    """Minimise the critical-path KV in steps within ``limit`` deterministic seconds.

    0. If every doc fits whole on a rank, ask first whether every doc can stay whole (a
       packing model of its own, in ``ZERO_SHARE``): YES is optimal (KV 0).
    1. Search: rank-group steps from the hint (:mod:`.ilp_lns`), until ``GROUP_SHARE``;
       skipped where the longest doc fits on a rank (``fill_first``: there the bound
       below is usually solved, and step 2's question finds most placements).
    2. Bound: branch on the longest doc's ends (:mod:`.ilp_ends`, in ``ENDS_SHARE``),
       then, from that bound as a floor, solve the relaxations of :mod:`.ilp_relax` (the
       docs that cannot stay whole as blocks, the rest as a fluid of positions, then of
       blocks; ``_relaxed_bound``), hinted with the incumbent's blocks of those docs, in
       what is left of ``RELAX_SHARE`` (``FILL_RELAX_SHARE`` with ``fill_first``); these
       bounds hold for the full model, where CP-SAT's own LP bound is near 0. If the
       bound is 0 (and step 0 did not run), ask the question of step 0. With
       ``fill_first``, then ask the restricted model of :mod:`.ilp_fill` for a placement
       within ``FILL_GAP`` of the bound (``_fill``, until ``FILL_UNTIL`` of the limit, and
       for at least ``FILL_SHARE``).
    3. Search again with rank-group steps until ``SEARCH_SHARE``, then optimise the full
       model from the incumbent with ``comm_max >= bound`` (CP-SAT's LNS), leaving
       ``BISECT_SHARE`` of the limit.
    4. Spend the rest on ``_bisect`` questions, which raise the bound where the
       optimisation cannot.
    """
    state = _progress("hint", _Search(hint, value_of(hint), 0, 0.0, True))
    asked = subs.all_fit and state.value > 0
    if asked:  # cheap, and a YES ends the search
        state = _progress("whole docs", _ask_whole(state, subs, ZERO_SHARE * limit, value_of))
    if state.bound < state.value:
        if not subs.fill_first:
            state = _progress("rank groups", subs.group_search(
                state, GROUP_SHARE * limit, GROUP_STEP_SHARE * limit))
        bound, ends_spent, deterministic = subs.ends_bound(state.value, ENDS_SHARE * limit)
        state = _progress("ends", state._replace(
            bound=max(state.bound, bound), spent=state.spent + ends_spent,
            deterministic=state.deterministic and deterministic))
        if state.bound < state.value:
            share = FILL_RELAX_SHARE if subs.fill_first else RELAX_SHARE
            bound, spent, deterministic = _relaxed_bound(
                subs.relaxation, subs.relaxed_value, share * limit - ends_spent, limit,
                cp, subs.relaxed_ranks(state.ranks), state.bound)
            state = _progress("relaxation", state._replace(
                bound=max(state.bound, bound), spent=state.spent + spent,
                deterministic=state.deterministic and deterministic))
    if state.bound == 0 < state.value and not asked:
        state = _progress("whole docs", _ask_whole(state, subs, ZERO_SHARE * limit, value_of))
    if subs.fill_first and state.bound < state.value:
        state = _progress("fill", _fill(
            state, subs, max(FILL_SHARE * limit, FILL_UNTIL * limit - state.spent), value_of))
    if state.bound < state.value:
        state = _progress("rank groups", subs.group_search(
            state, SEARCH_SHARE * limit, GROUP_STEP_SHARE * limit))
    if state.bound < state.value and (1 - BISECT_SHARE) * limit > state.spent + 1e-3:
        bm = build(state.ranks)
        bm.model.Add(bm.comm_max >= state.bound)
        run = _run(bm, bm.comm_max, (1 - BISECT_SHARE) * limit - state.spent, cp)
        state = state._replace(spent=state.spent + run.dtime,
                               deterministic=state.deterministic and run.deterministic,
                               bound=max(state.bound, run.bound))
        if run.ranks is not None:
            state = state._replace(found=True)
            if value_of(run.ranks) < state.value:
                state = state._replace(ranks=run.ranks, value=value_of(run.ranks))
        _progress("full model", state)
    state = _progress("questions", _bisect(state, build, value_of, limit, limit, cp))
    bound = min(state.bound, state.value)
    status = "OPTIMAL" if bound == state.value else "FEASIBLE"
    if status == "FEASIBLE" and not state.found:
        return _Solve("UNKNOWN", None, 0, bound, state.spent, state.deterministic)
    return _Solve(status, state.ranks, state.value, bound, state.spent, state.deterministic)


def _subproblems(blocks: Blocks, doc_lengths: Sequence[int], n: int, tokens_cap: int, cap: int,
                 cp: _Cp) -> _Subproblems:
    """The subproblems of this instance (see ``_solve_comm``)."""
    kept = must_split(doc_lengths, tokens_cap, cap)
    keep = set(kept)
    relax_blocks = sub_blocks(blocks, kept)
    fluid = sub_blocks(blocks, [d for d in range(len(doc_lengths)) if d not in keep])

    def relaxation_model(ranks: list[int] | None, grain: str, floor: int) -> BlockModel:
        bm = relaxation(relax_blocks, fluid, n, token_cap=tokens_cap, work_cap=cap, grain=grain)
        if ranks is not None:
            add_hint(bm, relax_blocks, ranks, n)
        bm.model.Add(bm.comm_max >= floor)
        return bm

    def relaxed_ranks(ranks: list[int]) -> list[int]:
        return canonical_ranks(relax_blocks, [ranks[b] for d in kept for b in blocks.doc_runs[d]], n)

    def relaxed_value(ranks: list[int]) -> int:
        return max(placement_values(relax_blocks, ranks, n)[2])

    def whole_docs(limit_s: float) -> _Solve:
        model, y = whole_doc_model(doc_lengths, n, token_cap=tokens_cap, work_cap=cap)
        # A yes/no question: sequential search, as in ``_run``.
        solver, status, dtime, deterministic = _solve_model(model, limit_s, cp._replace(workers=1))
        if status not in ("OPTIMAL", "FEASIBLE"):
            return _Solve(status, None, 0, 0, dtime, deterministic)
        rank_of = _chosen(solver, y)
        ranks = canonical_ranks(blocks, [rank_of[block.doc] for block in blocks.blocks], n)
        return _Solve(status, ranks, 0, 0, dtime, deterministic)

    fluid_docs = [d for d in range(len(doc_lengths)) if d not in keep]

    def fill(v: int, limit_s: float) -> _Solve:
        if option_count(blocks, fluid_docs, n) > MAX_MODEL_BOOLS:
            return _Solve("UNKNOWN", None, 0, 0, 0.0, True)  # too large to be quick
        fm = fill_model(blocks, kept, fluid_docs, n, token_cap=tokens_cap, work_cap=cap)
        fm.model.Add(fm.comm_max <= v)
        # A yes/no question: sequential search, as in ``_run``.
        solver, status, dtime, deterministic = _solve_model(fm.model, limit_s,
                                                            cp._replace(workers=1))
        if status not in ("OPTIMAL", "FEASIBLE"):
            return _Solve(status, None, 0, 0, dtime, deterministic)
        chosen = [next(option for option, on in doc if solver.BooleanValue(on))
                  for doc in fm.options]
        ranks = fill_ranks(blocks, kept, fluid_docs, _chosen(solver, fm.kept_x), chosen)
        return _Solve(status, canonical_ranks(blocks, ranks, n), 0, 0, dtime, deterministic)

    def group_search(state: _Search, until: float, step_limit: float) -> _Search:
        def solve(gm: GroupModel, limit_s: float) -> Step:
            solver, status, dtime, det = _solve_model(gm.model, limit_s, cp)
            if status not in ("OPTIMAL", "FEASIBLE"):
                return Step(None, dtime, det, status == "INFEASIBLE")
            return Step([gm.group[j] for j in _chosen(solver, gm.x)], dtime, det,
                        status == "OPTIMAL")

        # The group model is hinted with the current placement, a solution of it: CP-SAT
        # 9.10 aborts the process when its interleaved search is hinted on a model it then
        # proves infeasible.
        ranks, spent, det = descend(blocks, state.ranks, n, token_cap=tokens_cap, work_cap=cap,
                                    budget=until - state.spent, step_limit=step_limit,
                                    solve=solve)
        ranks = canonical_ranks(blocks, ranks, n)
        value = max(placement_values(blocks, ranks, n)[2])
        state = state._replace(spent=state.spent + spent,
                               deterministic=state.deterministic and det)
        return state._replace(ranks=ranks, value=value, found=True) if value < state.value else state

    all_fit = all(length <= tokens_cap and doc_workload(length) <= cap for length in doc_lengths)
    longest = min(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
    doc = sub_blocks(blocks, [longest])
    others = sub_blocks(blocks, [d for d in range(len(doc_lengths)) if d != longest])

    def longest_ends(stop_at: int, budget: float) -> tuple[int, float, bool]:
        # The LPs' and the leaves' time as ``ilp_ends`` counts them.
        leaves = (1 - ENDS_LP_SHARE) * budget
        run = ends_bound(doc, others, n, token_cap=tokens_cap, work_cap=cap,
                         token_floor=token_floor(sum(doc_lengths), n, tokens_cap),
                         lp_budget_s=ENDS_LP_SHARE * budget, stop_at=stop_at,
                         leaf_limit_s=ENDS_LEAF_SHARE * leaves, leaf_budget_s=leaves,
                         deadline=cp.deadline)
        return run.bound, run.lp_seconds + run.leaf_seconds, run.deterministic

    return _Subproblems(relaxation_model, relaxed_value, relaxed_ranks, longest_ends, group_search,
                        fill, doc_lengths[longest] <= tokens_cap, whole_docs, all_fit)


def solve_blocks(
    doc_lengths: Sequence[int], num_ranks: int, target: float, options: IlpOptions
) -> IlpResult:
    """Place blocks optimally (or as well as the time limit allows); see the module docstring.

    Raises ValueError if R is below what integer tokens allow, or if CP-SAT proves that no
    placement at this granularity meets R.
    """
    n = num_ranks
    cp = _Cp.start(options.workers, options.time_limit_s)
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
            return max(placement_values(blocks, ranks, n)[2])

        if hint_ok:
            assert cap is not None
            run = _solve_comm(hint, hinted, comm_of,
                              _subproblems(blocks, doc_lengths, n, tokens_cap, cap, cp),
                              options.time_limit_s, cp)
        else:  # flashcp misses R: no incumbent to question from, and no hint: a hint that
            # breaks the model's caps, on a model CP-SAT proves infeasible, aborts CP-SAT
            # 9.10's interleaved search (see ``_subproblems``).
            bm = model()
            run = _run(bm, bm.comm_max, options.time_limit_s, cp)
        if run.status == "INFEASIBLE":
            raise ValueError(
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
    first = _run(bm, bm.work_max, options.time_limit_s / 2, cp)
    if first.ranks is None:
        return _finish(blocks, n, first, hint, max(hint_loads), max(hint_loads),
                       lambda ranks: max(placement_values(blocks, ranks, n)[1]), first.deterministic)
    best_work = first.value
    bm = model(extra_work_cap=best_work)
    add_hint(bm, blocks, first.ranks, n)
    rest = max(options.time_limit_s - first.dtime, options.time_limit_s / 2)
    second = _run(bm, bm.comm_max, rest, cp)
    ranks = second.ranks or first.ranks
    status = "OPTIMAL" if first.status == second.status == "OPTIMAL" else "FEASIBLE"
    return IlpResult(
        shards=block_shards(blocks, ranks, n),
        status=_status_name(status),
        objective_value=max(placement_values(blocks, ranks, n)[1]),  # <= best_work
        best_bound=first.bound,
        num_blocks=len(blocks.blocks),
        hint_value=max(hint_loads),
        deterministic=first.deterministic and second.deterministic,
    )


def _status_name(status: str) -> str:
    """The plan's status: CP-SAT's if it found a placement, else FALLBACK (the hint)."""
    return status if status in ("OPTIMAL", "FEASIBLE") else "FALLBACK"


def _finish(blocks: Blocks, n: int, run: _Solve, hint: list[int], hint_feasible_value: int | None,
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
    """The registry's entry point: options from the request, figures into the plan's info."""
    n = request.cp_size
    options = parse_options(request.options, doc_lengths, n)
    result = solve_blocks(doc_lengths, n, request.imbalance_target, options)
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


register(Strategy(
    name="ilp",
    description="OR-Tools CP-SAT block placement: min critical-path KV at imbalance <= R (or min "
    "max workload), flashcp as hint and fallback; status, bound and gap in the plan info",
    solver=ilp_layout,
    comm_mode="alltoallv",
    options=OPTIONS,
))
