"""Global batches in the job API (FCP schedules one batch ahead), over HTTP and gRPC:
idempotent resubmission, conflicts, expiry, bad input; and the ScheduleClient's fallback
is byte-identical to the service's schedule."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from timing import scaled

from planner_service.client.backends import EmbeddedBackend, ServiceError
from planner_service.client.global_batch import ScheduleClient, make_transport
from planner_service.client.local import solve_schedule_dict as solve_local
from planner_service.service.global_jobs import global_jobs
from planner_service.service.http_app import create_app
from planner_service.service.ops import PlannerService
from planner_service.service.settings import load_settings
from planner_service.service.testing import grpc_in_thread

BODY = {"sequences": [[3000, 500], [700, 900, 1200], [4096], [100, 200, 300]],
        "num_ranks": 4, "memory_tokens": 2048, "strategy": "flashcp"}
OTHER = {**BODY, "memory_tokens": 4096}
SETTINGS = {"workers": 0, "max_sequences": 16, "max_cp_size": 64}


class Clock:
    """The job store's clock, moved forward by hand to expire batches."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


@pytest.fixture(scope="module")
def http() -> Iterator[tuple[TestClient, Clock]]:
    app = create_app(load_settings(**SETTINGS))
    clock = Clock()
    with TestClient(app) as client:
        global_jobs(app.state.service).store.clock = clock
        yield client, clock


def test_http_submit_fetch_and_idempotent_resubmit(http):
    client, _ = http
    r = client.put("/v1/jobs/j1/global-batches/0", json=BODY)
    assert r.status_code in (200, 202), r.text
    first = r.json()
    assert first["job"] == "j1" and first["batch"] == "0" and first["request_hash"]
    got = client.get("/v1/jobs/j1/global-batches/0", params={"wait_ms": int(scaled(20) * 1e3)})
    assert got.status_code == 200, got.text
    schedule = got.json()
    assert schedule["schedule_id"] == got.headers["x-schedule-id"]
    assert {"solve_ms", "plan_ms"}.isdisjoint(schedule), "stored schedules carry no timings"
    assert sum(len(mb["sequence_ids"]) for mb in schedule["micro_batches"]) == 4
    # Resubmitting the same content is idempotent: same entry, same schedule, now done.
    again = client.put("/v1/jobs/j1/global-batches/0", json=BODY)
    assert again.status_code == 200 and again.json()["request_hash"] == first["request_hash"]
    assert again.json()["schedule_id"] == schedule["schedule_id"]
    # A client computing it locally (its fallback) gets the same bytes.
    text, schedule_id = solve_local(BODY)[:2]
    assert text.encode() == got.content and schedule_id == schedule["schedule_id"]


def test_http_conflict_and_unknown(http):
    client, _ = http
    assert client.put("/v1/jobs/j2/global-batches/7", json=BODY).status_code in (200, 202)
    r = client.put("/v1/jobs/j2/global-batches/7", json=OTHER)
    assert r.status_code == 409 and r.json()["field"] == "batch"
    r = client.get("/v1/jobs/j2/global-batches/8")
    assert r.status_code == 404 and "never submitted, expired or evicted" in r.json()["detail"]
    # Single plans and global batches are separate namespaces.
    assert client.get("/v1/jobs/j2/batches/7").status_code == 404


def test_http_finished_schedule_expires_after_the_ttl(http):
    client, clock = http
    assert client.put("/v1/jobs/j3/global-batches/0", json=BODY).status_code in (200, 202)
    assert client.get("/v1/jobs/j3/global-batches/0",
                      params={"wait_ms": int(scaled(20) * 1e3)}).status_code == 200
    clock.offset += load_settings(**SETTINGS).job_ttl_s + 1
    assert client.get("/v1/jobs/j3/global-batches/0").status_code == 404


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/jobs/bad id/global-batches/0", BODY, "job"),
    ("/v1/jobs/j4/global-batches/-x", BODY, "batch"),
    ("/v1/jobs/j4/global-batches/0", {**BODY, "sequences": []}, "sequences"),
    ("/v1/jobs/j4/global-batches/0", {**BODY, "sequences": [[]]}, "sequences.0"),
    ("/v1/jobs/j4/global-batches/0", {**BODY, "num_ranks": 65}, "num_ranks"),
    ("/v1/jobs/j4/global-batches/0", {**BODY, "sequences": [[1]] * 17}, "sequences"),
    ("/v1/jobs/j4/global-batches/0", {**BODY, "profile": "file:/etc/passwd"}, "profile"),
])
def test_http_rejects_bad_input_naming_the_field(http, path, body, field):
    client, _ = http
    r = client.put(path, json=body)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field, r.json()


def test_http_a_schedule_fcp_rejects_fails_with_422_on_fetch(http):
    client, _ = http
    body = {**BODY, "memory_tokens": 64}  # a 4096-token sequence cannot fit 4 x 64 tokens
    assert client.put("/v1/jobs/j5/global-batches/0", json=body).status_code == 202
    r = client.get("/v1/jobs/j5/global-batches/0", params={"wait_ms": int(scaled(20) * 1e3)})
    assert r.status_code == 422, r.text
    assert client.get("/v1/jobs/j5/global-batches/0", params={"wait_ms": -1}).status_code == 422


# ---- gRPC ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def grpc_server() -> Iterator[tuple[str, PlannerService]]:
    """A grpc.aio server on loopback in a thread of this process."""
    with grpc_in_thread(load_settings(**SETTINGS), timeout_s=scaled(30)) as served:
        yield served


def test_grpc_submit_fetch_resubmit_conflict_and_expiry(grpc_server):
    url, svc = grpc_server
    transport = make_transport(url)
    try:
        transport.submit("g1", "0", BODY, scaled(5))
        got = transport.fetch("g1", "0", scaled(20), scaled(5))
        assert got is not None
        text, schedule_id = got[:2]
        assert (text, schedule_id) == solve_local(BODY)[:2]
        transport.submit("g1", "0", BODY, scaled(5))  # idempotent
        with pytest.raises(ServiceError) as conflict:
            transport.submit("g1", "0", OTHER, scaled(5))
        assert conflict.value.code == "ALREADY_EXISTS" and conflict.value.field == "batch"
        with pytest.raises(ServiceError) as bad:
            transport.submit("g1", "1", {**BODY, "num_ranks": 0}, scaled(5))
        assert bad.value.code == "INVALID_ARGUMENT" and bad.value.field == "num_ranks"
        store = global_jobs(svc).store
        clock = Clock()
        clock.offset = svc.settings.job_ttl_s + 1
        store.clock = clock
        with pytest.raises(ServiceError) as gone:
            transport.fetch("g1", "0", 0, scaled(5))
        assert gone.value.code == "NOT_FOUND"
    finally:
        transport.close()


def test_schedule_client_uses_the_service_then_falls_back_identically(grpc_server):
    url, _ = grpc_server
    with ScheduleClient(url, num_ranks=4, memory_tokens=2048, job="c1",
                        request_defaults={"strategy": "flashcp"}, timeout_s=scaled(20)) as c:
        c.prefetch(0, BODY["sequences"])
        served = c.get(0)
        assert not served.fallback and served.source == "grpc"
    with ScheduleClient("grpc://127.0.0.1:1", num_ranks=4, memory_tokens=2048, job="c2",
                        request_defaults={"strategy": "flashcp"}, timeout_s=scaled(5)) as down:
        down.prefetch(0, BODY["sequences"])
        local = down.get(0)
        assert local.fallback and local.reason in ("unavailable", "late")
    assert local.schedule_json == served.schedule_json
    assert [p.plan_id for p in local.plans()] == [p.plan_id for p in served.plans()]
    assert json.loads(served.schedule_json)["schedule_id"] == served.schedule_id


class _RefusingBackend(EmbeddedBackend):
    """Every global batch answered 429 (the service's queue is full)."""

    name = "refusing"

    def submit_global(self, job, batch, request, timeout_s) -> None:
        raise ServiceError("429", "the solver queue is full", retry_after_s=1)


def test_schedule_client_shares_the_plan_clients_state_machine():
    """Embedded: the schedule itself; an error answer: the same bytes from the local
    fallback, reason 'error', degraded; input FCP rejects: ServiceError 422."""
    with ScheduleClient("embedded", num_ranks=4, memory_tokens=2048, job="e1",
                        timeout_s=scaled(20)) as embedded:
        embedded.prefetch(0, BODY["sequences"], strategy="flashcp")
        served = embedded.get(0)
        assert (served.source, served.fallback) == ("embedded", False)
        assert embedded.stats["service_schedules"] == 1
    with ScheduleClient(_RefusingBackend(), num_ranks=4, memory_tokens=2048, job="e2",
                        timeout_s=scaled(20)) as refused:
        refused.prefetch(0, BODY["sequences"], strategy="flashcp")
        local = refused.get(0)
        assert (local.source, local.fallback, local.reason) == ("local", True, "error")
        assert local.schedule_json == served.schedule_json
        assert refused.stats["degraded"] and refused.stats["fallbacks"] == 1
        with pytest.raises(ServiceError) as bad:
            refused.get(1, sequences=[[0]])
        assert bad.value.code == "422"
