"""Sliding-window accounting (core/window_work.py) against the token-by-token reference,
and, for windows no document fills, equal to the causal figures of core/cost.py and
core/metrics.py."""

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.mask import CAUSAL, AttentionMask, LayerGroup
from planner_service.core.metrics import group_metrics
from planner_service.core.model import ModelSpec
from planner_service.core.plan import Shard
from planner_service.core.profiles import default_kernel_name

WINDOWS = (1, 7, 128, 4096)
COMM_MODES = ("full", "compact_allgather", "alltoallv", "p2p_ring")


def random_plan(rng: random.Random, num_ranks: int, docs: int, max_len: int
                ) -> list[list[Shard]]:
    """Docs cut at random points, each piece on a random rank; each rank's shards in
    (doc, start) order, as plans hold them."""
    ranks: list[list[Shard]] = [[] for _ in range(num_ranks)]
    for doc in range(docs):
        length = rng.randint(1, max_len)
        cuts = sorted(rng.sample(range(1, length), min(length - 1, rng.randint(0, 6))))
        for a, b in zip([0, *cuts], [*cuts, length], strict=True):
            ranks[rng.randrange(num_ranks)].append(Shard(doc, a, b))
    return [sorted(rank) for rank in ranks]


def arrays_of(plan):
    arrays = cost.shard_arrays(plan)
    assert arrays is not None
    return arrays


def test_shard_workload_hand_computed():
    # Window 3: positions 0, 1, 2, 3, 4 attend 1, 2, 3, 3, 3 keys.
    assert ww.shard_window_workload(0, 5, 3) == 12
    assert ww.shard_window_workload(1, 4, 3) == 8
    assert ww.shard_window_workload(3, 5, 3) == 6
    assert ww.shard_window_workload(0, 5, 1) == 5  # each token only itself
    assert ww.shard_window_workload(2, 9, None) == cost.shard_workload(2, 7)
    assert ww.shard_window_workload(2, 9, 9) == cost.shard_workload(2, 7)


def test_halo_hand_computed():
    assert ww.halo(10, 4) == ww.Halo(7, 10) and ww.halo(10, 4).length == 3
    assert ww.halo(2, 4) == ww.Halo(0, 2)
    assert ww.halo(10, 1).length == 0
    assert ww.halo(10, None) == ww.Halo(0, 10)


def test_volumes_hand_computed():
    # Doc 0 (len 10) in three shards: rank 0 [0, 4), rank 1 [4, 7), rank 2 [7, 10).
    plan = [[Shard(0, 0, 4)], [Shard(0, 4, 7)], [Shard(0, 7, 10)]]
    volumes = ww.window_comm_volumes_of(arrays_of(plan), 3)
    # Halo of 2 keys each for ranks 1 and 2; ranks 0 and 1 send their last 2 tokens.
    assert volumes.alltoallv_recv == (0, 2, 2)
    assert volumes.allgather_send == (2, 2, 0)
    assert ww.window_comm_volumes_of(arrays_of(plan), None) == cost.comm_volumes(plan)
    ring = ww.ring_schedule_of(arrays_of(plan), 3)
    assert ring.useful[1, 1] and ring.useful[2, 1] and ring.useful.sum() == 2
    assert ring.steps_run == 1 and ring.useful_steps == (0, 1, 1)
    causal = ww.ring_schedule_of(arrays_of(plan), None)
    assert causal.steps_run == 2 and causal.useful[2, 2]  # rank 2 needs rank 0's block


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("window", (*WINDOWS, None))
def test_closed_forms_equal_the_token_by_token_reference(seed, window):
    rng = random.Random(seed)
    plan = random_plan(rng, rng.randint(1, 6), rng.randint(1, 5), 40)
    arrays = arrays_of(plan)
    assert ww.rank_window_workloads_of(arrays, window) == [
        sum(ww.reference_shard_workload(s, e, window) for _, s, e in rank) for rank in plan]
    assert ww.window_comm_volumes_of(arrays, window) == ww.reference_comm_volumes(plan, window)
    assert (ww.ring_schedule_of(arrays, window).useful
            == ww.reference_ring_useful(plan, window)).all()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_closed_forms_equal_the_reference_on_generated_plans(data):
    n = data.draw(st.integers(1, 5))
    lengths = data.draw(st.lists(st.integers(1, 30), min_size=1, max_size=4))
    window = data.draw(st.sampled_from((1, 2, 3, 7, 31, None)))
    plan: list[list[Shard]] = [[] for _ in range(n)]
    for doc, length in enumerate(lengths):
        cuts = sorted(data.draw(st.sets(st.integers(1, max(1, length - 1)), max_size=5)))
        cuts = [c for c in cuts if 0 < c < length]
        for a, b in zip([0, *cuts], [*cuts, length], strict=True):
            plan[data.draw(st.integers(0, n - 1))].append(Shard(doc, a, b))
    plan = [sorted(rank) for rank in plan]
    arrays = arrays_of(plan)
    assert ww.window_comm_volumes_of(arrays, window) == ww.reference_comm_volumes(plan, window)
    assert (ww.ring_schedule_of(arrays, window).useful
            == ww.reference_ring_useful(plan, window)).all()
    assert ww.rank_window_workloads_of(arrays, window) == [
        sum(ww.reference_shard_workload(s, e, window) for _, s, e in rank) for rank in plan]


def test_empty_shards_and_ranks_count_nothing():
    plan = [[Shard(0, 3, 3), Shard(0, 5, 9)], [], [Shard(0, 0, 5)]]
    arrays = arrays_of(plan)
    for window in (1, 2, 4, None):
        assert ww.window_comm_volumes_of(arrays, window) == ww.reference_comm_volumes(plan, window)
        assert (ww.ring_schedule_of(arrays, window).useful
                == ww.reference_ring_useful(plan, window)).all()


@pytest.mark.parametrize("seed", range(12))
def test_a_window_no_doc_fills_gives_the_causal_figures_of_cost_and_metrics(seed):
    rng = random.Random(1000 + seed)
    n = rng.choice((1, 2, 3, 5, 8, 16))
    plan = random_plan(rng, n, rng.randint(1, 40), 3000)
    arrays = arrays_of(plan)
    longest = max((e for rank in plan for _, _, e in rank), default=1)
    padding = [0] * n
    metrics, stats = group_metrics(plan, padding, comm_mode="alltoallv", model=ModelSpec(),
                                   kernel=default_kernel_name(), link="nvlink")
    tokens = [sum(e - s for _, s, e in rank) for rank in plan]
    tpr = max(tokens)
    for window in (None, longest, longest + 1, 2**31 - 1):
        assert ww.rank_window_workloads_of(arrays, window) == cost.rank_workloads(plan) \
            == list(stats.workload)
        volumes = ww.window_comm_volumes_of(arrays, window)
        assert volumes == cost.comm_volumes(plan) == cost.comm_volumes_of(arrays).volumes
        assert volumes.alltoallv_recv == stats.alltoallv_recv
        assert volumes.allgather_send == stats.allgather_send
        assert volumes.alltoallv_tokens == metrics.alltoallv_tokens
        assert volumes.compact_allgather_tokens == metrics.compact_allgather_tokens
        for mode in COMM_MODES:
            assert ww.recv_tokens(mode, volumes, tpr) == cost.recv_tokens_by_mode(
                mode, cost.comm_volumes(plan), tpr)
        assert (ww.ring_schedule_of(arrays, window).useful
                == ww.ring_schedule_of(arrays, None).useful).all()


@pytest.mark.parametrize("seed", range(8))
def test_smaller_windows_never_cost_more(seed):
    rng = random.Random(2000 + seed)
    plan = random_plan(rng, rng.choice((2, 4, 8)), rng.randint(1, 30), 5000)
    arrays = arrays_of(plan)
    previous = None
    for window in (None, 4096, 128, 7, 1):
        figures = (np.array(ww.rank_window_workloads_of(arrays, window)),
                   ww.window_comm_volumes_of(arrays, window),
                   ww.ring_schedule_of(arrays, window))
        if previous is not None:
            assert (figures[0] <= previous[0]).all()
            assert all(a <= b for a, b in zip(figures[1].alltoallv_recv,
                                              previous[1].alltoallv_recv, strict=True))
            assert all(a <= b for a, b in zip(figures[1].allgather_send,
                                              previous[1].allgather_send, strict=True))
            assert not (figures[2].useful & ~previous[2].useful).any()
        previous = figures
    # Window 1: every token attends only itself, nothing moves.
    assert previous[1].alltoallv_tokens == 0 and previous[2].steps_run == 0


def test_ring_skipping_receives_steps_run_blocks():
    # Contiguous cut: rank i only needs rank i - 1 under a short window.
    plan = [[Shard(0, 100 * i, 100 * (i + 1))] for i in range(4)]
    arrays = arrays_of(plan)
    volumes = ww.window_comm_volumes_of(arrays, 16)
    ring = ww.ring_schedule_of(arrays, 16)
    assert ring.steps_run == 1
    assert ww.recv_tokens("p2p_ring", volumes, 100, ring) == (100,) * 4
    assert ww.recv_tokens("p2p_ring", volumes, 100) == (300,) * 4
    assert volumes.alltoallv_recv == (0, 15, 15, 15)


def test_mask_figures_are_the_layer_weighted_sums():
    rng = random.Random(7)
    plan = random_plan(rng, 4, 12, 4000)
    arrays = arrays_of(plan)
    tpr = max(sum(e - s for _, s, e in rank) for rank in plan)
    mask = AttentionMask((LayerGroup(1024, 5), LayerGroup(None, 1)))
    for mode in COMM_MODES:
        figures = ww.mask_figures_of(arrays, mask, comm_mode=mode, tokens_per_rank=tpr,
                                     skip_ring_steps=True)
        local, full = figures.layers
        assert (local.window, local.layers, full.window, full.layers) == (1024, 5, None, 1)
        assert figures.workload == tuple(
            5 * a + b for a, b in zip(ww.rank_window_workloads_of(arrays, 1024),
                                      cost.rank_workloads(plan), strict=True))
        assert full.recv == cost.recv_tokens_by_mode(mode, cost.comm_volumes(plan), tpr)
        assert figures.comm_tokens == 5 * max(local.recv) + max(full.recv)
        assert figures.recv == tuple(5 * a + b for a, b in zip(local.recv, full.recv,
                                                               strict=True))
    causal = ww.mask_figures_of(arrays, CAUSAL, comm_mode="alltoallv", tokens_per_rank=tpr)
    assert causal.workload == tuple(cost.rank_workloads(plan))
    assert causal.imbalance == cost.imbalance(cost.rank_workloads(plan))


def test_large_group_vectorised_forms_agree_with_cost():
    # Thousands of shards: the vectorised forms against the per-shard causal functions.
    rng = random.Random(11)
    plan = random_plan(rng, 64, 3000, 2000)
    arrays = arrays_of(plan)
    assert ww.window_comm_volumes_of(arrays, None) == cost.comm_volumes(plan)
    assert ww.rank_window_workloads_of(arrays, None) == cost.rank_workloads(plan)
    windowed = ww.window_comm_volumes_of(arrays, 128)
    assert max(windowed.alltoallv_recv) <= max(cost.comm_volumes(plan).alltoallv_recv)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 6))
def test_the_one_sort_alltoallv_figures_equal_mask_figures(seed, num_ranks):
    rng = random.Random(seed)
    plan = random_plan(rng, num_ranks, rng.randint(1, 8), rng.choice((5, 300, 5000)))
    # Not canonical: a shard cut in two touching pieces on its rank, and an empty shard.
    if plan[0]:
        doc, s, e = plan[0][0]
        if e - s > 1:
            plan[0][0:1] = [Shard(doc, s, s + 1), Shard(doc, s + 1, e), Shard(doc, e, e)]
    arrays = arrays_of(plan)
    tpr = max(sum(e - s for _, s, e in rank) for rank in plan)
    for mask in (AttentionMask((LayerGroup(1024, 5), LayerGroup(None, 1))),
                 AttentionMask((LayerGroup(1, 2), LayerGroup(7, 3))), CAUSAL):
        f = ww.mask_figures_of(arrays, mask, comm_mode="alltoallv", tokens_per_rank=tpr)
        assert ww.alltoallv_figures_of(arrays, mask) == (f.workload, f.comm_tokens)


def test_layer_weighted_is_the_per_rank_sum_in_exact_integers() -> None:
    rng = random.Random(5)
    for n in (0, 1, 3, 64):
        rows = [(rng.randint(1, 1 << 16), [rng.randint(0, 1 << 62) for _ in range(n)])
                for _ in range(rng.randint(1, 4))]
        assert ww.layer_weighted(rows) == tuple(
            sum(count * values[i] for count, values in rows) for i in range(n))
