"""Runs of equal docs on many ranks (``runs.place_run_exact``): the same docs to the same
ranks as the least-key rule doc by doc (``runs.place_run_reference``), from any layout;
``place.place`` uses it beyond ``place.REFRESH`` ranks; the largest equal-docs request
solves and validates."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_flashcp_scale import reference_place

from planner_service.core.cost import doc_workload
from planner_service.core.request import PlanRequest
from planner_service.solvers.flashcp import place, runs
from planner_service.solvers.flashcp.ranks import Ranks
from planner_service.solvers.registry import solve

RANKS = (9, 16, 100, 1024)


def layout(n: int, cap: int, held: list[tuple[int, int]]) -> Ranks:
    """Ranks holding ``held[r]`` = (tokens, workload) so far, no shards."""
    ranks = Ranks(n, cap)
    ranks.tokens = [t for t, _ in held]
    ranks.work = [w for _, w in held]
    return ranks


def held_before(rng: random.Random, n: int, kind: str, length: int) -> list[tuple[int, int]]:
    """Each rank's (tokens, workload) before the run: empty, whole docs of the run's length
    (the states of a round robin), or random (any tokens, workloads near tokens^2 / 2)."""
    if kind == "empty":
        return [(0, 0)] * n
    if kind == "levels":
        return [(k * length, k * doc_workload(length))
                for k in (rng.randint(0, 2) for _ in range(n))]
    top = rng.choice((length, 4 * length + 40))
    out = []
    for _ in range(n):
        tokens = rng.randint(0, top)
        out.append((tokens, rng.randint(tokens, tokens * (tokens + 1) // 2 + tokens)))
    return out


def run_case(seed: int, n: int) -> tuple[str, int, list[tuple[int, int]], int, int, int, int,
                                         float]:
    """(the layout's kind, length, held, docs in the run, capacity, tokens and workload
    left, allowed workload)."""
    rng = random.Random(seed)
    kind = ("empty", "levels", "random")[seed % 3]
    length = rng.choice((1, 2, 3, 7, 20, 21, 64))
    count = rng.randint(1, max(600, 3 * n) if n < 1024 else 1200)
    held = held_before(rng, n, kind, length)
    # Shorter docs after the run (sloped densities) or none (flat).
    later = [rng.randint(1, length) for _ in range(rng.choice((0, 0, 3, 50, 400)))]
    rest_tokens = count * length + sum(later)
    rest_work = count * doc_workload(length) + sum(map(doc_workload, later))
    cap = max(t for t, _ in held) + -(-count * length // n) + rng.randint(0, 2 * length)
    total_work = rest_work + sum(w for _, w in held)
    allowed = rng.choice((1.0, 1.05, 1.3, 100.0)) * total_work / n
    return kind, length, held, count, cap, rest_tokens, rest_work, allowed


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("seed", range(12))
def test_exact_blocks_place_as_the_rule_doc_by_doc(n, seed):
    """Blocks where they are certified, one doc by the rule where they stop short: the
    same layout as the rule doc by doc all along, so every block placed as the rule. From
    empty or round-robin layouts the first call places all the rule does."""
    kind, length, held, count, cap, rest_tokens, rest_work, allowed = run_case(seed, n)
    docs = list(range(count))
    slow = layout(n, cap, held)
    want = runs.place_run_reference(length, docs, slow, allowed, rest_tokens, rest_work)
    fast = layout(n, cap, held)
    at, left_tokens, left_work, first = 0, rest_tokens, rest_work, None
    while at < count:
        got = runs.place_run_exact(length, docs[at:], fast, allowed, left_tokens, left_work)
        first = got.placed if first is None else first
        if got.placed:
            assert got.density == runs.run_densities(length, at + got.placed, rest_tokens,
                                                     rest_work)[-1]
        else:
            got = runs.place_run_reference(length, docs[at:at + 1], fast, allowed, left_tokens,
                                           left_work)
            if not got.placed:
                break
        at, left_tokens, left_work = at + got.placed, got.rest_tokens, got.rest_work
    assert at == want.placed
    assert (left_tokens, left_work) == (want.rest_tokens, want.rest_work)
    assert (fast.shards, fast.tokens, fast.work) == (slow.shards, slow.tokens, slow.work)
    if kind != "random":
        assert first == want.placed


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    n=st.sampled_from(RANKS),
    length=st.integers(1, 40),
    count=st.integers(1, 400),
    later=st.lists(st.integers(1, 40), max_size=60),
    slack=st.integers(0, 50),
    target=st.sampled_from([1.0, 1.05, 1.3]),
)
def test_runs_from_empty_ranks_go_in_blocks_to_the_end(n, length, count, later, slack, target):
    """From empty ranks (round robin while shorter docs follow, else flat) one call places
    the run as the rule does."""
    later = [min(x, length) for x in later]
    rest_tokens = count * length + sum(later)
    rest_work = count * doc_workload(length) + sum(map(doc_workload, later))
    cap = -(-rest_tokens // n) + slack
    allowed = target * rest_work / n
    slow, fast = Ranks(n, cap), Ranks(n, cap)
    want = runs.place_run_reference(length, range(count), slow, allowed, rest_tokens, rest_work)
    got = runs.place_run_exact(length, range(count), fast, allowed, rest_tokens, rest_work)
    assert got == want
    assert (fast.shards, fast.tokens, fast.work) == (slow.shards, slow.tokens, slow.work)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    n=st.sampled_from((9, 16, 100)),
    length=st.integers(1, 30),
    count=st.integers(4 * runs.RUN_MIN, 700),
    target=st.sampled_from([1.0, 1.05, 1.3]),
    fill_aware=st.booleans(),
)
def test_place_of_one_run_on_many_ranks_equals_the_plain_scan(n, length, count, target,
                                                              fill_aware):
    """A request of equal docs on more than ``place.REFRESH`` ranks: ``place`` (the run in
    blocks, then the heap, whose keys stay current at a constant density) equals the plain
    scan."""
    assert n > place.REFRESH
    doc_lengths = [length] * count
    order = list(range(count))
    total = count * doc_workload(length)
    allowed = target * total / n
    fast, fast_spill = place.place(doc_lengths, order, n, allowed, fill_aware, total)
    slow, slow_spill = reference_place(doc_lengths, order, n, allowed, fill_aware, total)
    assert fast.shards == slow.shards and fast_spill == slow_spill


def test_two_million_tokens_in_100000_docs_on_1024_ranks_solve_and_validate():
    length, extra = divmod(2097152, 100_000)
    doc_lengths = tuple(length + (i < extra) for i in range(100_000))
    plan = solve(PlanRequest(doc_lengths=doc_lengths, cp_size=1024, context_length=None))
    assert plan.metrics.tokens_per_rank == 2048
    assert plan.metrics.imbalance <= 1.05
