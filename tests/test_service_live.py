"""A real `planner serve` (uvicorn + grpc.aio + process pool) on loopback ports.

HTTP and gRPC must give byte-identical plans for the same request; bad input answers
4xx / INVALID_ARGUMENT naming the field and leaves the server healthy.
"""

from __future__ import annotations

import json
import threading

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from planner_service.core.request import PlanRequest, debug_request
from planner_service.proto_build import load
from planner_service.service.grpc_wire import dict_to_request
from planner_service.service.testing import ServerProcess
from planner_service.solvers.registry import STRATEGIES, solve, strategy_names

pytestmark = pytest.mark.slow  # long: starts first under xdist (tests/conftest.py)

TOKEN = "live-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MD = (("authorization", f"Bearer {TOKEN}"),)
DEBUG = debug_request()
BODY = {"doc_lengths": list(DEBUG.doc_lengths), "cp_size": 4, "context_length": 32768}
pb2, pb2_grpc = load()
FAST_OPTIONS = {"time_limit_s": 1, "workers": 1}
"""Short, single-threaded (so deterministic) settings for slow exact solvers (ilp)."""


@pytest.fixture(scope="module")
def server():
    env = {"PLANNER_TOKEN": TOKEN, "PLANNER_MAX_DOCS": "512", "PLANNER_MAX_BODY_BYTES": "65536"}
    with ServerProcess(workers=1, env=env) as s:
        yield s
        assert s.stop() == 0


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, headers=AUTH, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb2_grpc.PlannerStub(channel)


def test_every_strategy_gives_identical_bytes_over_http_grpc_and_locally(http, stub):
    for strategy in strategy_names():
        options = {k: v for k, v in FAST_OPTIONS.items() if k in STRATEGIES[strategy].options}
        for cp_size, first in ((3, "http"), (4, "grpc")):  # each transport solves once fresh
            body = {**BODY, "strategy": strategy, "options": options, "cp_size": cp_size}
            answers = {}
            for transport in (first, "grpc" if first == "http" else "http"):
                if transport == "http":
                    r = http.post("/v1/plan", json=body)
                    assert r.status_code == 200, r.text
                    answers["http"] = (r.content, r.headers["x-cache"] == "hit",
                                       r.headers["x-plan-id"])
                else:
                    reply = stub.Plan(dict_to_request(pb2, body), metadata=MD, timeout=60)
                    answers["grpc"] = (reply.plan_json, reply.cached, reply.plan_id)
            local = solve(PlanRequest(doc_lengths=DEBUG.doc_lengths, cp_size=cp_size,
                                      strategy=strategy, context_length=32768,
                                      options=options)).to_json().encode()
            assert answers["http"][0] == answers["grpc"][0], (strategy, cp_size, answers)
            if all(json.loads(x)["info"].get("deterministic", True) is not False
                   for x in (local, answers[first][0])):  # ilp not cut short by its guard
                assert answers[first][0] == local, (strategy, cp_size)
            assert answers[first][1] is False  # the first answer was a real solve
            assert answers["http"][2] == answers["grpc"][2]


def test_compare_is_identical_over_http_and_grpc(http, stub):
    declared = {o for s in STRATEGIES.values() for o in s.options}
    body = {**BODY, "cp_size": 8,
            "options": {k: v for k, v in FAST_OPTIONS.items() if k in declared}}
    data = http.post("/v1/compare", json=body).json()
    reply = stub.Compare(pb2.CompareRequest(request=dict_to_request(pb2, body)), metadata=MD,
                         timeout=30)
    assert [p.strategy for p in reply.plans] == [e["strategy"] for e in data["results"]] \
        == strategy_names()
    for entry, plan in zip(data["results"], reply.plans, strict=True):
        assert json.dumps(entry["plan"], sort_keys=True, separators=(",", ":")).encode() \
            == plan.plan_json


def test_jobs_are_shared_between_grpc_and_http(http, stub):
    body = {**BODY, "cp_size": 5}
    sub = stub.SubmitBatch(pb2.SubmitBatchRequest(job="live", batch="1",
                                                  request=dict_to_request(pb2, body)),
                           metadata=MD, timeout=10)
    assert sub.status in ("pending", "done")
    got = stub.GetBatch(pb2.GetBatchRequest(job="live", batch="1", wait_ms=10_000),
                        metadata=MD, timeout=20)
    assert got.status == "done"
    over_http = http.get("/v1/jobs/live/batches/1")
    assert over_http.content == got.plan.plan_json
    again = stub.SubmitBatch(pb2.SubmitBatchRequest(job="live", batch="1",
                                                    request=dict_to_request(pb2, body)),
                             metadata=MD, timeout=10)
    assert again.plan_id == got.plan.plan_id
    with pytest.raises(grpc.RpcError) as info:
        stub.SubmitBatch(pb2.SubmitBatchRequest(job="live", batch="1", request=dict_to_request(
            pb2, {**body, "cp_size": 6})), metadata=MD, timeout=10)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as info:
        stub.GetBatch(pb2.GetBatchRequest(job="live", batch="404"), metadata=MD, timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_stream_answers_batches_in_order_with_errors_in_band(stub):
    sizes = [2, 3, 4, 0, 6, 7, 8]  # cp_size 0 is invalid: reported in place

    def batches():
        for i, n in enumerate(sizes):
            yield pb2.StreamBatch(job="stream", batch=str(i),
                                  request=dict_to_request(pb2, {**BODY, "cp_size": n}))

    out = list(stub.StreamPlans(batches(), metadata=MD, timeout=30))
    assert [o.batch for o in out] == [str(i) for i in range(len(sizes))]
    for o, n in zip(out, sizes, strict=True):
        if n == 0:
            assert o.error_code == "INVALID_ARGUMENT" and "cp_size" in o.error
        else:
            assert json.loads(o.plan.plan_json)["cp_size"] == n and not o.error


def test_strategies_health_and_reflection(stub, channel):
    names = [s.name for s in stub.ListStrategies(pb2.StrategiesRequest(), metadata=MD).strategies]
    assert names == strategy_names()
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "cpplanner.v1.Planner"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]), metadata=MD, timeout=5))
    listed = {s.name for s in answer.list_services_response.service}
    assert {"cpplanner.v1.Planner", "grpc.health.v1.Health"} <= listed


GRPC_BAD = [
    ({"doc_lengths": [], "cp_size": 4}, "doc_lengths"),
    ({"doc_lengths": [5, -1], "cp_size": 4}, "doc_lengths.1"),
    ({"doc_lengths": [5, 2**40], "cp_size": 4}, "doc_lengths.1"),
    ({"doc_lengths": [1] * 513, "cp_size": 4}, "doc_lengths"),
    ({"doc_lengths": [5], "cp_size": 0}, "cp_size"),
    ({"doc_lengths": [5], "cp_size": 2**40}, "cp_size"),
    ({"doc_lengths": [5], "cp_size": 2, "strategy": "nope"}, "strategy"),
    ({"doc_lengths": [5], "cp_size": 2, "options": {"bogus": 1}}, "options"),
    ({"doc_lengths": [5], "cp_size": 2, "model": {"num_heads": 3}}, "model.num_kv_heads"),
    ({"doc_lengths": [5], "cp_size": 2, "comm_mode": "pigeon"}, "comm_mode"),
]


@pytest.mark.parametrize("body,field", GRPC_BAD)
def test_grpc_rejects_bad_input_naming_the_field(stub, body, field):
    with pytest.raises(grpc.RpcError) as info:
        stub.Plan(dict_to_request(pb2, body), metadata=MD, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field.split(".")[0] in info.value.details()
    assert dict(info.value.trailing_metadata())["field"] == field


def test_grpc_rejects_bad_options_json_oversize_and_missing_token(stub, channel):
    bad = pb2.PlanRequest(doc_lengths=[5], cp_size=2, options_json="{nope")
    with pytest.raises(grpc.RpcError) as info:
        stub.Plan(bad, metadata=MD, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "options_json" in info.value.details()
    huge = pb2.PlanRequest(doc_lengths=[1] * 100_000, cp_size=2)
    with pytest.raises(grpc.RpcError) as info:
        stub.Plan(huge, metadata=MD, timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as info:
            stub.Plan(dict_to_request(pb2, BODY), metadata=metadata, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            list(stub.StreamPlans(iter([]), metadata=metadata, timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING


def test_http_bad_input_and_token_on_the_real_server(server, http):
    assert httpx.post(f"{server.http_url}/v1/plan", json=BODY).status_code == 401
    r = http.post("/v1/plan", json={"doc_lengths": [1, "x"], "cp_size": 2})
    assert r.status_code == 422 and r.json()["field"] == "doc_lengths.1"
    big = http.post("/v1/plan", content=b"[" + b"1," * 40_000 + b"1]",
                    headers={"Content-Type": "application/json"})
    assert big.status_code == 413
    assert httpx.get(f"{server.http_url}/healthz").status_code == 200
    assert httpx.get(f"{server.http_url}/readyz").status_code == 200
    metrics = http.get("/metrics").text
    grpc_invalid = [line for line in metrics.splitlines() if 'transport="grpc"' in line
                    and 'status="422"' in line and line.startswith("planner_requests_total")]
    assert grpc_invalid  # gRPC outcomes are labelled with the HTTP code they mirror
    assert 'status="500"' not in metrics


def test_sigterm_finishes_in_flight_requests_and_exits_0():
    with ServerProcess(workers=1, grpc=False) as s:
        statuses: list[int] = []

        def hammer(i: int) -> None:
            with httpx.Client(base_url=s.http_url, timeout=30) as c:
                for k in range(40):
                    try:
                        r = c.post("/v1/plan", json={**BODY, "cp_size": 1 + (i * 40 + k) % 64,
                                                     "strategy": "per_doc"})
                    except httpx.HTTPError:
                        return  # the listener closed: expected once shutdown starts
                    statuses.append(r.status_code)

        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        while len(statuses) < 8:
            threading.Event().wait(0.01)
        code = s.stop()
        for t in threads:
            t.join()
        assert code == 0
        assert statuses and set(statuses) <= {200, 503}


def test_schedule_over_grpc_and_http(http, stub):
    pytest.importorskip("planner_service.fcp")
    body = {"sequences": [[30000, 2000], [512, 700, 9000], [4096]], "num_ranks": 4,
            "memory_tokens": 16384}
    over_http = http.post("/v1/schedule", json=body)
    assert over_http.status_code == 200, over_http.text
    reply = stub.Schedule(pb2.ScheduleRequest(request_json=json.dumps(body)), metadata=MD,
                          timeout=30)
    assert json.loads(reply.result_json)["degrees"] == over_http.json()["degrees"]
    with pytest.raises(grpc.RpcError) as info:
        stub.Schedule(pb2.ScheduleRequest(request_json=json.dumps({**body, "num_ranks": 0})),
                      metadata=MD, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_ranks" in info.value.details()


def test_schedule_over_grpc_refuses_a_flood_of_sequences_before_parsing(stub):
    # The HTTP route's guard (tests/test_hardening_hostile.py), over gRPC: 2000 one-token
    # sequences, above PLANNER_MAX_SEQUENCES (1024) and within the message size limit.
    text = '{"num_ranks": 8, "memory_tokens": 4096, "sequences": [' + ",".join(["[1]"] * 2000) + "]}"
    with pytest.raises(grpc.RpcError) as info:
        stub.Schedule(pb2.ScheduleRequest(request_json=text), metadata=MD, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The guard's wording ("more than"), not the validator's ("has 2000 entries"): refused
    # before the JSON was parsed.
    assert "sequences has more than 1024 entries" in info.value.details()
