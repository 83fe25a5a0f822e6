"""Files, streams, caches, job storage, metrics and malformed input.

One real server (one solver process, HTTP and gRPC, a token, small limits). Each test is an
attack, then a probe that needs a fresh solve and must be answered normally within 2 s;
the process tree's memory stays bounded over the module.
"""

from __future__ import annotations

import itertools
import json
import threading
import time

import grpc
import httpx
import pytest
from timing import scaled

from planner_service.fcp.cost_model import PROFILES
from planner_service.proto_build import load
from planner_service.service.grpc_wire import dict_to_request
from planner_service.service.testing import rss_bounded_server, tree_rss_mib

TOKEN = "abuse-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
METADATA = (("authorization", f"Bearer {TOKEN}"),)
ANSWER_S = 1.0
PROBE_S = 2.0
RSS_GROWTH_MIB = 200
CACHE_MB = 0.05
MAX_PLAN_BYTES = 65536
MAX_SHARDS = 100_000
PER_CLIENT = 4
STREAM_PENDING = 4
GOOD = {"doc_lengths": [4099, 37, 1023, 8191, 1, 511], "cp_size": 4}
_probes = itertools.count(1)


@pytest.fixture(scope="module")
def site_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profiles") / "site.json"
    data = {**PROFILES["cpu-gloo"].to_dict(), "name": "site-a100"}
    path.write_text(json.dumps(data))
    return str(path)


@pytest.fixture(scope="module")
def server(site_profile):
    env = {"PLANNER_TOKEN": TOKEN, "PLANNER_CACHE_MB": str(CACHE_MB),
           "PLANNER_MAX_PLAN_BYTES": str(MAX_PLAN_BYTES), "PLANNER_MAX_SHARDS": str(MAX_SHARDS),
           "PLANNER_MAX_JOBS": "16", "PLANNER_MAX_JOBS_PER_CLIENT": str(PER_CLIENT),
           "PLANNER_MAX_STREAM_PENDING": str(STREAM_PENDING),
           "PLANNER_FCP_PROFILES": json.dumps([site_profile])}
    with rss_bounded_server(env, RSS_GROWTH_MIB) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, headers=AUTH, timeout=scaled(30)) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_api(server):
    stubs = load()
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield stubs, stubs.pb2_grpc.PlannerStub(channel), channel


def probe(http: httpx.Client) -> None:
    body = {"doc_lengths": [1000 + next(_probes), 2000, 3000], "cp_size": 4}
    start = time.monotonic()
    r = http.post("/v1/plan", json=body)
    assert r.status_code == 200, r.text
    assert time.monotonic() - start < scaled(PROBE_S)
    assert http.get("/readyz").status_code == 200


def timed(fn, *args, **kwargs):
    start = time.monotonic()
    out = fn(*args, **kwargs)
    assert time.monotonic() - start < scaled(ANSWER_S)
    return out


def metric_lines(http: httpx.Client, name: str) -> list[str]:
    return [line for line in http.get("/metrics").text.splitlines() if line.startswith(name)]


def grpc_code(call, *args, **kwargs) -> grpc.StatusCode:
    try:
        timed(call, *args, timeout=scaled(10), metadata=METADATA, **kwargs)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


# ---- finding 3: no file access from requests ------------------------------------------

PATHS = ("file:/etc/shadow", "file:/etc/passwd", "file:/dev/zero", "file:/proc/self/fd/4",
         "file:/no/such/file", "/etc/passwd")


def test_profile_paths_are_never_opened_over_http(http):
    answers = set()
    for path in PATHS:
        for route, body in (("/v1/plan", {**GOOD, "strategy": "fcp",
                                          "options": {"profile": path}}),
                            ("/v1/compare", {**GOOD, "strategies": ["fcp"],
                                             "options": {"profile": path}}),
                            ("/v1/schedule", {"sequences": [[3000, 500]], "num_ranks": 2,
                                              "memory_tokens": 8192, "profile": path})):
            r = timed(http.post, route, json=body)
            assert r.status_code == 422, (route, path, r.text)
            detail = r.json()["detail"]
            assert "root" not in detail and "format" not in detail, detail
            answers.add(detail.replace(repr(path)[:40], "PATH"))
    # Same answer for an existing, a missing and a blocking path: no oracle on files.
    assert len(answers) == 2, answers  # options.profile and profile (schedule)
    probe(http)


def test_profile_paths_are_never_opened_over_grpc(http, grpc_api):
    stubs, planner, _ = grpc_api
    for path in PATHS:
        message = dict_to_request(stubs.pb2, {**GOOD, "strategy": "fcp",
                                              "options": {"profile": path}})
        assert grpc_code(planner.Plan, message) == grpc.StatusCode.INVALID_ARGUMENT
        compare = stubs.pb2.CompareRequest(request=message, strategies=["fcp"])
        assert grpc_code(planner.Compare, compare) == grpc.StatusCode.INVALID_ARGUMENT
    probe(http)


def test_profiles_by_value_and_by_operator_name_work(http):
    by_value = {**PROFILES["cpu-gloo"].to_dict(), "name": "mine"}
    for profile, name in ((by_value, "mine"), ("site-a100", "site-a100"),
                          ("h100-llama3-8b", "h100-llama3-8b")):
        r = http.post("/v1/plan", json={**GOOD, "strategy": "fcp",
                                        "options": {"profile": profile}})
        assert r.status_code == 200, r.text
        assert r.json()["info"]["fcp_profile"] == name


# ---- finding 4: bounded streams ------------------------------------------------------

def test_a_stream_that_never_reads_replies_is_held_back(server, http, grpc_api):
    stubs, planner, _ = grpc_api
    sent = itertools.count()
    stop = threading.Event()

    def batches():
        while not stop.is_set():
            i = next(sent)
            yield stubs.pb2.StreamBatch(job="stream", batch=str(i), request=dict_to_request(
                stubs.pb2, {"doc_lengths": [900 + i % 50, 2000, 3000], "cp_size": 4}))

    before = tree_rss_mib(server.proc.pid)
    call = planner.StreamPlans(batches(), metadata=METADATA)  # replies are never read
    time.sleep(scaled(3))
    grown = tree_rss_mib(server.proc.pid) - before
    stop.set()
    call.cancel()
    assert grown < 100, grown
    waits = metric_lines(http, "planner_stream_backpressure_total")
    assert waits and float(waits[0].rsplit(" ", 1)[1]) >= 1, waits
    assert metric_lines(http, "planner_stream_messages_total")
    probe(http)
    assert any('endpoint="StreamPlans"' in line
               for line in metric_lines(http, "planner_requests_total"))


# ---- finding 5: caches, jobs, metrics, nesting, shutdown ----------------------------

def test_the_plan_cache_is_bounded_in_bytes(http):
    for i in range(12):  # plans of a few KB each, more than the cache holds
        body = {"doc_lengths": [100 + i] * 40, "cp_size": 8, "strategy": "per_doc"}
        assert http.post("/v1/plan", json=body).status_code == 200
    line = metric_lines(http, "planner_cache_bytes")[0]
    assert 0 < float(line.rsplit(" ", 1)[1]) <= CACHE_MB * 2**20, line
    probe(http)


def test_one_client_flooding_job_ids_evicts_only_its_own_jobs(server, http):
    assert http.put("/v1/jobs/victim/batches/0", json=GOOD).status_code in (200, 202)
    other = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(base_url=server.http_url, headers=AUTH, transport=other,
                      timeout=scaled(30)) as attacker:
        for i in range(40):
            r = attacker.put(f"/v1/jobs/flood-{i}/batches/0", json=GOOD)
            assert r.status_code in (200, 202), r.text
        assert attacker.get("/v1/jobs/flood-0/batches/0").status_code == 404  # its own
        assert attacker.get("/v1/jobs/flood-39/batches/0").status_code in (200, 202)
    assert http.get("/v1/jobs/victim/batches/0", params={"wait_ms": 2000}).status_code == 200
    probe(http)


def test_client_reported_fallbacks_are_clamped_and_labelled(http, grpc_api):
    stubs, planner, _ = grpc_api

    def reported() -> float:
        lines = metric_lines(http, "planner_fallbacks_total")
        assert all('reason="client_reported"' in line for line in lines), lines
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    start = reported()
    assert http.post("/v1/plan", json=GOOD,
                     headers={"X-Planner-Fallbacks": "1000000"}).status_code == 200
    planner.Plan(dict_to_request(stubs.pb2, GOOD), timeout=scaled(10),
                 metadata=METADATA + (("x-planner-fallbacks", "1000000"),))
    assert reported() - start == 2


def test_deep_nesting_is_refused_on_every_transport(http, grpc_api):
    stubs, planner, _ = grpc_api
    deep = "[" * 5000 + "]" * 5000
    r = timed(http.post, "/v1/plan", content=f'{{"doc_lengths":[1],"cp_size":1,'
              f'"options":{{"x":{deep}}}}}', headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "PLANNER_MAX_JSON_DEPTH" in r.json()["detail"], r.text
    message = dict_to_request(stubs.pb2, GOOD)
    message.options_json = f'{{"x":{deep}}}'
    assert grpc_code(planner.Plan, message) == grpc.StatusCode.INVALID_ARGUMENT
    schedule = stubs.pb2.ScheduleRequest(request_json=f'{{"sequences":{deep}}}')
    assert grpc_code(planner.Schedule, schedule) == grpc.StatusCode.INVALID_ARGUMENT
    probe(http)


# ---- finding 6: malformed protobuf, long names, content type, bearer scheme ---------

def test_malformed_protobuf_is_invalid_argument(http, grpc_api):
    _, _, channel = grpc_api
    for method in ("Plan", "Compare", "SubmitBatch"):
        raw = channel.unary_unary(f"/cpplanner.v1.Planner/{method}",
                                  request_serializer=None, response_deserializer=None)
        assert grpc_code(raw, b"\xff\xff\xff\xff garbage") == grpc.StatusCode.INVALID_ARGUMENT
    probe(http)


def test_long_strategy_names_are_not_echoed_into_metadata(http, grpc_api):
    stubs, planner, _ = grpc_api
    name = "x" * 10_000
    message = dict_to_request(stubs.pb2, {**GOOD, "strategy": name})
    assert grpc_code(planner.Plan, message) == grpc.StatusCode.INVALID_ARGUMENT
    compare = stubs.pb2.CompareRequest(request=dict_to_request(stubs.pb2, GOOD),
                                       strategies=[name])
    assert grpc_code(planner.Compare, compare) == grpc.StatusCode.INVALID_ARGUMENT
    r = http.post("/v1/compare", json={**GOOD, "strategies": [name]})
    assert r.status_code == 422 and len(r.text) < 2000
    probe(http)


def test_only_json_bodies_are_accepted(http):
    for content_type in ("text/plain", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": content_type} if content_type else {}
        r = timed(http.post, "/v1/plan", content=json.dumps(GOOD), headers=headers)
        assert r.status_code == 415, (content_type, r.status_code)
    r = http.post("/v1/plan", content=json.dumps(GOOD),
                  headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_the_bearer_scheme_is_case_insensitive(server, grpc_api):
    stubs, planner, _ = grpc_api
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.post(f"{server.http_url}/v1/plan", json=GOOD,
                       headers={"Authorization": f"{scheme} {TOKEN}"})
        assert r.status_code == 200, (scheme, r.text)
        planner.Plan(dict_to_request(stubs.pb2, GOOD), timeout=scaled(10),
                     metadata=(("authorization", f"{scheme} {TOKEN}"),))
    r = httpx.post(f"{server.http_url}/v1/plan", json=GOOD,
                   headers={"Authorization": f"Basic {TOKEN}"})
    assert r.status_code == 401


# ---- size limits on what a request may produce ---------------------------------------

def test_requests_whose_plans_could_be_huge_are_refused_up_front(http, grpc_api):
    stubs, planner, _ = grpc_api
    body = {"doc_lengths": [1] * 2000, "cp_size": 64, "strategy": "per_doc"}
    r = timed(http.post, "/v1/plan", json=body)
    assert r.status_code == 422 and "PLANNER_MAX_SHARDS" in r.json()["detail"], r.text
    assert grpc_code(planner.Plan, dict_to_request(stubs.pb2, body)) \
        == grpc.StatusCode.INVALID_ARGUMENT
    r = timed(http.post, "/v1/schedule", json={"sequences": [[1] * 2000], "num_ranks": 64,
                                               "memory_tokens": 4096})
    assert r.status_code == 422 and "PLANNER_MAX_SHARDS" in r.json()["detail"], r.text


def test_plans_above_the_byte_limit_are_refused(http):
    body = {"doc_lengths": [50] * 700, "cp_size": 32, "strategy": "per_doc"}
    r = http.post("/v1/plan", json=body)
    assert r.status_code == 422 and "PLANNER_MAX_PLAN_BYTES" in r.json()["detail"], r.text
    probe(http)
