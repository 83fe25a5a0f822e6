"""Runs of equal docs on many ranks (``runs.place_run_blocks``): the same docs to the same
ranks as the least-key rule with held densities doc by doc (``runs.place_run_reference``),
from any layout, in blocks and one doc at a time; ``place.place`` uses it beyond
``place.REFRESH`` ranks; the held density places mixed lengths as well as the density of
every doc; the largest equal-docs request solves and validates."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_flashcp_scale import reference_place

from bench.scale import mixed_lengths
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


def run_case(seed: int, n: int) -> tuple[int, list[tuple[int, int]], int, int, int, int, float]:
    """(length, held, docs in the run, capacity, tokens and workload left, allowed)."""
    rng = random.Random(seed)
    kind = ("empty", "levels", "random")[seed % 3]
    length = rng.choice((1, 2, 3, 7, 20, 21, 64))
    count = rng.randint(1, max(600, 3 * n) if n < 1024 else 1200)
    held = held_before(rng, n, kind, length)
    # Docs after the run: none (flat densities), shorter (sloped), or some longer too
    # (densities above (L + 1) / 2: not a longest-first order).
    longest = length if seed % 4 else 3 * length
    later = [rng.randint(1, longest) for _ in range(rng.choice((0, 0, 3, 50, 400)))]
    rest_tokens = count * length + sum(later)
    rest_work = count * doc_workload(length) + sum(map(doc_workload, later))
    cap = max(t for t, _ in held) + -(-count * length // n) + rng.randint(0, 2 * length)
    total_work = rest_work + sum(w for _, w in held)
    allowed = rng.choice((1.0, 1.05, 1.3, 100.0)) * total_work / n
    return length, held, count, cap, rest_tokens, rest_work, allowed


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("held_docs", (runs.HELD_BLOCK, 7))
@pytest.mark.parametrize("step_floor", (runs.STEP_FLOOR, 1.0))
def test_held_blocks_place_as_the_rule_doc_by_doc(n, seed, held_docs, step_floor,
                                                  monkeypatch):
    """From empty, round-robin and random layouts, blocks of ``HELD_BLOCK`` docs and of 7
    (many blocks in a run), by ``predicted`` and (a ``STEP_FLOOR`` no step passes) one doc
    at a time at the held density: the same docs to the same ranks as the rule doc by doc,
    up to the same doc no rank takes whole. Along longest-first densities, blocks place
    every doc."""
    monkeypatch.setattr(runs, "HELD_BLOCK", held_docs)
    monkeypatch.setattr(runs, "STEP_FLOOR", step_floor)
    length, held, count, cap, rest_tokens, rest_work, allowed = run_case(seed, n)
    one_by_one = []

    def single_steps(*args):
        chosen, stopped = steps(*args)
        one_by_one.append(len(chosen))
        return chosen, stopped

    steps = runs.single_steps
    monkeypatch.setattr(runs, "single_steps", single_steps)
    slow, fast = layout(n, cap, held), layout(n, cap, held)
    want = runs.place_run_reference(length, range(count), slow, allowed, rest_tokens, rest_work)
    got = runs.place_run_blocks(length, range(count), fast, allowed, rest_tokens, rest_work)
    assert got == want
    assert (fast.shards, fast.tokens, fast.work) == (slow.shards, slow.tokens, slow.work)
    if seed % 4 and step_floor < 1:  # no doc after the run is longer: densities at or
        assert not sum(one_by_one)  # below (L + 1) / 2, steps well above rounding


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    n=st.sampled_from(RANKS),
    count=st.integers(1, 300),
    data=st.data(),
)
def test_one_doc_at_a_time_places_as_the_rule(n, count, data):
    """``single_steps`` alone, at the density after every doc: the rule doc by doc without
    held densities (``place``'s own), from random layouts."""
    length = data.draw(st.integers(1, 30))
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    held = held_before(rng, n, "random", length)
    cap = max(t for t, _ in held) + data.draw(st.integers(0, 3 * length))
    later = data.draw(st.lists(st.integers(1, 3 * length), max_size=30))
    rest_tokens = count * length + sum(later)
    rest_work = count * doc_workload(length) + sum(map(doc_workload, later))
    allowed = data.draw(st.sampled_from([1.0, 1.3, 100.0])) * (
        rest_work + sum(w for _, w in held)) / n
    slow = layout(n, cap, held)
    want = runs.place_run_reference(length, range(count), slow, allowed, rest_tokens, rest_work,
                                    held_docs=1)
    work = np.array([w for _, w in held], dtype=np.int64)
    tokens = np.array([t for t, _ in held], dtype=np.int64)
    chosen, stopped = runs.single_steps(work, tokens, cap, length, allowed,
                                        runs.run_densities(length, count, rest_tokens, rest_work))
    assert len(chosen) == want.placed and stopped == (want.placed < count)
    assert [[s.doc for s in shards] for shards in slow.shards] == [
        np.flatnonzero(chosen == r).tolist() for r in range(n)]


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
    got = runs.place_run_blocks(length, range(count), fast, allowed, rest_tokens, rest_work)
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


@pytest.mark.parametrize("source", ("code", "wlbllm"))
@pytest.mark.parametrize("n", (16, 1024))
def test_held_densities_balance_mixed_lengths_as_the_density_of_every_doc(source, n,
                                                                         monkeypatch):
    """Mixed lengths (runs of many short docs after long ones): ``place`` with held
    densities and with the density of every doc (``HELD_BLOCK`` 1) reach the same most
    workload a rank holds within 0.1% of the mean, and the same tokens a rank holds."""
    doc_lengths = mixed_lengths(source, 20000, 400_000)
    order = sorted(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
    total = sum(map(doc_workload, doc_lengths))
    allowed = 1.05 * total / n
    held, _ = place.place(doc_lengths, order, n, allowed, False, total)
    monkeypatch.setattr(runs, "HELD_BLOCK", 1)
    each, _ = place.place(doc_lengths, order, n, allowed, False, total)
    assert abs(max(held.work) - max(each.work)) <= 1e-3 * total / n
    assert max(held.tokens) == max(each.tokens)


@pytest.mark.parametrize("n", (1, 2, 9, 100, 1024))
@pytest.mark.parametrize("seed", range(16))
def test_single_steps_over_ranks_with_room_equal_the_scan_of_every_rank(n, seed):
    """``single_steps`` (the ranks with room only) gives ``single_steps_reference``'s
    ranks and stop: full ranks among the others, every rank running out of room, equal
    states (ties), one doc, thousands of 1-token docs, more ranks than tokens, densities
    above (L + 1) / 2."""
    rng = random.Random(seed)
    length = (1, 1, 2, 7, 30)[seed % 5]
    kind = ("empty", "levels", "random")[seed % 3]
    held = held_before(rng, n, kind, length)
    top = max(t for t, _ in held)
    cap = top + rng.choice((0, length, 3 * length, 40 * length))
    if seed % 4 == 0:  # some ranks full
        held = [(cap, w) if rng.random() < 0.4 else (t, w) for t, w in held]
    count = (1, 5, 300, 3000)[seed % 4] if n < 1024 else (1, 300, 1200)[seed % 3]
    work = np.array([w for _, w in held], dtype=np.int64)
    tokens = np.array([t for t, _ in held], dtype=np.int64)
    later = [rng.randint(1, 3 * length) for _ in range(rng.choice((0, 5, 100)))]
    rest_tokens = count * length + sum(later)
    rest_work = count * doc_workload(length) + sum(map(doc_workload, later))
    allowed = rng.choice((1.0, 1.3, 1e18)) * (rest_work + int(work.sum())) / n
    densities = runs.run_densities(length, count, rest_tokens, rest_work)
    got = runs.single_steps(work, tokens, cap, length, allowed, densities)
    want = runs.single_steps_reference(work, tokens, cap, length, allowed, densities)
    assert got[0].tolist() == want[0].tolist() and got[1] == want[1]


@pytest.mark.parametrize("seed", range(8))
def test_run_densities_from_a_start_are_the_slice_of_all(seed):
    """``runs.run_densities`` from the ``start``-th doc on: the same figures as the slice
    of the densities from the run's first doc (to the last doc, density 0.0)."""
    rng = random.Random(seed)
    length = rng.randint(1, 40)
    count = rng.randint(1, 5000)
    later = [rng.randint(1, 2 * length) for _ in range(rng.choice((0, 3, 300)))]
    rest_tokens = count * length + sum(later)
    rest_work = count * doc_workload(length) + sum(map(doc_workload, later))
    every = runs.run_densities(length, count, rest_tokens, rest_work)
    for start in (0, 1, rng.randint(0, count - 1), count - 1):
        part = runs.run_densities(length, count - start, rest_tokens, rest_work, start)
        assert part.tobytes() == every[start:].tobytes()
