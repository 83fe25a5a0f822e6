"""The windowed ring (step_time/windowed_ring.py) against a token-by-token reference, its
group form, and the causal ring under a window past every position."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from runtime_cases import random_plan

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.model import ModelSpec
from planner_service.core.plan import Shard
from planner_service.core.profiles import get_kernel_profile, get_link_profile
from planner_service.core.step_time import group_steps, rank_terms
from planner_service.core.step_time import windowed_ring as wr
from planner_service.core.step_time.blocks import shard_rows
from planner_service.core.step_time.terms import GroupInput, RankInput, Step
from worker_runtime.kernels import build_masked_meta

KERNEL = get_kernel_profile("cpu-torch")
LINK = get_link_profile("nvlink")
MODEL = ModelSpec()


def counted(meta) -> tuple[int, int, int]:
    pairs = sum((q1 - q0) * sum(k1 - k0 for k0, k1 in keys) for q0, q1, keys in meta.blocks)
    return pairs, sum(len(keys) for _, _, keys in meta.blocks), len(meta.blocks)


def slow_work(own, blocks, window: int, last: int) -> tuple[int, int, int, int]:
    """(pairs, key blocks, query blocks, calls): queries picked token by token, blocks by
    the runtime's own metadata."""
    doc, pos = shard_rows(own)
    total = np.array(counted(build_masked_meta(doc, pos, doc, pos, window=window)) + (1,))
    for block in blocks[:last]:
        k_doc, k_pos = shard_rows(block)
        rows = [q for q in range(len(doc))
                if any(k_doc[j] == doc[q] and pos[q] - window < k_pos[j] <= pos[q]
                       for j in range(len(k_doc)))]
        if rows:
            meta = build_masked_meta(doc[rows], pos[rows], k_doc, k_pos, window=window)
            total += np.array(counted(meta) + (1,))
    return tuple(int(x) for x in total)


def test_per_rank_and_group_forms_against_the_reference_and_the_causal_ring() -> None:
    causal_checked = 0
    for seed in range(8):
        n = 2 + seed % 4
        plan = random_plan(seed, n)
        group = plan.groups[0]
        arrays = cost.shard_arrays(group.shards)
        tpr = plan.metrics.tokens_per_rank
        for window in (1, 3, 7, 10**6):
            sched = ww.ring_schedule_of(arrays, window)
            volumes = ww.window_comm_volumes_of(arrays, window)
            recv = ww.recv_tokens("p2p_ring", volumes, tpr, sched)
            kw = dict(tokens_per_rank=tpr, num_ranks=n, comm_mode="p2p_ring", model=MODEL,
                      kernel=KERNEL, link=LINK)
            g = group_steps(arrays, recv_tokens=np.asarray(recv), window=window, **kw)
            for i, shards in enumerate(group.shards):
                blocks = [group.shards[(i - s) % n] for s in range(1, n)]
                t = rank_terms(shards, recv_tokens=recv[i], window=window, ring_blocks=blocks, **kw)
                w = t.work
                assert (w.pairs, w.tiles, w.row_blocks, w.calls) == slow_work(
                    shards, blocks, window, sched.steps_run)
                assert t.passes == (3 * sched.steps_run if recv[i] else 0)
                for name in ("kernel_ms", "copy_ms", "comm_ms", "linear_ms"):
                    assert getattr(g, name)[i] == pytest.approx(float(getattr(t, name)),
                                                                rel=1e-9, abs=1e-12)
                if window == 10**6 and sched.steps_run == n - 1:
                    causal = rank_terms(shards, recv_tokens=(n - 1) * tpr, ring_blocks=blocks, **kw)
                    assert recv[i] == (n - 1) * tpr
                    assert t == causal
                    causal_checked += 1
    assert causal_checked > 0


def _flat(x) -> tuple:
    """A NamedTuple of scalars, or of arrays at one rank, as plain Python values."""
    if isinstance(x, tuple):
        return tuple(_flat(f) for f in x)
    return np.asarray(x).item()


def _at(x, i: int) -> tuple:
    """Rank i's entry of a NamedTuple of arrays (a scalar field is every rank's)."""
    def one(f):
        if isinstance(f, tuple):
            return _at(f, i)
        f = np.asarray(f)
        return (f if f.ndim == 0 else f[i]).item()

    return tuple(one(f) for f in x)


SMALL_TILES = dataclasses.replace(KERNEL, tile_q=3, tile_k=2)
"""Blocks far smaller than the random plans' ranks: query blocks across shards and docs."""


def check_group_form_against_rank_by_rank(shards_per_rank, window: int, overlap: bool,
                                          kernel=KERNEL) -> int:
    """The vectorised group form (``group_parts``, ``group_terms``) equals ``_rank_work``
    and ``terms`` rank by rank exactly: every field (local and ring calls, queries, the
    hiding arrays, every term). Returns the group's steps_run."""
    n = len(shards_per_rank)
    arrays = cost.shard_arrays(shards_per_rank)
    real = np.diff(arrays.bounds)
    tpr = max(int(max((sum(s.end - s.start for s in r) for r in shards_per_rank), default=0)), 1)
    step = Step(tpr, n, "p2p_ring", MODEL, kernel, LINK, overlap)
    recv = np.array([(i * 7) % 5 for i in range(n)], dtype=np.int64) * tpr
    inp = GroupInput(step, arrays, recv, real, None)
    last, local, work, queries, hiding = wr.group_parts(inp, window)
    assert (hiding is None) == (not overlap)
    g = wr.group_terms(inp, window)
    for i, own in enumerate(shards_per_rank):
        blocks = [shards_per_rank[(i - s) % n] for s in range(1, n)]
        rin = RankInput(step, own, int(recv[i]), int(real[i]), None, blocks)
        assert (wr.steps_run(own, blocks, window) if blocks else 0) == last
        loc, w, q, h = wr._rank_work(rin, blocks, last, window)
        assert _at(local, i) == _flat(loc)
        assert _at(work, i) == _flat(w)
        assert queries[i].item() == q
        if overlap:
            assert _at(hiding, i) == _flat(h)
        assert _at(g, i) == _flat(wr.terms(rin, window))
    return last


@pytest.mark.parametrize("kernel", [KERNEL, SMALL_TILES], ids=["cpu-torch", "small-tiles"])
@pytest.mark.parametrize("overlap", [False, True])
def test_the_group_form_equals_the_per_rank_one_on_random_plans(overlap: bool, kernel) -> None:
    ran = 0
    for seed in range(30):
        n = 2 + seed % 15
        shards = random_plan(seed, n).groups[0].shards
        for window in (1, 3, 7, 128, 10**6):
            ran += check_group_form_against_rank_by_rank(shards, window, overlap, kernel) > 0
    assert ran > 0


@pytest.mark.parametrize("kernel", [KERNEL, SMALL_TILES], ids=["cpu-torch", "small-tiles"])
@pytest.mark.parametrize("overlap", [False, True])
def test_the_group_form_equals_the_per_rank_one_on_edge_cases(overlap: bool, kernel) -> None:
    rng = np.random.default_rng(5)
    ones = [[] for _ in range(6)]
    for d in range(40):  # many 1-token documents
        ones[int(rng.integers(6))].append(Shard(d, 0, 1))
    cases = [
        [[Shard(0, 0, 10), Shard(1, 0, 5)]],  # N = 1
        [[], [Shard(0, 0, 8)], [], [Shard(0, 8, 12)], []],  # empty ranks
        [[] for _ in range(4)],  # nothing at all
        [[Shard(0, 8 * r, 8 * r + 8)] for r in range(8)],  # one document filling the context
        [[Shard(0, 4 * r, 4 * r + 4), Shard(0, 60 - 4 * r, 64 - 4 * r)] for r in range(8)],
        ones,
        [[Shard(0, 0, 2)], [], [Shard(1, 0, 1)], [], [Shard(0, 2, 3)], *([[]] * 7)],  # N > tokens
        [[Shard(0, 600, 1000)], [Shard(0, 0, 300)], [Shard(0, 300, 600)]],  # T past a tile
    ]
    for shards in cases:
        for window in (1, 3, 7, 128, 10**6):
            check_group_form_against_rank_by_rank(shards, window, overlap, kernel)


def test_a_windowed_ring_above_the_block_bound_is_refused_naming_comm_mode() -> None:
    from planner_service.core.errors import FieldError

    # 16 ranks, one contiguous 2^24-token quarter... of one doc each: every later rank's
    # rows see every earlier block, 120 calls of 2^16 query blocks.
    n, t = 16, 1 << 24
    arrays = cost.shard_arrays([[Shard(0, r * t, (r + 1) * t)] for r in range(n)])
    kw = dict(tokens_per_rank=t, num_ranks=n, comm_mode="p2p_ring", model=MODEL, kernel=KERNEL,
              link=LINK)
    with pytest.raises(FieldError, match=f"at most {wr.MAX_STEP_BLOCKS} query blocks"):
        group_steps(arrays, recv_tokens=np.full(n, t, dtype=np.int64), window=1 << 30, **kw)


def test_a_large_windowed_ring_group_is_priced() -> None:
    """The request the rank-by-rank form refused (256 ranks, a 65,536 window: 255 steps)
    and 1,024 ranks (one 131,072-token document cut contiguously) under a small window
    price on the vectorised form."""
    from planner_service.core.mask import AttentionMask
    from planner_service.core.request import PlanRequest
    from planner_service.solvers.registry import solve

    request = PlanRequest(doc_lengths=(131072,), cp_size=256, context_length=None,
                          strategy="llama3", comm_mode="p2p_ring", kernel="cpu-torch",
                          mask=AttentionMask.uniform(65536))
    assert solve(request, check=False).metrics.est_step_ms > 0
    n, t = 1024, 128
    arrays = cost.shard_arrays([[Shard(0, r * t, (r + 1) * t)] for r in range(n)])
    for window in (7, 1000):
        steps = -(-(window - 1) // t)
        step = Step(t, n, "p2p_ring", MODEL, KERNEL, LINK, True)
        recv = np.full(n, steps * t, dtype=np.int64)
        g = wr.group_terms(GroupInput(step, arrays, recv, np.diff(arrays.bounds), None), window)
        assert (g.passes == 3 * steps).all()
        assert (g.work.calls[1:] == 1 + np.minimum(np.arange(1, n), steps)).all()
