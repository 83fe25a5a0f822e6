"""Misuse fails on every rank, quickly, with a message naming the culprit: mismatched
plan_ids, wrong local lengths, a plan for another world size. Plus the plan broadcast.

All scenarios run in one spawned world (a CollectiveCheckError leaves the process group
usable, since every rank raised after the same collective)."""

from __future__ import annotations

import time

import pytest
import torch
from timing import scaled

from planner_service.core.model import ModelSpec
from planner_service.core.plan import Plan
from planner_service.core.request import PlanRequest
from planner_service.solvers.registry import solve
from worker_runtime import CollectiveCheckError, ContextParallelAttention, broadcast_plan
from worker_runtime.testing import run_distributed

pytestmark = pytest.mark.slow  # long: starts first under xdist (tests/conftest.py)

WORLD_SIZE = 4
RAISE_WITHIN_S = 30.0
MODEL = ModelSpec(num_heads=2, num_kv_heads=1, head_dim=4, dtype_bytes=8)


def plan_for(lengths: list[int], cp_size: int = WORLD_SIZE) -> Plan:
    return solve(PlanRequest(doc_lengths=lengths, cp_size=cp_size, strategy="flashcp", model=MODEL))


def local_qkv(attn: ContextParallelAttention, drop: int = 0) -> tuple[torch.Tensor, ...]:
    t = attn.num_tokens - drop
    return (torch.randn(t, 2, 4, dtype=torch.float64), torch.randn(t, 1, 4, dtype=torch.float64),
            torch.randn(t, 1, 4, dtype=torch.float64))


def outcome(fn) -> dict:
    """Run a scenario; report the error text (or None) and how long it took."""
    start = time.monotonic()
    try:
        fn()
        error = None
    except CollectiveCheckError as exc:
        error = str(exc)
    return {"error": error, "seconds": time.monotonic() - start}


def safety_worker(rank: int, world_size: int, plans: dict[str, str]) -> dict:
    good, other, wide = (Plan.from_json(plans[k]) for k in ("good", "other", "wide"))
    out = {}
    # rank 0 runs a different plan than the others.
    out["plan_id"] = outcome(lambda: ContextParallelAttention(other if rank == 0 else good))
    # rank 2 passes one token too few.
    attn = ContextParallelAttention(good)
    out["length"] = outcome(lambda: attn(*local_qkv(attn, drop=1 if rank == 2 else 0)))
    # The plan is for 8 ranks, the world has 4.
    out["cp_size"] = outcome(lambda: ContextParallelAttention(wide))
    # verify='always' checks later calls too; rank 1 switches dtype on the second call.
    attn = ContextParallelAttention(good, verify="always")
    attn(*local_qkv(attn))
    qkv = local_qkv(attn)
    if rank == 1:
        qkv = tuple(t.float() for t in qkv)
    out["later_call"] = outcome(lambda: attn(*qkv))
    # Only rank 0 fetched the plan; everyone gets it.
    received = broadcast_plan(good if rank == 0 else None)
    out["broadcast"] = received.plan_id == good.plan_id and received == good
    # The runtime still works after all of the above.
    attn = ContextParallelAttention(received)
    out["healthy"] = attn(*local_qkv(attn)).shape[0] == attn.num_tokens
    return out


def test_every_rank_raises_quickly_on_misuse() -> None:
    plans = {
        "good": plan_for([37, 1, 90, 12, 5, 44]),
        "other": plan_for([37, 1, 90, 12, 5, 45]),
        "wide": plan_for([37, 1, 90, 12, 5, 44], cp_size=8),
    }
    start = time.monotonic()
    per_rank = run_distributed(safety_worker, WORLD_SIZE, {k: p.to_json() for k, p in plans.items()},
                               timeout_s=scaled(90.0))
    assert time.monotonic() - start < scaled(90.0)
    expect = {
        "plan_id": "plan_id differs across ranks",
        "length": "rank 2: q/k/v have",
        "cp_size": "plan.cp_size is 8 but the process group has 4 ranks",
        "later_call": "dtype differs across ranks",
    }
    for rank, res in enumerate(per_rank):
        for scenario, text in expect.items():
            error = res[scenario]["error"]
            assert error is not None and text in error, f"rank {rank} {scenario}: {error!r}"
            assert res[scenario]["seconds"] < scaled(RAISE_WITHIN_S), f"rank {rank} {scenario} took too long"
        assert res["broadcast"] and res["healthy"]
