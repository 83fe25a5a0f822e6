"""The step-time model of a sliding-window layer on the PyTorch kernel's lean path
(core/step_time/windowed_lean.py): its calls against a hand-counted case and against the
runtime's own windowed metadata (worker_runtime/paths/lean.py's rows, comm maps and
``build_masked_meta`` blocks), the group form against the per-rank one, a window at least
every position giving the causal lean terms, masked plans' estimates on the torch kernel."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_cases import random_plan

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.mask import parse_mask
from planner_service.core.model import ModelSpec
from planner_service.core.plan import Shard
from planner_service.core.profiles import get_kernel_profile, get_link_profile
from planner_service.core.request import debug_request
from planner_service.core.step_time import group_steps, rank_terms
from planner_service.core.step_time.windowed_lean import lean_window_work
from planner_service.solvers.registry import solve
from worker_runtime import build_layout
from worker_runtime.kernels import build_masked_meta
from worker_runtime.layout import build_comm_map
from worker_runtime.paths.lean import remote_query_rows
from worker_runtime.window_map import build_window_comm_map

KERNEL = get_kernel_profile("cpu-torch")
LINK = get_link_profile("nvlink")
MODEL = ModelSpec()
GATHER = ("alltoallv", "compact_allgather", "full")


def counted(meta) -> tuple[int, int, int]:
    """(pairs, key blocks, query blocks) of a ``build_masked_meta``."""
    pairs = sum((q1 - q0) * sum(k1 - k0 for k0, k1 in keys) for q0, q1, keys in meta.blocks)
    return pairs, sum(len(keys) for _, _, keys in meta.blocks), len(meta.blocks)


def test_a_hand_counted_case() -> None:
    """Doc of 10 tokens, rank 0 [0, 6), rank 1 [6, 10), W = 3, blocks 4 x 2, alltoallv.
    Rank 0: query blocks pos 0..3 (keys 0..3: 16 pairs, 2 key blocks) and 4..5 (keys 2..5:
    8 pairs, 2 blocks); no remote key. Rank 1: one block pos 6..9 reading keys 6..9 (16
    pairs, 2 blocks); halo {4, 5}; queries 6 and 7 see it (8 sees (5, 8]: none), one block
    reading keys 4..5 (4 pairs, 1 block)."""
    w0 = lean_window_work([Shard(0, 0, 6)], 4, 2, 3, "alltoallv")
    assert (w0.local.pairs, w0.local.tiles, w0.local.row_blocks) == (24, 4, 2)
    assert w0.remote_keys == 0 and w0.remote.queries == 0
    w1 = lean_window_work([Shard(0, 6, 10)], 4, 2, 3, "alltoallv")
    assert (w1.local.pairs, w1.local.tiles, w1.local.row_blocks) == (16, 2, 1)
    assert w1.remote_keys == 2
    assert (w1.remote.pairs, w1.remote.tiles, w1.remote.row_blocks, w1.remote.queries) == (4, 1, 1, 2)


@pytest.mark.parametrize("window", [1, 2, 7, 40, 10**6])
def test_the_calls_are_the_runtimes_windowed_metadata(window: int) -> None:
    for seed in range(6):
        n = 2 + seed % 4
        plan = random_plan(seed, n)
        for rank in range(n):
            lay = build_layout(plan, rank)
            shards = [Shard(*s) for s in lay.shards]
            r = lay.num_real
            doc, pos = lay.doc_ids[:r], lay.positions[:r]
            for mode in GATHER:
                comm = (build_comm_map(lay, "full") if mode == "full"
                        else build_window_comm_map(lay, mode, window))
                rows = remote_query_rows(lay, comm, window)
                local = build_masked_meta(doc, pos, doc, pos, block_q=8, block_k=4, window=window)
                remote = build_masked_meta(doc[rows], pos[rows], comm.remote_doc, comm.remote_pos,
                                           block_q=8, block_k=4, window=window)
                got = lean_window_work(shards, 8, 4, window, mode)
                assert (got.local.pairs, got.local.tiles, got.local.row_blocks) == counted(local)
                want_remote = counted(remote) if len(rows) else (0, 0, 0)
                assert (got.remote.pairs, got.remote.tiles, got.remote.row_blocks) == want_remote
                assert got.remote.queries == len(rows)
                assert got.remote_keys == len(comm.remote_index), (seed, rank, mode)


@pytest.mark.parametrize("mode", GATHER)
def test_group_form_per_rank_form_and_a_window_past_every_doc(mode: str) -> None:
    for seed in range(6):
        n = 2 + seed % 4
        plan = random_plan(seed, n)
        group = plan.groups[0]
        arrays = cost.shard_arrays(group.shards)
        tpr = plan.metrics.tokens_per_rank
        for window in (1, 7, 10**6):
            volumes = ww.window_comm_volumes_of(arrays, window)
            recv = ww.recv_tokens(mode, volumes, tpr)
            kw = dict(tokens_per_rank=tpr, num_ranks=n, comm_mode=mode, model=MODEL,
                      kernel=KERNEL, link=LINK)
            g = group_steps(arrays, recv_tokens=np.asarray(recv), window=window, **kw)
            for i, shards in enumerate(group.shards):
                t = rank_terms(shards, recv_tokens=recv[i], window=window, **kw)
                assert g.total_ms[i] == pytest.approx(float(t.kernel_ms + t.copy_ms + t.comm_ms
                                                            + t.linear_ms), rel=1e-9)
                if window == 10**6:
                    assert t == rank_terms(shards, recv_tokens=recv[i], **kw)


def test_masked_plans_on_the_torch_kernel_price_each_window() -> None:
    """A masked alltoallv plan on the torch kernel: est below the causal layer's (windows
    cut work), and the ring plan's too (windowed_ring.py)."""
    mask = parse_mask(layers="3x64,1xfull")
    lean = solve(debug_request(strategy="contiguous_halo", kernel="cpu-torch", mask=mask))
    causal = solve(debug_request(strategy="contiguous_halo", kernel="cpu-torch"))
    assert lean.metrics.est_attn_ms < causal.metrics.est_attn_ms
    ring = solve(debug_request(strategy="contiguous_halo", kernel="cpu-torch", mask=mask,
                               comm_mode="p2p_ring"))
    ring_causal = solve(debug_request(strategy="contiguous_halo", kernel="cpu-torch",
                                      comm_mode="p2p_ring"))
    assert ring.metrics.est_attn_ms < ring_causal.metrics.est_attn_ms
