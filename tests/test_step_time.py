"""The step-time model describes what the runtime runs, and its profile follows the kernel."""

from __future__ import annotations

import numpy as np
import pytest

from planner_service.core.model import ModelSpec
from planner_service.core.plan import Shard
from planner_service.core.profiles import (
    KERNEL_PROFILES,
    LINK_PROFILES,
    default_kernel_profile,
    kernel_profile_from_dict,
)
from planner_service.core.request import PlanRequest
from planner_service.core.step_time import key_rows, packed_blocks, rank_step
from planner_service.solvers.registry import solve
from worker_runtime.kernels import build_meta

MODEL = ModelSpec()
FA2, NVLINK = KERNEL_PROFILES["h100-fa2"], LINK_PROFILES["nvlink"]


def step(shards, *, recv=0, tokens=None, n=2, mode="full", kernel=FA2):
    tokens = tokens if tokens is not None else sum(s.end - s.start for s in shards)
    return rank_step(shards, recv_tokens=recv, tokens_per_rank=tokens, num_ranks=n, comm_mode=mode,
                     model=MODEL, kernel=kernel, link=NVLINK)


@pytest.mark.parametrize("shards", [
    [Shard(0, 0, 700)],
    [Shard(0, 300, 900), Shard(1, 0, 5), Shard(2, 40, 41), Shard(3, 0, 1300)],
    [Shard(d, 0, 3) for d in range(200)],
])
def test_packed_blocks_match_the_torch_kernels_blocks(shards):
    lq = [s.end - s.start for s in shards]
    lk = [s.end for s in shards]
    meta = build_meta(np.cumsum([0, *lq]), np.cumsum([0, *lk]), block_q=64, block_k=128)
    pairs = sum((q1 - q0) * (keys[-1][1] - keys[0][0]) for q0, q1, keys in meta.blocks)
    blocks = sum(len(keys) for _, _, keys in meta.blocks)
    assert packed_blocks(shards, 64, 128) == (pairs, blocks, len(meta.blocks))


def test_ring_is_charged_as_the_full_all_gather_it_runs():
    shards = [Shard(0, 0, 4096)]
    ring = step(shards, recv=3 * 4096, n=4, mode="p2p_ring")
    full = step(shards, recv=3 * 4096, n=4, mode="full")
    assert ring == full
    # No overlap credit: the exposed exchange is the whole transfer, both passes.
    nbytes = 3 * 4096 * MODEL.kv_bytes_per_token
    assert ring.comm_ms == pytest.approx(2 * (NVLINK.latency_us * 1e-3 + nbytes / NVLINK.bandwidth_gbps / 1e6))
    assert ring.total_ms == pytest.approx(ring.kernel_ms + ring.copy_ms + ring.comm_ms + ring.linear_ms)


def test_padding_costs_copies_and_linear_not_kernel():
    shards = [Shard(0, 0, 1000)]
    bare, padded = step(shards, tokens=1000), step(shards, tokens=1500)
    assert padded.kernel_ms == bare.kernel_ms
    assert padded.copy_ms > bare.copy_ms and padded.linear_ms > bare.linear_ms


def test_key_gathers_are_charged():
    # Same queries; the late shard gathers 8K keys, the early one 1K.
    late, early = [Shard(0, 7168, 8192)], [Shard(0, 0, 1024)]
    assert key_rows(late) == 8192 and key_rows(early) == 1024
    assert step(late).copy_ms > step(early).copy_ms


def test_plan_estimate_uses_the_named_profile():
    req = dict(doc_lengths=(8192, 4096, 4096), cp_size=4, strategy="flashcp")
    fa2 = solve(PlanRequest(**req, kernel="h100-fa2"))
    fa3 = solve(PlanRequest(**req, kernel="h100-fa3"))
    assert (fa2.kernel, fa3.kernel) == ("h100-fa2", "h100-fa3")
    assert fa2.metrics.est_attn_ms > fa3.metrics.est_attn_ms


def test_fa2_and_fa3_profiles_differ():
    assert FA2.fwd_tflops < KERNEL_PROFILES["h100-fa3"].fwd_tflops
    assert (FA2.tile_q, FA2.tile_k) == (128, 64)
    assert kernel_profile_from_dict(FA2.to_dict()) == FA2


@pytest.mark.parametrize(("env", "installed", "want"), [
    ({}, "2.8.3", "h100-fa2"),
    ({}, "3.0.0b1", "h100-fa3"),
    ({}, None, "h100-fa2"),
    ({"PLANNER_KERNEL_PROFILE": "h100-fa3"}, "2.8.3", "h100-fa3"),
])
def test_default_profile_follows_the_installed_or_declared_kernel(env, installed, want):
    name, why = default_kernel_profile(env, installed)
    assert name == want and why


def test_declared_profile_must_exist():
    with pytest.raises(ValueError, match="kernel profile 'nope' is unknown"):
        default_kernel_profile({"PLANNER_KERNEL_PROFILE": "nope"}, None)


def test_bad_profile_field_is_named():
    with pytest.raises(ValueError, match="kernel.tiling"):
        kernel_profile_from_dict({**FA2.to_dict(), "tiling": "diagonal"})
    with pytest.raises(ValueError, match="kernel.copy_gbps"):
        kernel_profile_from_dict({**FA2.to_dict(), "copy_gbps": 0.0})
