"""No request holds a solver past its deadline.

One real server (one solver process, HTTP and gRPC, a token) with the test hooks on: the
strategy ``test_hang`` sleeps for an hour, a solver guaranteed to ignore every deadline.
Each attack wedges the only solver process (plan, compare, schedule, a job, a dropped
connection, a cancelled gRPC call); then a probe that needs a fresh solve must be answered
normally within 2 s, and readiness must hold. The whole process tree's memory stays bounded.
"""

from __future__ import annotations

import itertools
import json
import socket
import time

import grpc
import httpx
import pytest
from timing import scaled

from planner_service.proto_build import load
from planner_service.service.grpc_wire import dict_to_request
from planner_service.service.testing import rss_bounded_server

pytestmark = pytest.mark.slow  # long: starts first under xdist (tests/conftest.py)

TOKEN = "deadline-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
METADATA = (("authorization", f"Bearer {TOKEN}"),)
JOB_DEADLINE_S = 3.0
"""PLANNER_REQUEST_TIMEOUT_S of the test server: the deadline of a job batch."""
PROBE_S = 2.0
"""After an attack the service answers normally within this."""
RSS_GROWTH_MIB = 200
HANG = {"doc_lengths": [4099, 37, 1023], "cp_size": 4, "strategy": "test_hang"}
_probes = itertools.count(1)


@pytest.fixture(scope="module")
def server():
    env = {"PLANNER_TOKEN": TOKEN, "PLANNER_TEST_HOOKS": "1",
           "PLANNER_REQUEST_TIMEOUT_S": str(JOB_DEADLINE_S)}
    with rss_bounded_server(env, RSS_GROWTH_MIB) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, headers=AUTH, timeout=scaled(30)) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server):
    stubs = load()
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield stubs, stubs.pb2_grpc.PlannerStub(channel)


def probe(http: httpx.Client) -> None:
    """A request that needs a fresh solve (never cached) is answered within 2 s."""
    body = {"doc_lengths": [1000 + next(_probes), 2000, 3000], "cp_size": 4}
    start = time.monotonic()
    r = http.post("/v1/plan", json=body, headers={"X-Planner-Deadline-Ms": "30000"})
    took = time.monotonic() - start
    assert r.status_code == 200, r.text
    assert took < scaled(PROBE_S), took
    assert http.get("/readyz").status_code == 200


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def deadline_answer(http: httpx.Client, path: str, body: dict, deadline_s: float
                    ) -> httpx.Response:
    start = time.monotonic()
    r = http.post(path, json=body, headers={"X-Planner-Deadline-Ms": str(int(deadline_s * 1e3))})
    took = time.monotonic() - start
    assert took >= deadline_s * 0.9, took
    assert took < deadline_s + scaled(1.0), took
    return r


def test_http_plan_past_its_deadline_frees_the_solver(http):
    kills = metric(http, "planner_solver_kills")
    r = deadline_answer(http, "/v1/plan", HANG, 0.5)
    assert r.status_code == 504, r.text
    probe(http)  # the fast lane never waited for the hung solve
    until = time.monotonic() + scaled(10)
    while metric(http, "planner_solver_kills") < kills + 1 and time.monotonic() < until:
        time.sleep(0.05)
    assert metric(http, "planner_solver_kills") >= kills + 1
    # The slow lane's replacement process serves: a slow-lane solve that ends at once.
    quick = {**HANG, "options": {"seconds": 0}}
    assert http.post("/v1/plan", json=quick).status_code == 200
    probe(http)


def test_compare_past_its_deadline_frees_the_solver(http):
    body = {**HANG, "strategies": ["test_hang", "ring"]}
    r = deadline_answer(http, "/v1/compare", body, 0.6)
    assert r.status_code == 200, r.text
    assert "test_hang" in r.json()["errors"]
    probe(http)


def test_schedule_past_its_deadline_frees_the_solver(http):
    # FCP runs the intra-group strategy inside one solve: a hanging one wedges FCP.
    body = {"sequences": [[3000, 500], [2000]], "num_ranks": 4, "memory_tokens": 8192,
            "strategy": "test_hang"}
    r = deadline_answer(http, "/v1/schedule", body, 0.6)
    assert r.status_code == 504, r.text
    probe(http)


def test_a_job_batch_stops_at_its_deadline(http):
    r = http.put("/v1/jobs/hang/batches/0", json=HANG)
    assert r.status_code == 202, r.text
    time.sleep(JOB_DEADLINE_S + 0.2)
    probe(http)
    r = http.get("/v1/jobs/hang/batches/0")
    assert r.status_code == 504, r.text


def test_dropped_http_connection_stops_its_solve(server, http):
    host, port = server.http_url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(HANG).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/plan HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {TOKEN}\r\n".encode()
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.3)  # the solve runs (no deadline header: the 3 s server deadline)
    probe(http)  # within 2 s, before the server's own deadline could free the solver
    assert 'status="499"' in http.get("/metrics").text


def test_grpc_plan_past_its_deadline_frees_the_solver(http, stub):
    stubs, planner = stub
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        planner.Plan(dict_to_request(stubs.pb2, HANG), timeout=0.5, metadata=METADATA)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 0.5 + scaled(1.0)
    probe(http)


def test_cancelled_grpc_call_stops_its_solve(http, stub):
    stubs, planner = stub
    call = planner.Plan.future(dict_to_request(stubs.pb2, HANG), metadata=METADATA)
    time.sleep(0.3)
    call.cancel()
    probe(http)


def test_grpc_compare_past_its_deadline_frees_the_solver(http, stub):
    stubs, planner = stub
    message = stubs.pb2.CompareRequest(request=dict_to_request(stubs.pb2, HANG),
                                       strategies=["test_hang", "ring"])
    try:
        reply = planner.Compare(message, timeout=0.6, metadata=METADATA)
        assert "test_hang" in reply.errors
    except grpc.RpcError as exc:  # the answer raced the caller's own deadline
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    probe(http)
