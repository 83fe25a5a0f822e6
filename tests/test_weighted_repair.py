"""The layer-weighted repair of flashcp's plan (solvers/weighted_repair.py): the tail cut
against a position-by-position search, the receive score against the key sets of
``window_work``'s reference, the repaired layout's invariants on random flashcp plans,
and its place among flashcp's candidates under a mask."""

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.build import GroupLayout, Layout
from planner_service.core.mask import AttentionMask, LayerGroup, parse_layers_text
from planner_service.core.plan import Shard
from planner_service.core.request import PlanRequest
from planner_service.data import make_source, pack_sequences
from planner_service.solvers import weighted_repair as wr
from planner_service.solvers.contiguous_halo import WeightedPrefix
from planner_service.solvers.flashcp_bounded import causal_flashcp_layout
from planner_service.solvers.kv_bound import listed
from planner_service.solvers.registry import solve

masks = st.lists(
    st.builds(LayerGroup, st.one_of(st.none(), st.integers(1, 300)), st.integers(1, 6)),
    min_size=1, max_size=3,
).map(lambda groups: AttentionMask(tuple(groups)))


@settings(max_examples=60, deadline=None)
@given(masks, st.integers(1, 2000), st.data())
def test_the_tail_cut_is_the_greatest_carrying_the_work(mask, length, data):
    prefix = WeightedPrefix([length], mask)
    start = data.draw(st.integers(0, length - 1))
    end = data.draw(st.integers(start + 1, length))
    shard = Shard(0, start, end)
    whole = prefix.doc_prefix(end) - prefix.doc_prefix(start)
    work = data.draw(st.integers(0, whole + 5))
    fits = [m for m in range(start, end + 1)
            if prefix.doc_prefix(end) - prefix.doc_prefix(m) >= work]
    assert wr.tail_cut(prefix, shard, work) == (max(fits) if fits else start)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(masks, st.data())
def test_the_receive_score_bounds_what_the_tail_adds_and_is_exact_for_a_bare_rank(mask, data):
    length = data.draw(st.integers(2, 400))
    cut = data.draw(st.integers(1, length - 1))
    end = data.draw(st.integers(cut + 1, length))
    spans = data.draw(st.lists(st.tuples(st.integers(0, length - 1), st.integers(1, 60)),
                               max_size=3))
    pieces, taken = [], set()
    for a, size in sorted(spans):
        b = min(a + size, length)
        if any(p in taken for p in range(a, b)) or b > cut and a < end:
            continue
        taken.update(range(a, b))
        pieces.append(Shard(0, a, b))
    tail = Shard(0, cut, end)

    def receive(shards):
        return sum(g.layers * ww.reference_comm_volumes([shards], g.window).alltoallv_recv[0]
                   for g in mask.groups)

    score = wr.added_receive(pieces, cut, wr.window_limits(mask))
    assert score >= receive(pieces + [tail]) - receive(pieces)
    assert wr.added_receive((), cut, wr.window_limits(mask)) == receive([tail])


def flashcp_layout(doc_lengths, n, mask):
    request = PlanRequest(doc_lengths=tuple(doc_lengths), cp_size=n, mask=mask)
    return request, listed(causal_flashcp_layout(request.doc_lengths, request))


def weighted_loads(shards_per_rank, mask):
    arrays = cost.shard_arrays(shards_per_rank)
    return ww.mask_figures_of(arrays, mask, comm_mode="alltoallv", tokens_per_rank=1).workload


def excess(loads, goal):
    return sum(max(0, w - goal) for w in loads)


def coverage(shards_per_rank):
    return sorted((s.doc, p) for rank in shards_per_rank for s in rank
                  for p in range(s.start, s.end))


@pytest.mark.parametrize("text", ("5x1024,1xfull", "1x128,1xfull", "3x7,1xfull", "1x1"))
def test_a_repair_keeps_every_token_sheds_work_over_the_goal_and_stays_within_the_tokens(text):
    """At R = 1.01, so that most of flashcp's plans need moves."""
    mask = parse_layers_text(text)
    rng = random.Random(text)
    repaired = 0
    for _ in range(40):
        doc_lengths = [rng.choice((rng.randint(1, 300), rng.randint(1, 9000)))
                       for _ in range(rng.randint(1, 30))]
        n = rng.choice((2, 3, 4, 8, 16, 32))
        request, layout = flashcp_layout(doc_lengths, n, mask)
        before = layout.groups[0].shards
        cap = max(sum(s.end - s.start for s in rank) for rank in before) + rng.randint(0, 50)
        loads = weighted_loads(before, mask)
        out = wr.repaired_layout(layout, loads, WeightedPrefix(doc_lengths, mask), mask, 1.01,
                                 cap)
        if out is None:
            continue
        repaired += 1
        after = out.groups[0].shards
        assert out == wr.repaired_layout(layout, loads, WeightedPrefix(doc_lengths, mask),
                                         mask, 1.01, cap)
        assert coverage(after) == coverage(before)
        moved = weighted_loads(after, mask)
        goal = math.floor(1.01 * sum(loads) / n)
        assert max(moved) <= max(loads)
        assert excess(moved, goal) < excess(loads, goal)
        assert max(sum(s.end - s.start for s in rank) for rank in after) <= cap
        assert 1 <= out.info["weighted_moves"] <= wr.MAX_MOVES
        solve(request)  # the strategy's plan, whichever candidate wins, validates
    assert repaired >= 1


def test_nothing_moves_on_one_rank_or_a_balanced_layout():
    mask = parse_layers_text("5x1024,1xfull")
    prefix = WeightedPrefix([500, 500], mask)
    one = Layout([GroupLayout((0,), [[Shard(0, 0, 500), Shard(1, 0, 500)]])], {})
    even = Layout([GroupLayout((0, 1), [[Shard(0, 0, 500)], [Shard(1, 0, 500)]])], {})
    assert wr.repaired_layout(one, weighted_loads(one.groups[0].shards, mask), prefix, mask,
                              1.05, 1000) is None
    assert wr.repaired_layout(even, weighted_loads(even.groups[0].shards, mask), prefix, mask,
                              1.05, 1000) is None


def test_a_layout_with_more_ranks_over_the_goal_than_moves_is_left_alone():
    mask = parse_layers_text("1x1,1xfull")
    n = 2 * wr.MAX_MOVES + 2
    doc_lengths = [100] * (n // 2)
    heavy = [[Shard(d, 0, 100)] for d in range(n // 2)]
    prefix = WeightedPrefix(doc_lengths, mask)
    shards = heavy + [[] for _ in range(n // 2)]
    layout = Layout([GroupLayout(tuple(range(n)), shards)], {})
    assert wr.repaired_layout(layout, weighted_loads(shards, mask), prefix, mask, 1.05,
                              100) is None


def test_a_layout_of_more_shards_than_the_bound_is_left_alone():
    mask = parse_layers_text("1x1,1xfull")
    doc_lengths = [1] * (wr.MAX_SHARDS + 1)
    shards = [[Shard(d, 0, 1) for d in range(wr.MAX_SHARDS + 1)], []]
    layout = Layout([GroupLayout((0, 1), shards)], {})
    assert wr.repaired_layout(layout, weighted_loads(shards, mask),
                              WeightedPrefix(doc_lengths, mask), mask, 1.05, 10**6) is None
    shards = [[Shard(d, 0, 1) for d in range(wr.MAX_SHARDS)], []]
    layout = Layout([GroupLayout((0, 1), shards)], {})
    assert wr.repaired_layout(layout, weighted_loads(shards, mask),
                              WeightedPrefix(doc_lengths, mask), mask, 1.05, 10**6) is not None


def test_the_repair_is_a_candidate_beside_the_chunks_and_can_win():
    """On a Pile-like 128K sequence at N = 8 flashcp's causal plan misses R under a
    Gemma-3-like mask; the repaired plan meets it and moves less KV than any other
    candidate within R, and the chunks were still tried."""
    mask = parse_layers_text("5x1024,1xfull")
    (lengths,) = pack_sequences(make_source("family:pile"), context_length=131072,
                                num_sequences=1, seed=0)
    plan = solve(PlanRequest(doc_lengths=tuple(lengths), cp_size=8, mask=mask))
    figures = {c["candidate"]: c for c in plan.info["mask_candidates"]}
    assert figures["flashcp"]["weighted_imbalance"] > 1.05
    assert figures["flashcp repaired"]["weighted_imbalance"] <= 1.05
    assert any(name.startswith("chunks") for name in figures)
    assert plan.info["mask_candidate"] == "flashcp repaired"
    assert plan.metrics.imbalance <= 1.05
    assert plan.metrics.comm_tokens == figures["flashcp repaired"]["weighted_comm_tokens"]
