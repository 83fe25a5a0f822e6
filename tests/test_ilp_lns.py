"""Rank-group steps (``ilp_lns``): the group model's figures against ``placement_values``,
and a descent that never loses a token, breaks a cap or raises the objective."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from planner_service.core.cost import doc_workload
from planner_service.solvers.ilp.blocks import cut_blocks
from planner_service.solvers.ilp.lns import GroupModel, Step, descend, group_model, groups_of
from planner_service.solvers.ilp.model import placement_values


@st.composite
def placements(draw):
    """Random docs cut in blocks of g, a random placement, and a group of its ranks."""
    n = draw(st.integers(2, 5))
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    blocks = cut_blocks(lengths, draw(st.integers(2, 16)), head_docs=())
    ranks = draw(st.lists(st.integers(0, n - 1), min_size=len(blocks.blocks),
                          max_size=len(blocks.blocks)))
    group = draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=min(3, n), unique=True))
    return lengths, blocks, n, ranks, group


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(placements(), st.data())
def test_group_model_receives_exactly_what_the_placement_receives(case, data):
    # Any re-placement of the group's blocks among its ranks, fixed in the model, gives per
    # group rank the KV placement_values computes for the moved placement. Caps are loose
    # so every re-placement is feasible; the model's own hint bound (group max <= now) is
    # lifted by fixing below it only when the move keeps it.
    lengths, blocks, n, ranks, group = case
    loose = sum(lengths)
    gm = group_model(blocks, ranks, n, group, token_cap=loose,
                     work_cap=sum(doc_workload(length) for length in lengths))
    moved = list(ranks)
    for b in gm.free:
        moved[b] = data.draw(st.sampled_from(gm.group))
    _, _, now = placement_values(blocks, ranks, n)
    _, _, after = placement_values(blocks, moved, n)
    for i, b in enumerate(gm.free):
        for j, r in enumerate(gm.group):
            gm.model.Add(gm.x[i][j] == int(moved[b] == r))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    status = solver.Solve(gm.model)
    # Symmetry breaking admits only some moves; and the group's max may not rise above
    # its current one.
    ordered = _first_use_ordered(gm, moved)
    within = max(after[r] for r in gm.group) <= max(now[r] for r in gm.group)
    if not (ordered and within):
        assert status == cp_model.INFEASIBLE
        return
    assert status == cp_model.OPTIMAL
    assert [solver.Value(v) for v in gm.recv] == [after[r] for r in gm.group]
    # The other ranks' receive is unchanged by any move within the group.
    assert all(after[r] == now[r] for r in range(n) if r not in gm.group)


def _first_use_ordered(gm: GroupModel, moved: list[int]) -> bool:
    """The group model's symmetry breaking: the i-th free block on one of the first i + 1
    group ranks."""
    return all(gm.group.index(moved[b]) <= i for i, b in enumerate(gm.free))


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(placements(), st.floats(1.0, 2.0))
def test_descend_keeps_caps_and_never_raises_the_objective(case, slack):
    lengths, blocks, n, ranks, _ = case
    tokens, loads, recv = placement_values(blocks, ranks, n)
    token_cap, work_cap = max(tokens), int(max(loads) * slack)

    def solve(gm: GroupModel, limit_s: float) -> Step:
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.max_deterministic_time = limit_s
        status = solver.StatusName(solver.Solve(gm.model))
        dtime = solver.ResponseProto().deterministic_time
        if status not in ("OPTIMAL", "FEASIBLE"):
            return Step(None, dtime, True, status == "INFEASIBLE")
        return Step([gm.group[next(j for j, v in enumerate(row) if solver.BooleanValue(v))]
                     for row in gm.x], dtime, True, status == "OPTIMAL")

    out, spent, deterministic = descend(blocks, ranks, n, token_cap=token_cap, work_cap=work_cap,
                                        budget=2.0, step_limit=0.2, solve=solve)
    assert len(out) == len(ranks) and set(out) <= set(range(n))
    new_tokens, new_loads, new_recv = placement_values(blocks, out, n)
    assert sum(new_tokens) == sum(tokens)
    assert max(new_tokens) <= token_cap and max(new_loads) <= work_cap
    assert (max(new_recv), sum(new_recv)) <= (max(recv), sum(recv))
    assert 0 <= spent <= 2.5 and deterministic  # a step may overrun its limit slightly


def test_groups_pair_the_critical_rank_with_every_partner_then_two():
    order = [2, 0, 3, 1]  # rank 2 receives most
    groups = groups_of(2, order, 4)
    assert groups[:3] == [(0, 2), (2, 3), (1, 2)]
    assert sorted(groups[3:]) == [(0, 1, 2), (0, 2, 3), (1, 2, 3)]
    assert groups_of(1, [1, 0], 2) == [(0, 1)]
