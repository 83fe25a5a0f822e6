"""PlanAgreement: every rank runs the same plan whether the planning rank's service is
slow, down or back after a restart (2 gloo ranks; the service is a scripted back end)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from timing import scaled

from planner_service.client.agreement import AgreementError, PlanAgreement, agree_on
from planner_service.client.backends import EmbeddedBackend, ServiceError, ServiceResult
from planner_service.data import make_source, pack_sequences
from worker_runtime.testing import run_distributed

pytestmark = pytest.mark.slow  # long: starts first under xdist (tests/conftest.py)

WORLD = 2
TIMEOUT_S = scaled(0.5)
"""The planning client's deadline; a 'slow' answer takes SLOW_S, far beyond it."""
SLOW_S = 3 * TIMEOUT_S
STEP_S = scaled(0.2)
"""Each step 'trains' this long, while the next batch is planned."""
SERVICE_STRATEGY = "zigzag"
"""What the scripted service plans with: its plans differ from the local flashcp fallback,
as a slow strategy's (ilp, auto) would."""
MODES = {"0": "ok", "1": "slow", "2": "slow", "3": "down", "4": "down",
         **{str(k): "ok" for k in range(5, 13)}}
"""Per batch, how the planning rank's service behaves: slow, then down, then restarted."""


class ScriptedService(EmbeddedBackend):
    """The embedded planner, answering with SERVICE_STRATEGY, slow or down per batch."""

    name = "http"

    def __init__(self, modes: dict[str, str]) -> None:
        super().__init__()
        self.modes = modes

    def submit(self, job: str, batch: str, request: dict[str, Any], timeout_s: float, *,
               fallbacks: int = 0) -> None:
        if self.modes.get(batch) == "down":
            raise ServiceError("unavailable", "ConnectError: connection refused")
        super().submit(job, batch, {**request, "strategy": SERVICE_STRATEGY}, timeout_s)

    def fetch(self, job: str, batch: str, wait_s: float, timeout_s: float
              ) -> ServiceResult | None:
        if self.modes.get(batch) == "slow":
            time.sleep(SLOW_S)
        return super().fetch(job, batch, wait_s, timeout_s)


def lengths() -> list[list[int]]:
    return pack_sequences(make_source("pile"), context_length=2048, num_sequences=len(MODES) + 1,
                          seed=3)


def agreement_worker(rank: int, world: int, modes_by_rank: list[dict[str, str]]) -> dict:
    import torch
    import torch.distributed as dist

    from planner_service.client import PlanClient
    from worker_runtime import ContextParallelAttention

    seqs = lengths()
    side = dist.new_group(backend="gloo")
    # Every rank holds a client (as a job might); only rank 0's is asked through the helper.
    client = PlanClient(ScriptedService(modes_by_rank[rank]), cp_size=world, strategy="ilp",
                        job=f"agree-{rank}", timeout_s=TIMEOUT_S)
    client.plan(seqs[0])  # imports and first solve, as a job's start-up would do
    planner = PlanAgreement(client, group=side)
    steps = []
    planner.prefetch(0, seqs[0])
    for k in range(len(MODES)):
        got = planner.get(k)
        if k + 1 < len(MODES):
            planner.prefetch(k + 1, seqs[k + 1])
        attn = ContextParallelAttention(got.plan, group=None, agreed=True, verify="never")
        q = torch.randn(attn.num_tokens, 2, 8, generator=torch.Generator().manual_seed(k))
        out = attn(q, q[:, :1], q[:, :1])
        time.sleep(STEP_S)
        steps.append({"plan_id": got.plan_id, "fallback": got.fallback, "reason": got.reason,
                      "finite": bool(torch.isfinite(out).all())})
    # Without the helper each rank asks on its own: a slow answer on one rank splits them.
    naive = client.get("naive", doc_lengths=seqs[-1]).plan_id
    planner.close()
    client.close()
    return {"steps": steps, "naive": naive, "error": planning_error(rank, side)}


def planning_error(rank: int, group: Any) -> str:
    """What each rank raises when the planning rank gets input no planner accepts."""
    def produce() -> str:
        raise ServiceError("422", "doc_lengths: bad input")

    try:
        agree_on(produce if rank == 0 else None, encode=str, decode=str, group=group)
    except AgreementError as exc:
        return f"agreement: {exc}"
    except ServiceError as exc:
        return f"service: {exc}"
    return "no error"


def test_every_rank_runs_the_same_plan_when_the_service_is_slow_down_or_restarted():
    slow_naive = {**MODES, "naive": "slow"}
    fast_naive = {k: "ok" for k in slow_naive}  # rank 1's own service is fine throughout
    per_rank = run_distributed(agreement_worker, WORLD, [slow_naive, fast_naive],
                               timeout_s=scaled(120))
    steps0, steps1 = per_rank[0]["steps"], per_rank[1]["steps"]
    assert [s["plan_id"] for s in steps0] == [s["plan_id"] for s in steps1]
    assert steps0 == steps1
    assert all(s["finite"] for s in steps0)
    by_mode = {mode: [steps0[int(k)] for k, m in MODES.items() if m == mode]
               for mode in ("ok", "slow", "down")}
    assert not steps0[0]["fallback"], "the service answered batch 0"
    assert all(s["fallback"] for s in by_mode["slow"] + by_mode["down"])
    assert not any(s["fallback"] for s in steps0[-2:]), "the service is used again"
    assert per_rank[0]["naive"] != per_rank[1]["naive"], "the hazard the helper removes"
    # Input no planner accepts: every rank raises, none is left waiting.
    assert per_rank[0]["error"] == "service: 422: doc_lengths: bad input"
    assert per_rank[1]["error"].startswith("agreement: rank 0 (the planning rank) failed: "
                                           "ServiceError")


def test_without_torch_distributed_the_source_plans_alone():
    assert agree_on(lambda: 7, encode=str, decode=int) == 7
    with pytest.raises(ValueError, match="source rank must pass produce"):
        agree_on(None, encode=str, decode=int)


def test_agreed_runtime_skips_the_all_gather_but_still_refuses_a_plan_it_cannot_run():
    from planner_service.core.request import PlanRequest
    from planner_service.solvers.registry import solve
    from worker_runtime import CollectiveCheckError, ContextParallelAttention

    plan = solve(PlanRequest(doc_lengths=(30, 10), cp_size=2, strategy="flashcp"))
    with pytest.raises(CollectiveCheckError, match="cp_size is 2 but the process group has 1"):
        ContextParallelAttention(plan, agreed=True)
    one = solve(PlanRequest(doc_lengths=(30, 10), cp_size=1, strategy="flashcp"))
    assert ContextParallelAttention(one, agreed=True).num_tokens == 40
