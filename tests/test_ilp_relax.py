"""The ILP's relaxation (``ilp_relax``): its fluid bounds against enumeration, and its
optimum never above the brute-force optimum of the full block placement."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model
from test_ilp_bruteforce import MAX_BLOCKS, brute_force, instance_blocks, tiny_instances

from planner_service.core.cost import doc_workload
from planner_service.solvers.ilp import workload_cap
from planner_service.solvers.ilp_model import whole_doc_model
from planner_service.solvers.ilp_relax import (
    MAX_LEVELS,
    cheapest_tangents,
    cost_levels,
    dearest_tangents,
    must_split,
    relaxation,
    sub_blocks,
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6))
def test_fluid_tangents_bound_every_set_of_positions(lengths):
    # Position p of a doc costs p + 1; any tau positions cost between the tau cheapest and
    # the tau dearest of all of them, which the tangent lines must bound.
    costs = sorted(c for length in lengths for c in range(1, length + 1))
    low, high = cheapest_tangents(lengths), dearest_tangents(lengths)
    for tau in range(len(costs) + 1):
        cheapest, dearest = sum(costs[:tau]), sum(costs[len(costs) - tau:])
        assert max(a * tau + b for a, b in low) <= cheapest
        assert min(a * tau + b for a, b in high) >= dearest
    # Tight where a line touches: at tau(c) the lower line equals the cheapest cost.
    for c, (a, b) in zip(cost_levels(lengths), low, strict=True):
        tau = sum(min(length, c) for length in lengths)
        assert a * tau + b == sum(costs[:tau])


def test_cost_levels_are_thinned_but_keep_the_largest():
    lengths = list(range(1, 500, 3))
    levels = cost_levels(lengths)
    assert len(levels) <= MAX_LEVELS + 1 and levels[-1] == max(lengths)
    assert levels == sorted(set(levels))


def test_must_split_lists_docs_no_rank_holds_whole_and_the_longest():
    # T = 10, cap 30: doc 1 has 11 tokens, doc 2 weighs 36 > 30, doc 0 (5 tokens) fits.
    assert must_split([5, 11, 8, 3], 10, 30) == [1, 2]
    assert must_split([4, 4, 2], 10, 30) == [0]


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(tiny_instances())
def test_relaxation_optimum_never_exceeds_the_full_optimum(instance):
    doc_lengths, n, target, g = instance
    try:
        cap = workload_cap(doc_lengths, n, target)
    except ValueError:
        assume(False)
    blocks = instance_blocks(doc_lengths, n, target, g)
    assume(len(blocks.blocks) <= MAX_BLOCKS[n])
    expected = brute_force(doc_lengths, n, target, g).comm
    assume(expected is not None)
    kept = must_split(doc_lengths, -(-sum(doc_lengths) // n), cap)
    fluid = [length for d, length in enumerate(doc_lengths) if d not in kept]
    bm = relaxation(sub_blocks(blocks, kept), fluid, n, token_cap=-(-sum(doc_lengths) // n),
                    work_cap=cap)
    bm.model.Minimize(bm.comm_max)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    status = solver.Solve(bm.model)
    assert solver.StatusName(status) == "OPTIMAL"
    event(f"fluid docs {len(fluid)}, relaxation {'0' if solver.ObjectiveValue() == 0 else '> 0'}, "
          f"{'tight' if solver.ObjectiveValue() == expected else 'below'}")
    assert solver.ObjectiveValue() <= expected


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(2, 3), st.lists(st.integers(1, 9), min_size=1, max_size=6),
       st.sampled_from([1.0, 1.05, 1.2, 1.5]))
def test_whole_doc_question_agrees_with_enumeration(n, doc_lengths, target):
    try:
        cap = workload_cap(doc_lengths, n, target)
    except ValueError:
        assume(False)
    tokens = -(-sum(doc_lengths) // n)
    expected = any(
        all(sum(length for length, rank in zip(doc_lengths, ranks, strict=True) if rank == r) <= tokens
            and sum(doc_workload(length) for length, rank in zip(doc_lengths, ranks, strict=True)
                    if rank == r) <= cap for r in range(n))
        for ranks in itertools.product(range(n), repeat=len(doc_lengths)))
    model, y = whole_doc_model(doc_lengths, n, token_cap=tokens, work_cap=cap)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    status = solver.StatusName(solver.Solve(model))
    event(f"whole docs {'yes' if expected else 'no'}")
    assert status == ("OPTIMAL" if expected else "INFEASIBLE")
