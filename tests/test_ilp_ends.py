"""The bound by branching on the longest doc's ends (``ilp_ends``): never above the brute-force
optimum, and, searched to the end, equal to its slow reference (every leaf solved exactly)."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, event, given, settings
from ortools.sat.python import cp_model
from test_ilp_bruteforce import comm_case, tiny_instances

from planner_service.solvers.ilp.blocks import Blocks
from planner_service.solvers.ilp.ends import Leaves, ends_bound, ends_data
from planner_service.solvers.ilp.model import token_floor
from planner_service.solvers.ilp.relax import sub_blocks

UNLIMITED = 10**9


def split_longest(doc_lengths: list[int], blocks: Blocks) -> tuple[Blocks, Blocks]:
    longest = min(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
    return (sub_blocks(blocks, [longest]),
            sub_blocks(blocks, [d for d in range(len(doc_lengths)) if d != longest]))


def every_leaf_optimum(doc: Blocks, fluid: Blocks, n: int, tokens: int, cap: int,
                       floor: int) -> int | None:
    """The slow reference: every tuple of ends (ranks sorted by end, nonzero ends rising
    strictly, the last at L) solved exactly; the least optimum (None if none is feasible)."""
    top = len(doc.blocks)
    leaves = Leaves(ends_data(doc, fluid), n, token_cap=tokens, work_cap=cap, token_floor=floor)
    best = None
    for ends in itertools.product(range(top + 1), repeat=n - 1):
        nonzero = [e for e in ends if e > 0]
        if list(ends) != sorted(ends) or len(set(nonzero)) < len(nonzero) or top in ends:
            continue
        model, _ = leaves.model([*ends, top])
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        status = solver.StatusName(solver.Solve(model))
        assert status in ("OPTIMAL", "INFEASIBLE")
        if status == "OPTIMAL" and (best is None or solver.ObjectiveValue() < best):
            best = round(solver.ObjectiveValue())
    return best


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(tiny_instances())
def test_ends_bound_never_exceeds_the_full_optimum_and_equals_every_leaf_solved(instance):
    case = comm_case(instance)
    floor = token_floor(sum(case.doc_lengths), case.n, case.tokens)
    doc, fluid = split_longest(case.doc_lengths, case.blocks)
    run = ends_bound(doc, fluid, case.n, token_cap=case.tokens, work_cap=case.cap,
                     token_floor=floor, lp_budget_s=UNLIMITED, stop_at=UNLIMITED,
                     leaf_limit_s=10.0, leaf_budget_s=UNLIMITED)
    reference = every_leaf_optimum(doc, fluid, case.n, case.tokens, case.cap, floor)
    event(f"ends bound {'tight' if run.bound == case.optimum else 'below'}")
    assert reference is not None  # the full optimum's own ends are a feasible leaf
    assert run.bound == reference <= case.optimum


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(tiny_instances())
def test_ends_bound_stops_at_the_incumbent_and_when_its_lp_budget_is_spent(instance):
    case = comm_case(instance)
    doc, fluid = split_longest(case.doc_lengths, case.blocks)
    kwargs = dict(token_cap=case.tokens, work_cap=case.cap,
                  token_floor=token_floor(sum(case.doc_lengths), case.n, case.tokens),
                  leaf_limit_s=10.0, leaf_budget_s=UNLIMITED)
    full = ends_bound(doc, fluid, case.n, lp_budget_s=UNLIMITED, stop_at=UNLIMITED, **kwargs)
    assert ends_bound(doc, fluid, case.n, lp_budget_s=UNLIMITED, stop_at=0, **kwargs).bound == 0
    root = ends_bound(doc, fluid, case.n, lp_budget_s=0.0, stop_at=UNLIMITED, **kwargs)
    assert root.nodes == 1 and root.lp_seconds > 0
    assert root.bound <= full.bound <= case.optimum
    assert full.lp_seconds >= root.lp_seconds
