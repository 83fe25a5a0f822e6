"""The ILP's restricted fill model (``ilp_fill``) against an enumeration of its options and
the brute-force optimum of the full block placement, on tiny instances."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, assume, event, given, settings
from ortools.sat.python import cp_model
from test_ilp_bruteforce import comm_case, tiny_instances

from planner_service.solvers import ilp
from planner_service.solvers.ilp.cpsat import Solve
from planner_service.solvers.ilp.fill import Option, fill_model, fill_ranks, option_count
from planner_service.solvers.ilp.model import placement_values, token_floor
from planner_service.solvers.ilp.relax import must_split, sub_blocks
from planner_service.solvers.ilp.search import ask_fill
from planner_service.solvers.ilp.subproblems import Search

MAX_ENUMERATED = 20_000
"""Placements of the kept blocks times option combinations enumerated per instance."""


def all_options(blocks, d: int, n: int) -> list[Option]:
    """Every option of fluid doc d, as the module docstring lists them."""
    run = blocks.doc_runs[d]
    edges = [blocks.blocks[b].end for b in run[:-1]]
    return [Option(r) for r in range(n)] + [
        Option(q, a, p) for a in edges for p in range(n) for q in range(n) if q != p]


def enumerated_optimum(case, kept, fluid) -> int | None:
    """The least critical-path KV over every placement the fill model allows (computed from
    the block placement itself), or None if none meets the caps."""
    n, blocks = case.n, case.blocks
    kept_blocks = len(sub_blocks(blocks, kept).blocks)
    floor = token_floor(sum(case.doc_lengths), n, case.tokens)
    best = None
    for kept_ranks in itertools.product(range(n), repeat=kept_blocks):
        for chosen in itertools.product(*(all_options(blocks, d, n) for d in fluid)):
            ranks = fill_ranks(blocks, kept, fluid, kept_ranks, chosen)
            tokens, loads, recv = placement_values(blocks, ranks, n)
            if min(tokens) < floor or max(tokens) > case.tokens or max(loads) > case.cap:
                continue
            best = max(recv) if best is None else min(best, max(recv))
    return best


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(tiny_instances())
def test_fill_model_optimum_is_its_enumerated_optimum_and_never_below_the_full_one(instance):
    case = comm_case(instance)
    n, blocks = case.n, case.blocks
    kept = must_split(case.doc_lengths, case.tokens, case.cap)
    fluid = [d for d in range(len(case.doc_lengths)) if d not in set(kept)]
    size = n ** len(sub_blocks(blocks, kept).blocks)
    for d in fluid:
        size *= len(all_options(blocks, d, n))
    assume(size <= MAX_ENUMERATED)
    expected = enumerated_optimum(case, kept, fluid)

    fm = fill_model(blocks, kept, fluid, n, token_cap=case.tokens, work_cap=case.cap)
    assert option_count(blocks, fluid, n) == sum(len(doc) for doc in fm.options)
    fm.model.Minimize(fm.comm_max)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    status = solver.Solve(fm.model)
    event(f"fill {'none' if expected is None else 'found'}")
    if expected is None:
        assert status == cp_model.INFEASIBLE
        return
    assert status == cp_model.OPTIMAL
    assert solver.ObjectiveValue() == expected
    # A restriction of the full model: never below its optimum.
    assert expected >= case.optimum
    event(f"fill optimum {'=' if expected == case.optimum else '>'} full optimum")
    event(f"fluid docs with a cut option: {sum(len(blocks.doc_runs[d]) > 1 for d in fluid)}")
    # The solution read back is a block placement within the caps, with that KV exactly.
    chosen = [next(o for o, on in doc if solver.BooleanValue(on)) for doc in fm.options]
    kept_ranks = [next(r for r, on in enumerate(row) if solver.BooleanValue(on)) for row in fm.kept_x]
    tokens, loads, recv = placement_values(blocks, fill_ranks(blocks, kept, fluid, kept_ranks, chosen), n)
    assert max(tokens) <= case.tokens and max(loads) <= case.cap
    assert max(recv) == expected


def test_fill_question_asks_for_the_largest_value_within_the_gap():
    # v is the largest value with (v - bound) / v < 1%, exactly: 99 -> 99 (100 would be a
    # gap of exactly 1%), 100 -> 101; no question once the incumbent is already within it.
    asked = []

    class Subs:
        def fill(self, v, limit_s):
            asked.append(v)
            return Solve("UNKNOWN", None, 0, 0, 0.5, True)

    for bound, v in ((99, 99), (100, 101), (16384, 16549), (9900, 9999)):
        state = Search([0], 10**6, bound, 0.0, True)
        after = ask_fill(state, Subs(), 1.0, lambda ranks: 10**6, ilp.TUNING.fill_gap)
        assert asked[-1] == v and after.spent == 0.5 and after.value == 10**6
        assert (v - bound) / v < 0.01 <= (v + 1 - bound) / (v + 1)
    asked.clear()
    assert ask_fill(Search([0], 101, 100, 0.0, True), Subs(), 1.0, len, ilp.TUNING.fill_gap).spent == 0.0
    assert ask_fill(Search([0], 10, 0, 0.0, True), Subs(), 1.0, len, ilp.TUNING.fill_gap).spent == 0.0
    assert not asked
