"""The ILP's search for the comm objective: a proven bound and an incumbent, in steps.

CP-SAT's LP bound on a maximum of received KV is near 0 (the LP spreads every block over
all ranks), so the bound comes from smaller models (:mod:`.subproblems`): a branch and
bound on where each rank's part of the longest doc ends (:mod:`.ends`), a relaxation
(:mod:`.relax`) solved to optimality where the time allows, and the question "can every
doc stay whole?". Placements come from a restricted model asked for one within
``Tuning.fill_gap`` of the bound (:mod:`.fill`), from rank-group steps (:mod:`.lns`),
then from CP-SAT's LNS on the full model; a last bisection of yes/no questions "is there
a placement whose critical-path KV is at most v?" raises the bound. ``solve_comm`` gives
the order and the shares of the time limit (:mod:`.tuning`); it logs ``PROGRESS`` at
DEBUG after each step.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from fractions import Fraction

from planner_service.solvers.ilp import cpsat
from planner_service.solvers.ilp.cpsat import Cp, Solve
from planner_service.solvers.ilp.model import BlockModel
from planner_service.solvers.ilp.relax import GRAINS
from planner_service.solvers.ilp.subproblems import Search, Subproblems

log = logging.getLogger(__name__)
PROGRESS = "ilp progress: %s: value %d, bound %d, %.3f deterministic s"
"""The DEBUG record ``solve_comm`` logs after each step (args: the step's name, the
incumbent's critical-path KV, the proven bound and the deterministic seconds spent), so
an operator or a benchmark (``bench.ilp_compare``: the wall time at which the gap first
fell under 1%) can follow the search; the plan itself carries no timings."""

SMALL_GRAINS = GRAINS[:1]
"""The relaxation's grains on a small model (``Tuning.small_bools``): the fluid as
positions only. On every small cell of ``bench.ilp_small`` (5 instances at N = 2 and 4)
the blocks' grain proves the same bound as the positions' and costs as much again (4 docs
of 7K tokens at N = 4: 1585 after 0.024 deterministic seconds each); the closing
minimisation needs that time."""


def ask(state: Search, v: int, build: Callable[[list[int]], BlockModel],
         value_of: Callable[[list[int]], int], limit: float, cp: Cp) -> tuple[Search, bool]:
    """One yes/no question: is there a placement whose critical-path KV is at most v?
    Returns the new state and whether the question was decided."""
    bm = build(state.ranks)
    bm.model.Add(bm.comm_max <= v)
    run = cpsat.run(bm, None, limit, cp)
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


def close(state: Search, build: Callable[[list[int]], BlockModel],
          value_of: Callable[[list[int]], int], limit: float, cp: Cp, *,
          small: bool = False) -> Search:
    """The least critical-path KV below the incumbent's, within ``limit`` deterministic
    seconds: the full model with ``bound <= comm_max < value``, minimised by CP-SAT's
    sequential search with the fullest linearisation (``cpsat.run``'s ``sequential``).

    Why: where the proven bound is already close to the incumbent (small instances),
    this is the cheapest proof of optimality (4 docs of 7K tokens at N = 4: 0.3 to 0.6
    deterministic seconds, where the default search needs 2). Unhinted: the incumbent
    breaks ``comm_max < value``, and a sequential search has no use for an infeasible
    hint. INFEASIBLE proves the incumbent optimal; a placement found replaces it.
    ``small``: a small model (``Tuning.small_bools``), solved without cut rounds at the
    default linearisation (``cpsat.SMALL_CUT_LEVEL``, ``cpsat.SMALL_LINEARIZATION``;
    the same proof at N = 4: about 0.1 deterministic seconds). Cost: one CP-SAT solve of
    the full model, at most ``limit``."""
    bm = build(state.ranks)
    bm.model.ClearHints()
    bm.model.Add(bm.comm_max <= state.value - 1)
    bm.model.Add(bm.comm_max >= state.bound)
    run = cpsat.run(bm, bm.comm_max, limit, cp, sequential=True, small=small)
    state = state._replace(spent=state.spent + run.dtime,
                           deterministic=state.deterministic and run.deterministic)
    if run.status == "INFEASIBLE":
        return state._replace(bound=state.value)
    if run.ranks is not None and value_of(run.ranks) < state.value:
        state = state._replace(ranks=run.ranks, value=value_of(run.ranks), found=True)
    return state._replace(bound=max(state.bound, min(run.bound, state.value)))


def bisect_bound(state: Search, build: Callable[[list[int]], BlockModel],
                 value_of: Callable[[list[int]], int], budget: float, limit: float,
                 cp: Cp) -> Search:
    """Narrow [bound, value) with yes/no questions at its midpoint until ``budget``
    deterministic seconds are spent or ``Tuning.max_undecided`` questions in a row stay open.

    Why: CP-SAT's LP bound on a maximum of received KV is weak (the relaxation spreads
    every block over all ranks and proves little above 0), but with ``comm_max <= v`` as
    a hard constraint propagation is strong: a v well below the optimum is refuted in a
    fraction of a second. YES moves the incumbent down, NO moves the bound up to v + 1,
    and an undecided v is not asked again: the next question is the midpoint of the lower
    half, which can still raise the bound.
    """
    t = cp.tuning
    high, undecided = state.value, 0  # questions ask about v < high
    while state.bound < high and budget - state.spent > 1e-3 and undecided < t.max_undecided:
        if time.monotonic() >= cp.deadline:
            return state._replace(deterministic=False)
        v = (state.bound + high - 1) // 2
        state, decided = ask(state, v, build, value_of,
                             min(t.probe_share * limit, budget - state.spent), cp)
        high = min(high, state.value, v) if decided else v
        undecided = 0 if decided else undecided + 1
    return state


def ask_whole(state: Search, subs: Subproblems, limit_s: float,
              value_of: Callable[[list[int]], int]) -> Search:
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


def ask_fill(state: Search, subs: Subproblems, limit_s: float,
             value_of: Callable[[list[int]], int], gap: Fraction) -> Search:
    """The question of :mod:`.fill`: a placement within ``gap`` of the bound (the largest
    v with (v - bound) / v < gap)? A NO proves nothing about the full model."""
    v = math.ceil(state.bound / (1 - gap)) - 1  # exact: the gap is a fraction
    if not 0 < state.bound <= v < state.value:
        return state
    run = subs.fill(v, limit_s)
    state = state._replace(spent=state.spent + run.dtime,
                           deterministic=state.deterministic and run.deterministic)
    if run.ranks is not None and value_of(run.ranks) < state.value:
        return state._replace(ranks=run.ranks, value=value_of(run.ranks), found=True)
    return state


def relaxed_bound(build: Callable[[list[int] | None, str, int], BlockModel],
                  value_of: Callable[[list[int]], int], budget: float, limit: float,
                  cp: Cp, hint: list[int], floor: int,
                  grains: tuple[str, ...] = GRAINS) -> tuple[int, float, bool]:
    """A proven lower bound on the full model's critical-path KV from the relaxations of
    :mod:`.relax`, at least ``floor`` (a bound already proven), within ``budget``
    deterministic seconds: first with the fluid as token positions, then, in what is
    left, as blocks with the first bound as a floor (the blocks' optimum is never below
    the positions'; CP-SAT can prove the looser bound where it cannot prove the tighter
    one in the same time, see :mod:`.relax`); ``grains``: those of ``GRAINS`` to solve,
    in this order. Returns the bound, the time spent and whether every solve was
    deterministic."""
    bound, spent, deterministic = floor, 0.0, True
    for grain in grains:
        if budget - spent <= 1e-3:
            break

        def model(ranks: list[int] | None, grain: str = grain, floor: int = bound) -> BlockModel:
            return build(ranks, grain, floor)

        stage, stage_spent, stage_deterministic = relaxed_stage(
            model, value_of, budget - spent, limit, cp, hint)
        bound, spent = max(bound, stage), spent + stage_spent
        deterministic = deterministic and stage_deterministic
    return bound, spent, deterministic


def relaxed_stage(build: Callable[[list[int] | None], BlockModel],
                  value_of: Callable[[list[int]], int], budget: float, limit: float,
                  cp: Cp, hint: list[int]) -> tuple[int, float, bool]:
    """One relaxation's bound within ``budget``: one optimisation run, then the question
    "below its value?" (usually refuted at once, and then the relaxation is solved), then
    ``bisect_bound``. Returns the bound, the time spent and whether it was deterministic."""
    t = cp.tuning
    bm = build(hint)
    run = cpsat.run(bm, bm.comm_max, budget / 2, cp)
    if run.ranks is None:
        return run.bound, run.dtime, run.deterministic
    state = Search(run.ranks, value_of(run.ranks), run.bound, run.dtime, run.deterministic)
    if state.bound < state.value and budget - state.spent > 1e-3:
        state, _ = ask(state, state.value - 1, build, value_of,
                       min(t.probe_share * limit, budget - state.spent), cp)
    state = bisect_bound(state, build, value_of, budget, limit, cp)
    return min(state.bound, state.value), state.spent, state.deterministic


def progress(step: str, state: Search) -> Search:
    """Log ``PROGRESS`` for ``state`` after ``step``; returns ``state``."""
    log.debug(PROGRESS, step, state.value, state.bound, state.spent)
    return state


def solve_comm(hint: list[int], build: Callable[[list[int]], BlockModel],
               value_of: Callable[[list[int]], int], subs: Subproblems, limit: float,
               cp: Cp) -> Solve:
    """Minimise the critical-path KV in steps within ``limit`` deterministic seconds.

    0. If every doc fits whole on a rank, ask first whether every doc can stay whole (a
       packing model of its own, in ``zero_share``): YES is optimal (KV 0).
    1. Search: rank-group steps from the hint (:mod:`.lns`), until ``group_share``;
       skipped where the longest doc fits on a rank (``fill_first``: there the bound
       below is usually solved, and step 2's question finds most placements).
    2. Bound: branch on the longest doc's ends (:mod:`.ends`, in ``ends_share``),
       then, from that bound as a floor, solve the relaxations of :mod:`.relax` (the
       docs that cannot stay whole as blocks, the rest as a fluid of positions, then of
       blocks; ``relaxed_bound``), hinted with the incumbent's blocks of those docs, in
       what is left of ``relax_share`` (``fill_relax_share`` with ``fill_first``); these
       bounds hold for the full model, where CP-SAT's own LP bound is near 0. A small
       model (``Subproblems.small``) skips the ends and solves the positions' relaxation
       only (``SMALL_GRAINS``): there the relaxation, whose longest doc stays blocks,
       reaches the same bound alone (every small cell of ``bench.ilp_small``), and the
       closing minimisation below needs the time. If the bound is 0 (and step 0 did not
       run), ask the question of step 0. With
       ``fill_first``, then ask the restricted model of :mod:`.fill` for a placement
       within ``fill_gap`` of the bound (``ask_fill``, until ``fill_until`` of the limit, and
       for at least ``fill_share``).
    3. Search again with rank-group steps until ``search_share`` (on a small model for
       at most ``small_group_share``), then optimise the full model from the incumbent
       with ``comm_max >= bound`` (CP-SAT's LNS), leaving ``bisect_share`` of the limit.
    4. Spend the rest on ``bisect_bound`` questions, which raise the bound where the
       optimisation cannot.

    Between 2 and 3: where the gap is at most ``close_gap``, the least placement below
    the incumbent (``close``) with the whole rest of the limit: INFEASIBLE proves the
    incumbent optimal, an OPTIMAL answer is the optimum; either ends the search. A small
    model (``Subproblems.small``) is closed without cut rounds, also at a larger gap
    where the longest doc fits on a rank (in at most ``small_close_share``), and again
    after the rank-group steps of 3 where the gap is then at most ``close_gap``.

    A step due after the wall-clock deadline (``cp.deadline``) is skipped (the models cost
    Python time to build even where CP-SAT would stop at once) and the result says it is
    not deterministic.
    """
    t = cp.tuning
    skipped = False

    def late() -> bool:
        nonlocal skipped
        skipped = skipped or time.monotonic() >= cp.deadline
        return skipped

    def near(state: Search) -> bool:  # the gap is at most ``close_gap``
        return (state.value - state.bound) * t.close_gap.denominator \
            <= t.close_gap.numerator * state.value

    state = progress("hint", Search(hint, value_of(hint), 0, 0.0, True))
    asked = subs.all_fit and state.value > 0
    if asked:  # cheap, and a YES ends the search
        state = progress("whole docs", ask_whole(state, subs, t.zero_share * limit, value_of))
    if state.bound < state.value and not late():
        if not subs.fill_first:
            state = progress("rank groups", subs.group_search(
                state, t.group_share * limit, t.group_step_share * limit))
        ends_spent = 0.0
        if not subs.small:
            bound, ends_spent, deterministic = subs.ends_bound(state.value, t.ends_share * limit)
            state = progress("ends", state._replace(
                bound=max(state.bound, bound), spent=state.spent + ends_spent,
                deterministic=state.deterministic and deterministic))
        if state.bound < state.value and not late():
            share = t.fill_relax_share if subs.fill_first else t.relax_share
            bound, spent, deterministic = relaxed_bound(
                subs.relaxation, subs.relaxed_value, share * limit - ends_spent, limit,
                cp, subs.relaxed_ranks(state.ranks), state.bound,
                SMALL_GRAINS if subs.small else GRAINS)
            state = progress("relaxation", state._replace(
                bound=max(state.bound, bound), spent=state.spent + spent,
                deterministic=state.deterministic and deterministic))
    if state.bound == 0 < state.value and not asked and not late():
        state = progress("whole docs", ask_whole(state, subs, t.zero_share * limit, value_of))
    if subs.fill_first and state.bound < state.value and not late():
        state = progress("fill", ask_fill(
            state, subs, max(t.fill_share * limit, t.fill_until * limit - state.spent), value_of,
            t.fill_gap))
    if state.bound < state.value and not late() and limit - state.spent > 1e-3 \
            and (near(state) or subs.small and subs.fill_first):
        share = limit - state.spent if near(state) else t.small_close_share * limit
        state = progress("below the incumbent", close(
            state, build, value_of, min(share, limit - state.spent), cp, small=subs.small))
    if state.bound < state.value and not late():
        until = t.search_share * limit
        if subs.small:  # the closing minimisation after them gets the rest
            until = min(until, state.spent + t.small_group_share * limit)
        state = progress("rank groups", subs.group_search(
            state, until, t.group_step_share * limit))
    if subs.small and state.bound < state.value and near(state) and not late() \
            and limit - state.spent > 1e-3:
        state = progress("below the incumbent", close(
            state, build, value_of, limit - state.spent, cp, small=True))
    if state.bound < state.value and (1 - t.bisect_share) * limit > state.spent + 1e-3 \
            and not late():
        bm = build(state.ranks)
        bm.model.Add(bm.comm_max >= state.bound)
        run = cpsat.run(bm, bm.comm_max, (1 - t.bisect_share) * limit - state.spent, cp)
        state = state._replace(spent=state.spent + run.dtime,
                               deterministic=state.deterministic and run.deterministic,
                               bound=max(state.bound, run.bound))
        if run.ranks is not None:
            state = state._replace(found=True)
            if value_of(run.ranks) < state.value:
                state = state._replace(ranks=run.ranks, value=value_of(run.ranks))
        progress("full model", state)
    state = progress("questions", bisect_bound(state, build, value_of, limit, limit, cp))
    if skipped:
        state = state._replace(deterministic=False)
    bound = min(state.bound, state.value)
    status = "OPTIMAL" if bound == state.value else "FEASIBLE"
    if status == "FEASIBLE" and not state.found:
        return Solve("UNKNOWN", None, 0, bound, state.spent, state.deterministic)
    return Solve(status, state.ranks, state.value, bound, state.spent, state.deterministic)
