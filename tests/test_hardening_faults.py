"""Faults: the server is SIGKILLed and restarted while a simulated
4-rank training loop runs.

Each rank is a thread with its own PlanClient on the same job (the pattern of a CP group:
every rank prefetches batch i+1 and asks for batch i's plan, then the group syncs). The
properties checked:

- the loop never stalls: every ``get`` returns within its deadline, outage or not;
- every rank of the group uses the same plan at every step, fallback steps included
  (fallbacks of a fast strategy are the same deterministic plan the service would give,
  so a rank that fell back and one the service answered still agree);
- nothing is lost or planned twice differently: the job store is in memory, so a
  SIGKILL forgets its batches (a GET answers 404, by design); what must hold is that
  resubmitting a batch's content after the restart gives the same plan_id as before the
  crash, and that batches submitted after the restart are served by the service again.
"""

from __future__ import annotations

import threading
import time

import httpx

from planner_service.client import PlanClient
from planner_service.core.request import PlanRequest
from planner_service.service.testing import ServerProcess
from planner_service.solvers.registry import solve

RANKS = 4
STEPS = 60
CRASH_AT = 12
DEADLINE_S = 0.5
SLACK_S = 0.3
"""A get() may overrun its deadline by thread scheduling on a loaded 2-core machine."""
STEP_S = 0.05
JOB = "train-run-1"
BASE = [30011, 4099, 37, 1023, 8191, 1, 511, 2047, 3001, 17, 6143, 733, 97, 5000, 9000]


def lengths_of(step: int) -> list[int]:
    rot = step % len(BASE)
    return [x + step for x in BASE[rot:] + BASE[:rot]]


def local_plan_id(step: int) -> str:
    return solve(PlanRequest(doc_lengths=tuple(lengths_of(step)), cp_size=8)).plan_id


def test_sigkill_and_restart_during_a_multi_rank_training_loop():
    server = ServerProcess(workers=1, grpc=False).start()
    port = server.http_port
    url = server.http_url
    records: dict[tuple[int, int], tuple[str, bool, float]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(RANKS + 1, timeout=30)  # the ranks and the chaos thread

    def rank(r: int) -> None:
        try:
            with PlanClient(url, cp_size=8, job=JOB, timeout_s=DEADLINE_S,
                            request_timeout_s=2.0) as client:
                client.prefetch(0, lengths_of(0))
                barrier.wait()  # set-up done: batch 0 was asked for ahead, like any other
                for step in range(STEPS):
                    client.prefetch(step + 1, lengths_of(step + 1))
                    start = time.monotonic()
                    got = client.get(step)
                    records[(r, step)] = (got.plan_id, got.fallback,
                                          time.monotonic() - start)
                    time.sleep(STEP_S)  # "train"
                    barrier.wait()  # the group's collective
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(RANKS)]
    for t in threads:
        t.start()
    pre_crash: dict[str, str] = {}
    try:
        # Batch 0 gets the lead every later batch has (prefetched a step ahead): the loop
        # starts once the service has planned it. Without this, step 0 alone had to be
        # planned within the deadline from a cold start, and on a loaded machine it fell
        # back (a fallback the crash did not cause).
        with httpx.Client(base_url=url, timeout=30) as c:
            until = time.monotonic() + 30
            while True:  # 404 until a rank's prefetch (a background PUT) has arrived
                r = c.get(f"/v1/jobs/{JOB}/batches/0", params={"wait_ms": 1000})
                if r.status_code == 200 or time.monotonic() > until:
                    break
                time.sleep(0.05)
            assert r.status_code == 200, r.status_code
        barrier.wait()
        for step in range(STEPS):
            if step == CRASH_AT:
                # A batch submitted straight before the crash, outside the loop.
                with httpx.Client(base_url=url, timeout=5) as c:
                    body = {"doc_lengths": lengths_of(1000), "cp_size": 8}
                    assert c.put(f"/v1/jobs/{JOB}/batches/direct", json=body).status_code \
                        in (200, 202)
                    r = c.get(f"/v1/jobs/{JOB}/batches/direct", params={"wait_ms": 5000})
                    assert r.status_code == 200
                    pre_crash["direct"] = r.headers["x-plan-id"]
                server.kill()  # SIGKILL: no drain, in-memory job store gone
                killed_at = time.monotonic()
            if step == CRASH_AT + 3:
                # Restart on the same port while the loop keeps going.
                server = ServerProcess(workers=1, grpc=False, http_port=port).start()
                restarted_at = time.monotonic()
            barrier.wait()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert len(records) == RANKS * STEPS

        # 1. Never stalled past the deadline.
        slowest = max(elapsed for _, _, elapsed in records.values())
        assert slowest < DEADLINE_S + SLACK_S, slowest

        # 2. Every rank used the same plan at every step, and it is the deterministic plan.
        fallback_steps = set()
        for step in range(STEPS):
            ids = {records[(r, step)][0] for r in range(RANKS)}
            assert ids == {local_plan_id(step)}, (step, ids)
            if any(records[(r, step)][1] for r in range(RANKS)):
                fallback_steps.add(step)
        assert fallback_steps, "the crash should have forced fallback plans"
        assert min(fallback_steps) >= CRASH_AT - 1, sorted(fallback_steps)

        # 3. Batches submitted after the restart are served by the service again.
        tail = range(STEPS - 10, STEPS)
        assert all(not records[(r, s)][1] for r in range(RANKS) for s in tail), \
            sorted(fallback_steps)
        print(f"outage {restarted_at - killed_at:.1f} s, fallback steps "
              f"{sorted(fallback_steps)}, slowest get {slowest * 1e3:.0f} ms")

        # 4. Nothing planned twice differently: the store forgot the pre-crash batch
        # (in memory, by design); resubmitting its content gives the same plan.
        with httpx.Client(base_url=server.http_url, timeout=5) as c:
            assert c.get(f"/v1/jobs/{JOB}/batches/direct").status_code == 404
            body = {"doc_lengths": lengths_of(1000), "cp_size": 8}
            assert c.put(f"/v1/jobs/{JOB}/batches/direct", json=body).status_code in (200, 202)
            r = c.get(f"/v1/jobs/{JOB}/batches/direct", params={"wait_ms": 5000})
            assert r.status_code == 200 and r.headers["x-plan-id"] == pre_crash["direct"]
            # The loop's own batches, resubmitted: the plans the ranks used before the crash.
            for step in range(CRASH_AT):
                body = {"doc_lengths": lengths_of(step), "cp_size": 8, "strategy": "flashcp"}
                r = c.put(f"/v1/jobs/{JOB}/batches/{step}", json=body)
                assert r.status_code in (200, 202), r.text
                r = c.get(f"/v1/jobs/{JOB}/batches/{step}", params={"wait_ms": 5000})
                assert r.headers["x-plan-id"] == records[(0, step)][0]
        assert server.stop() == 0
    finally:
        barrier.abort()
        server.kill()
