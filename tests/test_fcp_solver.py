"""FCP stages 1 and 2 against slow references on tiny inputs.

The DP (paper Algorithm 1) and the order-statistic search must both equal a brute force
over every degree vector of the same atomic groups; FCP's whole answer may not beat the
exhaustive optimum over every grouping; every plan passes the validator.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner_service import validate_plan
from planner_service.data import make_source, sample_batch
from planner_service.fcp.bfd import bfd_headroom, merge_for_memory, min_degrees, pack_balanced
from planner_service.fcp.brute import brute_degrees, brute_optimum, set_partitions
from planner_service.fcp.cost_model import PROFILES
from planner_service.fcp.dp import Degrees, dp_degrees, fill_spare_ranks, threshold_degrees
from planner_service.fcp.grouping import Scored, group_table
from planner_service.fcp.placement import place_groups
from planner_service.fcp.portfolio import keep_paper, score_static, solve_micro_batch, static_total
from planner_service.fcp.reference_schedules import best_static
from planner_service.fcp.schedule import sequence_stats, split_micro_batches
from planner_service.solvers.fcp_schedule import ScheduleRequest, schedule

PROFILE = PROFILES["h100-llama3-8b-ib"]
TINY_CASES = 320
REL = 1e-12


def _tiny_case(rng: np.random.Generator):
    """A micro-batch of 1-5 sequences (1-2 docs each) that fits N x E, or None."""
    n = int(rng.integers(1, 7))
    memory = int(rng.choice([1024, 2048, 4096, 8192]))
    seqs = [[int(x) for x in rng.integers(1, 6000, size=int(rng.integers(1, 3)))]
            for _ in range(int(rng.integers(1, 6)))]
    if sum(map(sum, seqs)) > n * memory:
        return None
    return seqs, n, memory


def _tiny_cases(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        case = _tiny_case(rng)
        if case is not None:
            out.append(case)
    return out


def test_dp_equals_brute_force_over_degrees_on_tiny_batches():
    """The acceptance check: >= 300 tiny batches, same atomic groups, same makespan."""
    for seqs, n, memory in _tiny_cases(TINY_CASES):
        stats = sequence_stats(seqs, (), PROFILE)
        found = solve_micro_batch(stats, range(len(seqs)), n, memory, PROFILE, method="dp")
        table = group_table(stats, [list(g) for g in found.groups], n, memory, PROFILE)
        exact = brute_degrees(table)
        assert exact.makespan_ms == pytest.approx(found.makespan_ms, rel=REL)
        assert dp_degrees(table).makespan_ms == pytest.approx(exact.makespan_ms, rel=REL)
        assert threshold_degrees(table).makespan_ms == pytest.approx(exact.makespan_ms, rel=REL)
        assert sum(found.degrees) <= n
        assert max(found.times_ms) == pytest.approx(found.makespan_ms, rel=REL)


def test_every_tiny_plan_passes_the_validator():
    for seqs, n, memory in _tiny_cases(TINY_CASES, seed=1):
        result = schedule(ScheduleRequest(sequences=seqs, num_ranks=n, memory_tokens=memory,
                                          profile=PROFILE))
        for plan in result.plans:
            validate_plan(plan)
            for group in plan.groups:
                assert group.metrics.tokens_per_rank <= memory


def test_fcp_is_never_below_the_exhaustive_optimum_and_usually_meets_it():
    ratios = []
    for seqs, n, memory in _tiny_cases(120, seed=2):
        stats = sequence_stats(seqs, (), PROFILE)
        items = list(range(len(seqs)))
        found = solve_micro_batch(stats, items, n, memory, PROFILE)
        best = brute_optimum(stats, items, n, memory, PROFILE)
        ratios.append(found.makespan_ms / best.makespan_ms)
    ratios = np.array(ratios)
    assert ratios.min() >= 1 - 1e-9
    # Measured: optimal in 78% of the 120 cases, 1.6% above on average, 19% at worst
    # (the portfolio keeps the paper's grouping unless a static degree beats it).
    assert (ratios <= 1 + 1e-9).mean() >= 0.7
    assert ratios.mean() <= 1.05


tables = st.integers(1, 5).flatmap(lambda k: st.integers(1, 7).flatmap(lambda n: st.tuples(
    st.lists(st.lists(st.floats(0.1, 100.0), min_size=n, max_size=n), min_size=k, max_size=k),
    st.lists(st.integers(1, n), min_size=k, max_size=k),
)))


@settings(max_examples=200, deadline=None)
@given(tables)
def test_dp_and_threshold_equal_brute_force_on_any_table(data):
    values, d_min = data
    table = np.array([[np.inf] + row for row in values])
    for i, d in enumerate(d_min):
        table[i, :d] = np.inf  # below the memory minimum
    exact = brute_degrees(table)
    for found in (dp_degrees(table), threshold_degrees(table)):
        if np.isinf(exact.makespan_ms):
            assert np.isinf(found.makespan_ms)
            continue
        assert found.makespan_ms == exact.makespan_ms
        assert sum(found.degrees) <= table.shape[1] - 1
        assert max(table[i, d] for i, d in enumerate(found.degrees)) == exact.makespan_ms
    assert dp_degrees(table).degrees == threshold_degrees(table).degrees


def test_fill_spare_ranks_never_slows_a_group():
    rng = np.random.default_rng(3)
    for _ in range(50):
        table = np.column_stack([np.full(4, np.inf), rng.uniform(1, 100, size=(4, 10))])
        found = threshold_degrees(table)
        filled = fill_spare_ranks(table, found.degrees, 10)
        assert sum(filled) <= 10
        for i, (a, b) in enumerate(zip(found.degrees, filled, strict=True)):
            assert b >= a and table[i, b] <= table[i, a]


def test_bfd_puts_short_sequences_in_the_tightest_headroom():
    tokens = np.array([2500, 1700, 600, 300, 900])  # E = 1000: 2500 -> 3 ranks, 1700 -> 2
    bins, left = bfd_headroom(tokens, 1000)
    # Headrooms: 500 (after 2500) and 300 (after 1700). 900 fits none; 600 none; 300 the
    # tightest (300); nothing else fits.
    assert bins == [[0], [1, 3]]
    assert left == [4, 2]
    assert list(min_degrees(tokens, 1000)) == [3, 2, 1, 1, 1]


def test_pack_balanced_respects_memory_or_reports_none():
    tokens = np.array([600, 600, 600, 100])
    costs = np.array([1.0, 1.0, 1.0, 5.0])
    bins = pack_balanced(tokens, costs, range(4), 2, 1000)
    assert bins is None  # three items of 600 cannot share two bins of 1000
    bins = pack_balanced(tokens, costs, range(4), 3, 1000)
    assert sorted(int(sum(tokens[b])) for b in bins) == [600, 600, 700]


def test_merge_for_memory_fits_whenever_the_tokens_fit():
    rng = np.random.default_rng(4)
    for _ in range(100):
        tokens = rng.integers(100, 1500, size=8)
        n = int(rng.integers(2, 10))
        memory = int(np.ceil(tokens.sum() / n)) + int(rng.integers(0, 200))
        merged = merge_for_memory([[i] for i in range(8)], tokens, memory, n)
        assert merged is not None
        assert sorted(i for g in merged for i in g) == list(range(8))
        assert sum(-(-int(tokens[g].sum()) // memory) for g in merged) <= n
    assert merge_for_memory([[0], [1]], np.array([10, 10]), 5, 3) is None


def test_set_partitions_counts_bell_numbers():
    assert [sum(1 for _ in set_partitions(list(range(k)))) for k in range(6)] == [1, 1, 2, 5, 15, 52]


def test_groups_that_fit_a_node_are_placed_inside_one():
    starts = place_groups([3, 5, 4, 4], 16, 8)
    spans = [(s, s + d) for s, d in zip(starts, [3, 5, 4, 4], strict=True)]
    for lo, hi in spans:
        assert lo // 8 == (hi - 1) // 8
    assert len({r for lo, hi in spans for r in range(lo, hi)}) == 16


def test_fragmented_nodes_fall_back_to_contiguous_packing():
    starts = place_groups([5, 5, 5], 16, 8)  # the third 5 cannot sit inside a node
    spans = sorted((s, s + 5) for s in starts)
    assert all(a[1] <= b[0] for a, b in zip(spans[:-1], spans[1:], strict=True))
    assert spans[-1][1] <= 16


def _candidate(name: str, makespan_ms: float) -> Scored:
    return Scored(Degrees((1,), makespan_ms), name, [[0]], np.zeros((1, 2)))


def _makespans(chosen: list[Scored]) -> list[float]:
    return [c.found.makespan_ms for c in chosen]


def test_portfolio_keeps_the_papers_groupings_while_the_batch_is_within_the_bound():
    paper = [[_candidate("bfd", 10.0)], [_candidate("bfd", 20.0)], [_candidate("bfd", 30.0)]]
    static = [[_candidate("static-4", 9.0)], [_candidate("static-4", 12.0)],
              [_candidate("one-group", 29.0)]]
    assert _makespans(keep_paper(paper, static, 60.0)) == [10.0, 20.0, 30.0]
    # 60 > 55: the largest saving (20 -> 12) moves first, and is enough.
    assert _makespans(keep_paper(paper, static, 55.0)) == [10.0, 12.0, 30.0]
    assert _makespans(keep_paper(paper, static, 51.0)) == [9.0, 12.0, 30.0]
    assert _makespans(keep_paper(paper, static, 0.0)) == [9.0, 12.0, 29.0]


@pytest.mark.parametrize("num_ranks", [8, 12, 16, 64])
def test_static_total_equals_the_static_baseline(num_ranks):
    """The portfolio's bound (reusing scored candidates) against baselines.best_static,
    the slow reference that packs every degree and wave again."""
    profile = PROFILES["h100-llama3-8b"]
    for dataset in ("wlbllm", "code"):
        seqs = sample_batch(make_source(dataset), num_sequences=128, max_tokens=131072, seed=3)
        stats = sequence_stats(seqs, (), profile)
        capacity = num_ranks * 32768
        least = -(-int(stats.tokens.sum()) // capacity)
        for count in (least, least + 1):
            split = split_micro_batches(stats, count, capacity, profile)
            if split is None:
                continue
            static = score_static(stats, split, num_ranks, 32768, profile)
            _, schedules = best_static(stats, split, num_ranks, 32768, profile)
            assert static_total(stats, split, static, num_ranks, 32768, profile) == pytest.approx(
                sum(s.makespan_ms for s in schedules), rel=1e-12)
