"""The ILP against a brute-force enumeration of every block placement on tiny instances.

The brute force shares only the blocks with the ILP (``cut_blocks`` with the flashcp cuts,
which define the problem); it scores each placement with the core cost module, an
implementation independent of the model's need/recv variables.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from planner_service.core.cost import comm_volumes, doc_workload, rank_workloads
from planner_service.solvers.flashcp import flashcp_shards
from planner_service.solvers.ilp import TUNING, IlpOptions, head_docs, solve_blocks, workload_cap
from planner_service.solvers.ilp.blocks import Blocks, block_shards, cut_blocks, layout_cuts

HEADS = 2
"""Fewer head docs than docs, so blocks with and without a geometric head both occur."""
MAX_BLOCKS = {2: 10, 3: 7}
"""Most blocks per instance by rank count: n ** blocks placements are enumerated."""


class Optimum(NamedTuple):
    comm: int | None
    """min over placements of the critical-path KV at imbalance <= R; None if none meets R."""
    balance: tuple[int, int]
    """min over placements of (max workload, critical-path KV), lexicographic."""


def instance_blocks(doc_lengths: Sequence[int], n: int, target: float, g: int):
    shards, _ = flashcp_shards(doc_lengths, n, target)
    cuts = layout_cuts(shards)
    return cut_blocks(doc_lengths, g, cuts, head_docs(doc_lengths, cuts, HEADS))


def brute_force(doc_lengths: Sequence[int], n: int, target: float, g: int) -> Optimum:
    """Enumerate all n ** blocks placements (tests only: tiny instances)."""
    blocks = instance_blocks(doc_lengths, n, target, g)
    cap_tokens = -(-sum(doc_lengths) // n)
    total = sum(doc_workload(length) for length in doc_lengths)
    best_comm = None
    best_balance = None
    for ranks in itertools.product(range(n), repeat=len(blocks.blocks)):
        shards = block_shards(blocks, ranks, n)
        if max(sum(s.end - s.start for s in rank) for rank in shards) > cap_tokens:
            continue
        max_work = max(rank_workloads(shards))
        comm = max(comm_volumes(shards).alltoallv_recv)
        if max_work * n / total <= target and (best_comm is None or comm < best_comm):
            best_comm = comm
        if best_balance is None or (max_work, comm) < best_balance:
            best_balance = (max_work, comm)
    assert best_balance is not None, "the flashcp cuts always give a placement"
    return Optimum(best_comm, best_balance)


class CommCase(NamedTuple):
    """A tiny instance with a comm optimum, for the tests of the ILP's bounds."""

    doc_lengths: list[int]
    n: int
    tokens: int
    """T = ceil(S / N)."""
    cap: int
    """The workload cap of R."""
    blocks: Blocks
    optimum: int
    """The brute-force comm optimum."""


def comm_case(instance) -> CommCase:
    """The instance as a ``CommCase``; rejects (hypothesis ``assume``) one whose R is below
    what integer tokens allow, with too many blocks to enumerate, or that no placement meets."""
    doc_lengths, n, target, g = instance
    try:
        cap = workload_cap(doc_lengths, n, target)
    except ValueError:
        assume(False)
    blocks = instance_blocks(doc_lengths, n, target, g)
    assume(len(blocks.blocks) <= MAX_BLOCKS[n])
    optimum = brute_force(doc_lengths, n, target, g).comm
    assume(optimum is not None)
    assert optimum is not None
    return CommCase(doc_lengths, n, -(-sum(doc_lengths) // n), cap, blocks, optimum)


def options(g: int, objective: str) -> IlpOptions:
    return IlpOptions(granularity=g, time_limit_s=10.0, objective=objective, workers=1,
                      head_docs=HEADS)


@st.composite
def tiny_instances(draw):
    n = draw(st.integers(2, 3))
    doc_lengths = draw(st.lists(st.integers(1, 13), min_size=1, max_size=4))
    g = draw(st.integers(2, max(2, max(doc_lengths))))
    assume(g <= max(doc_lengths))
    target = draw(st.sampled_from([1.0, 1.02, 1.1, 1.3, 1.6, 2.0, 3.0]))
    return doc_lengths, n, target, g


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(tiny_instances())
def test_ilp_equals_brute_force_optimum(instance):
    doc_lengths, n, target, g = instance
    blocks = instance_blocks(doc_lengths, n, target, g)
    assume(4 <= len(blocks.blocks) <= MAX_BLOCKS[n])
    expected = brute_force(doc_lengths, n, target, g)
    event(f"n={n} blocks={len(blocks.blocks)}")
    event(f"comm optimum {'none' if expected.comm is None else 'zero' if expected.comm == 0 else '> 0'}")

    balance = solve_blocks(doc_lengths, n, target, options(g, "balance"))
    assert balance.status == "OPTIMAL"
    assert balance.objective_value == expected.balance[0]
    assert max(comm_volumes(balance.shards).alltoallv_recv) == expected.balance[1]

    try:
        workload_cap(doc_lengths, n, target)
    except ValueError:
        assert expected.comm is None  # R below what integer tokens allow: nothing meets it
        return
    if expected.comm is None:
        with pytest.raises(ValueError, match="cannot be met"):
            solve_blocks(doc_lengths, n, target, options(g, "comm"))
        return
    comm = solve_blocks(doc_lengths, n, target, options(g, "comm"))
    assert comm.status == "OPTIMAL"
    assert comm.objective_value == comm.best_bound == expected.comm
    assert max(comm_volumes(comm.shards).alltoallv_recv) == expected.comm
    assert max(rank_workloads(comm.shards)) * n <= target * sum(map(doc_workload, doc_lengths))


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(tiny_instances())
def test_ilp_equals_brute_force_optimum_without_the_small_model_path(instance):
    # Every instance above is a small model (Tuning.small_bools), closed by CP-SAT without
    # cut rounds whatever the gap; with no model small the search takes the steps of a
    # large one, which must reach the same optimum.
    case = comm_case(instance)
    doc_lengths, n, target, g = instance
    assume(len(case.blocks.blocks) >= 4)
    large = replace(TUNING, small_bools=0)
    comm = solve_blocks(doc_lengths, n, target, options(g, "comm"), tuning=large)
    assert comm.status == "OPTIMAL"
    assert comm.objective_value == comm.best_bound == case.optimum
