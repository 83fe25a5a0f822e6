"""Back-pressure on a real server: a full queue answers 429 / RESOURCE_EXHAUSTED with a
retry hint at once, never a growing backlog or a 5xx, and the server stays healthy.
Doubles as the smoke run of the load benchmark (bench/service_load.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from bench.service_load import make_bodies, run_load
from planner_service.service.testing import ServerProcess


@pytest.fixture(scope="module")
def tight_server():
    env = {"PLANNER_QUEUE_SIZE": "0", "PLANNER_CACHE_SIZE": "0"}
    with ServerProcess(workers=1, env=env) as s:
        yield s
        assert s.stop() == 0


@pytest.mark.parametrize("transport,code", [("http", "429"), ("grpc", "RESOURCE_EXHAUSTED")])
def test_full_queue_sheds_load_with_retry_hints(tight_server, transport, code):
    bodies = make_bodies("pile", 65536, 8, 64, seed=3)
    result = asyncio.run(run_load(transport, tight_server, bodies, clients=8, duration_s=1.5,
                                  warmup_s=0.2))
    assert result.ok > 0
    assert set(result.errors) == {code}, result.errors  # shed, nothing else went wrong
    r = httpx.get(f"{tight_server.http_url}/healthz", timeout=10)
    assert r.status_code == 200


def test_429_carries_retry_after_and_is_counted(tight_server):
    body = {"doc_lengths": [65536] * 4, "cp_size": 64, "strategy": "per_doc"}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=tight_server.http_url, timeout=30) as c:
            return await asyncio.gather(*(
                c.post("/v1/plan", json={**body, "cp_size": 32 + i}) for i in range(12)))

    answers = asyncio.run(burst())
    statuses = {r.status_code for r in answers}
    assert statuses <= {200, 429} and 429 in statuses
    shed = next(r for r in answers if r.status_code == 429)
    assert int(shed.headers["retry-after"]) >= 1 and "queue is full" in shed.json()["detail"]
    metrics = httpx.get(f"{tight_server.http_url}/metrics", timeout=10).text
    assert 'planner_rejected_total{reason="queue_full"}' in metrics
