"""The ILP's relaxations (``ilp_relax``): their fluid bounds against enumerations of block
sets and of token positions, and their optima in order: positions <= blocks <= the
brute-force optimum of the full block placement."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model
from test_ilp_bruteforce import brute_force, comm_case, instance_blocks, tiny_instances

from planner_service.core.cost import doc_workload
from planner_service.core.plan import Shard
from planner_service.solvers.ilp import workload_cap
from planner_service.solvers.ilp.blocks import Blocks
from planner_service.solvers.ilp.model import whole_doc_model
from planner_service.solvers.ilp.relax import (
    GRAINS,
    MAX_LEVELS,
    block_costs,
    cost_levels,
    fluid_tangents,
    must_split,
    position_tangents,
    relaxation,
    sub_blocks,
)


@st.composite
def fluid_blocks(draw):
    """1 to 4 docs of 1 to 40 tokens, each cut at up to 2 random positions (<= 12 blocks)."""
    blocks, runs = [], []
    for doc, length in enumerate(draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))):
        cuts = draw(st.sets(st.integers(1, length - 1), max_size=2)) if length > 1 else set()
        edges = [0, *sorted(cuts), length]
        runs.append(range(len(blocks), len(blocks) + len(edges) - 1))
        blocks.extend(Shard(doc, a, b) for a, b in itertools.pairwise(edges))
    return Blocks(tuple(blocks), tuple(runs))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(fluid_blocks())
def test_fluid_tangents_bound_every_set_of_blocks(fluid):
    # Any set of the fluid's blocks (the full model places blocks whole, a doc's in any
    # split) weighs between the least and the greatest workload of a set with its tokens,
    # which the tangent lines must bound.
    costs = block_costs(fluid)
    least: dict[int, int] = {}
    most: dict[int, int] = {}
    for size in range(len(costs) + 1):
        for chosen in itertools.combinations(costs, size):
            tokens, work = sum(t for t, _ in chosen), sum(w for _, w in chosen)
            least[tokens] = min(least.get(tokens, work), work)
            most[tokens] = max(most.get(tokens, work), work)
    low, high = fluid_tangents(fluid)
    for tokens in least:
        assert max(a * tokens + b for a, b in low) <= least[tokens]
        assert min(a * tokens + b for a, b in high) >= most[tokens]
    # Tight where a line touches: at slope c, the blocks cheaper than c per token are the
    # least workload for their tokens, and the lower line passes through them.
    for c, intercept in low:
        cheap = [(t, w) for t, w in costs if w < c * t]
        tokens = sum(t for t, _ in cheap)
        assert c * tokens + intercept == least[tokens] == sum(w for _, w in cheap)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6))
def test_position_tangents_bound_every_set_of_positions(lengths):
    # Position p of a doc costs p + 1; any tau positions cost between the tau cheapest and
    # the tau dearest of all of them, which the tangent lines must bound.
    costs = sorted(c for length in lengths for c in range(1, length + 1))
    low, high = position_tangents(lengths)
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
def test_relaxation_optima_never_exceed_the_full_optimum(instance):
    case = comm_case(instance)
    doc_lengths, n, cap, blocks, expected = (case.doc_lengths, case.n, case.cap, case.blocks,
                                             case.optimum)
    kept = must_split(doc_lengths, case.tokens, cap)
    fluid = sub_blocks(blocks, [d for d in range(len(doc_lengths)) if d not in kept])
    optimum = {}
    for grain in GRAINS:
        bm = relaxation(sub_blocks(blocks, kept), fluid, n, token_cap=case.tokens,
                        work_cap=cap, grain=grain)
        bm.model.Minimize(bm.comm_max)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        status = solver.Solve(bm.model)
        assert solver.StatusName(status) == "OPTIMAL"
        optimum[grain] = solver.ObjectiveValue()
    event(f"fluid docs {len(fluid.doc_runs)}, relaxation {'0' if optimum['blocks'] == 0 else '> 0'}, "
          f"blocks {'tight' if optimum['blocks'] == expected else 'below'}, "
          f"positions {'tight' if optimum['positions'] == expected else 'below'}")
    # The blocks' optimum is the tighter bound, and the positions' may be its floor.
    assert optimum["positions"] <= optimum["blocks"] <= expected


def test_the_blocks_bound_is_tighter_where_a_rank_cannot_take_part_of_a_small_doc():
    # Docs 7, 3, 4 on 2 ranks (T = 7, cap 23, granularity 4): doc 0 (workload 28) must be
    # split; doc 1 is one block, but the positions fluid may put its cheap first tokens on
    # one rank and the rest on the other. Found by a random search over tiny instances.
    doc_lengths, n, target, g = [7, 3, 4], 2, 1.05, 4
    cap = workload_cap(doc_lengths, n, target)
    blocks = instance_blocks(doc_lengths, n, target, g)
    kept = must_split(doc_lengths, 7, cap)
    fluid = sub_blocks(blocks, [d for d in range(len(doc_lengths)) if d not in kept])
    optimum = {}
    for grain in GRAINS:
        bm = relaxation(sub_blocks(blocks, kept), fluid, n, token_cap=7, work_cap=cap, grain=grain)
        bm.model.Minimize(bm.comm_max)
        solver = cp_model.CpSolver()
        assert solver.StatusName(solver.Solve(bm.model)) == "OPTIMAL"
        optimum[grain] = solver.ObjectiveValue()
    assert optimum == {"positions": 2, "blocks": 3}
    assert brute_force(doc_lengths, n, target, g).comm == 3


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
