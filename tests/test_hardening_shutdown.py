"""Graceful shutdown (issue 7, item 2), beyond tests/test_service_live.py (which checks
that SIGTERM under a stream of fast requests exits 0): a slow solve in flight and queued
job batches behind it all finish after SIGTERM, a long-poll waiting on a queued batch gets
its plan, nothing reports ready once SIGTERM arrived, and the process exits 0 within the
grace deadline.
"""

from __future__ import annotations

import random
import threading
import time

import httpx

from planner_service.service.testing import ServerProcess

GRACE_S = 15
rng = random.Random(0)
SLOW = {"doc_lengths": [rng.randint(100, 9000) for _ in range(40)], "cp_size": 8,
        "strategy": "ilp", "options": {"time_limit_s": 0.5, "granularity": 512, "workers": 1}}


def test_sigterm_drains_in_flight_and_queued_work_then_exits_0():
    env = {"PLANNER_SHUTDOWN_GRACE_S": str(GRACE_S)}
    with ServerProcess(workers=1, grpc=False, env=env) as s:
        answers: dict[str, tuple[int, str]] = {}

        def call(name: str, method: str, path: str, **kw) -> None:
            with httpx.Client(base_url=s.http_url, timeout=60) as c:
                r = c.request(method, path, **kw)
                answers[name] = (r.status_code, r.headers.get("x-plan-id", ""))

        slow = threading.Thread(target=call, args=("slow", "POST", "/v1/plan"),
                                kwargs={"json": SLOW})
        slow.start()
        time.sleep(0.3)  # the ILP now occupies the only solver process
        with httpx.Client(base_url=s.http_url, timeout=10) as c:
            for b in range(3):  # queued behind it
                body = {"doc_lengths": [1000 + b, 2000, 3000], "cp_size": 4}
                assert c.put(f"/v1/jobs/drain/batches/{b}", json=body).status_code == 202
        poll = threading.Thread(target=call, args=("poll", "GET", "/v1/jobs/drain/batches/2"),
                                kwargs={"params": {"wait_ms": 30000}})
        poll.start()
        time.sleep(0.2)
        assert "slow" not in answers and "poll" not in answers  # both still in flight

        sent = time.monotonic()
        s.proc.send_signal(15)
        readiness = []
        while s.proc.poll() is None and time.monotonic() - sent < GRACE_S + 5:
            try:
                readiness.append(httpx.get(f"{s.http_url}/readyz", timeout=0.5).status_code)
            except httpx.HTTPError:
                readiness.append(0)  # no longer accepting
            time.sleep(0.05)
        code = s.proc.wait(GRACE_S + 5)
        took = time.monotonic() - sent
        slow.join(5)
        poll.join(5)
        assert code == 0
        assert took < GRACE_S, took
        assert 200 not in readiness, readiness  # never ready again once SIGTERM arrived
        assert answers["slow"][0] == 200, answers
        assert answers["poll"][0] == 200 and answers["poll"][1], answers
