"""The step-time model under a sliding window: the flash paths' windowed gathered call
against tile counts pair by pair and terms written out, causal figures where the window
covers everything, plan metrics' layer-weighted ``est_*`` and ``auto`` ranking by them."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.mask import CAUSAL, parse_mask
from planner_service.core.metrics import group_metrics
from planner_service.core.model import ModelSpec
from planner_service.core.plan import Shard
from planner_service.core.profiles import get_kernel_profile, get_link_profile
from planner_service.core.request import debug_request
from planner_service.core.step_time import group_steps, plan_rank_terms, rank_step, rank_terms
from planner_service.core.step_time.gathered import gathered_rows
from planner_service.core.step_time.terms import KernelWork
from planner_service.core.window_tiles import reference_window_tiles
from planner_service.solvers.registry import solve

MODES = ("alltoallv", "compact_allgather", "full", "p2p_ring")
KERNEL = replace(get_kernel_profile("h100-fa2"), tile_q=16, tile_k=8)
LINK = get_link_profile("nvlink")
MODEL = ModelSpec()


def random_group(rng: random.Random, n: int) -> list[list[Shard]]:
    """A few docs of up to 120 tokens cut at random points, pieces dealt to n ranks."""
    ranks: list[list[Shard]] = [[] for _ in range(n)]
    for doc in range(rng.randint(1, 5)):
        length = rng.randint(1, 120)
        cuts = sorted({0, length, *(rng.randint(1, length) for _ in range(rng.randint(0, 3)))})
        for s, e in zip(cuts, cuts[1:], strict=False):
            ranks[rng.randrange(n)].append(Shard(doc, s, e))
    return [sorted(r) for r in ranks]


def window_recv(shards: list[list[Shard]], window: int | None, mode: str, tpr: int) -> tuple[int, ...]:
    """The window's receive; ``p2p_ring``: the ring's ``steps_run`` blocks, what the runtime's
    gathered form of a ring plan moves under a window."""
    arrays = cost.shard_arrays(shards)
    ring = ww.ring_schedule_of(arrays, window) if mode == "p2p_ring" and window else None
    return ww.recv_tokens(mode, ww.window_comm_volumes_of(arrays, window), tpr, ring)


def case(seed: int) -> tuple[list[list[Shard]], int, int]:
    rng = random.Random(seed)
    n = rng.randint(1, 5)
    shards = random_group(rng, n)
    tpr = max(sum(s.end - s.start for s in r) for r in shards) + rng.randint(0, 3)
    return shards, n, tpr


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [1, 2, 7, 16, 45, 1000])
def test_windowed_terms_against_tiles_pair_by_pair_and_the_gathered_call_written_out(
        mode: str, window: int) -> None:
    for seed in range(8):
        shards, n, tpr = case(seed)
        recv = window_recv(shards, window, mode, tpr)
        arrays = cost.shard_arrays(shards)
        group = group_steps(arrays, recv_tokens=np.asarray(recv), tokens_per_rank=tpr, num_ranks=n,
                            comm_mode=mode, model=MODEL, kernel=KERNEL, link=LINK, window=window)
        for i, rank in enumerate(shards):
            # A ring plan's gathered form reads each window span from the ring's blocks.
            halo = mode in ("alltoallv", "compact_allgather", "p2p_ring")
            tiles = sum(reference_window_tiles(s.start, s.end - s.start, window, 16, 8, halo=halo)
                        for s in rank)
            keys = sum(s.end - (max(0, s.start - window + 1) if halo else 0) for s in rank)
            real = sum(s.end - s.start for s in rank)
            t = rank_terms(rank, recv_tokens=recv[i], tokens_per_rank=tpr, num_ranks=n,
                           comm_mode=mode, model=MODEL, kernel=KERNEL, link=LINK, window=window)
            assert t.work == KernelWork(tiles * 16 * 8, tiles, len(rank),
                                        sum(-(-(s.end - s.start) // 16) for s in rank), 1)
            assert t.rows == gathered_rows(tpr, real, recv[i], keys)
            assert t.comm_bytes == 2 * recv[i] * MODEL.kv_bytes_per_token
            assert t.comm_ms == t.transfer_ms  # blocking: nothing hidden
            step = rank_step(rank, recv_tokens=recv[i], tokens_per_rank=tpr, num_ranks=n,
                             comm_mode=mode, model=MODEL, kernel=KERNEL, link=LINK, window=window)
            assert group.total_ms[i] == pytest.approx(step.total_ms, rel=1e-12, abs=1e-15)
            assert group.attn_ms[i] == pytest.approx(step.attn_ms, rel=1e-12, abs=1e-15)
            assert group.comm_ms[i] == pytest.approx(step.comm_ms, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("mode", MODES)
def test_a_window_covering_every_position_gives_the_gathered_paths_causal_figures(mode: str) -> None:
    for seed in range(8):
        shards, n, tpr = case(seed)
        recv = window_recv(shards, None, mode, tpr)
        if mode == "p2p_ring":
            # The ring still stops after its last useful step (causal layers run N - 1):
            # steps_run blocks of tpr, steps_run from the key-set reference.
            steps = np.flatnonzero(ww.reference_ring_useful(shards, 121).any(axis=0))
            run = int(steps[-1]) if len(steps) else 0
            assert window_recv(shards, 121, mode, tpr) == (run * tpr,) * n
        else:
            assert window_recv(shards, 121, mode, tpr) == recv
        for i, rank in enumerate(shards):
            kw = dict(recv_tokens=recv[i], tokens_per_rank=tpr, num_ranks=n, comm_mode=mode,
                      model=MODEL, kernel=KERNEL, link=LINK)
            causal = rank_terms(rank, flash_path="gathered", **kw)
            for window in (121, 10**6):
                assert rank_terms(rank, window=window, **kw) == causal
                assert rank_terms(rank, window=window, flash_path="gathered", **kw) == causal


def test_window_one_computes_one_tile_per_query_tile_and_time_is_monotone_in_w() -> None:
    kernel = replace(KERNEL, tile_k=16)
    for seed in range(8):
        shards, n, tpr = case(seed)
        for mode in MODES:
            last = [-1.0] * n
            for window in (1, 2, 5, 16, 33, 64, 121):
                recv = window_recv(shards, window, mode, tpr)
                for i, rank in enumerate(shards):
                    t = rank_terms(rank, recv_tokens=recv[i], tokens_per_rank=tpr, num_ranks=n,
                                   comm_mode=mode, model=MODEL, kernel=kernel, link=LINK,
                                   window=window)
                    if window == 1 and mode in ("alltoallv", "compact_allgather"):
                        assert t.work.tiles == t.work.row_blocks
                    total = float(t.kernel_ms + t.copy_ms + t.comm_ms + t.linear_ms)
                    assert total >= last[i] - 1e-12
                    last[i] = total


def test_the_torch_kernels_ring_is_priced_and_a_bad_window_refused_naming_window() -> None:
    rank = [Shard(0, 0, 10)]
    kw = dict(recv_tokens=0, tokens_per_rank=10, num_ranks=1, comm_mode="alltoallv", model=MODEL,
              link=LINK)
    rank_step(rank, kernel=get_kernel_profile("cpu-torch"), window=4,
              **{**kw, "comm_mode": "p2p_ring"})  # the ring (windowed_ring.py)
    rank_step(rank, kernel=get_kernel_profile("cpu-torch"), window=4, **kw)  # the lean path
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="^window must be"):
            rank_step(rank, kernel=KERNEL, window=bad, **kw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strategy", ["flashcp", "zigzag", "contiguous_halo"])
def test_masked_est_is_the_layer_weighted_sum_of_each_groups_slowest_rank(
        mode: str, strategy: str) -> None:
    mask = parse_mask(layers="3x64,2x1024,1xfull")
    plan = solve(debug_request(strategy=strategy, comm_mode=mode, mask=mask, kernel="h100-fa2"))
    (group,) = plan.groups
    causal, _ = group_metrics(group.shards, group.padding, comm_mode=mode, model=plan.model,
                              kernel=plan.kernel, link=plan.link, mask=CAUSAL)
    expect = [0.0, 0.0, 0.0, 0.0]
    for g in mask.groups:
        if g.window is None:
            est = (causal.est_step_ms, causal.est_attn_ms, causal.est_comm_ms, causal.est_linear_ms)
        else:
            ranks = plan_rank_terms(plan, get_kernel_profile(plan.kernel), get_link_profile(plan.link),
                                    window=g.window)
            slowest = max(ranks, key=lambda r: (r.estimate.total_ms, -r.rank)).estimate
            est = (slowest.total_ms, slowest.attn_ms, slowest.comm_ms, slowest.linear_ms)
        for j in range(4):
            expect[j] += g.layers / mask.num_layers * est[j]
    m = plan.metrics
    got = (m.est_step_ms, m.est_attn_ms, m.est_comm_ms, m.est_linear_ms)
    assert got == pytest.approx(tuple(expect), rel=1e-12)
    assert m.est_step_ms < causal.est_step_ms or mode in ("full", "p2p_ring")


def test_auto_under_a_mask_picks_the_least_weighted_prediction() -> None:
    mask = parse_mask(layers="5x1024,1xfull")
    plan = solve(debug_request(strategy="auto", mask=mask, kernel="h100-fa2"))
    preds = [p for p in plan.info["candidates"] if not p.get("saves_nothing")]
    assert any(p["strategy"] == "contiguous_halo" for p in preds)
    best = min(preds, key=lambda p: p["est_step_ms"])
    assert (plan.info["chosen"], plan.info["comm_mode"]) == (best["strategy"], best["comm_mode"])
    assert plan.metrics.est_step_ms == pytest.approx(best["est_step_ms"], rel=1e-12)
    chosen = solve(debug_request(strategy=best["strategy"], comm_mode=best["comm_mode"],
                                 mask=mask, kernel="h100-fa2"))
    assert chosen.metrics.est_step_ms == pytest.approx(best["est_step_ms"], rel=1e-12)
