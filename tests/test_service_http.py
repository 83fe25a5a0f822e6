"""The HTTP app in-process: every endpoint, every strategy, bad input, limits, auth."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from planner_service.core.plan import Plan
from planner_service.core.request import PlanRequest, debug_request
from planner_service.core.validate import validate_plan
from planner_service.service.http_app import create_app
from planner_service.service.settings import load_settings
from planner_service.solvers.registry import STRATEGIES, solve, strategy_names

DEBUG = debug_request()
BODY = {"doc_lengths": list(DEBUG.doc_lengths), "cp_size": 4, "context_length": 32768}
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def make_client(**overrides: object) -> TestClient:
    settings = load_settings(**{"workers": 0, "max_docs": 64, "max_cp_size": 64,
                                "max_body_bytes": 4096, **overrides})
    return TestClient(create_app(settings))


@pytest.fixture(scope="module")
def client():
    with make_client() as c:
        yield c


def options_for(strategy: str) -> dict:
    """Short, single-threaded (so deterministic) settings for slow exact solvers."""
    declared = STRATEGIES[strategy].options
    return {k: v for k, v in FAST_OPTIONS.items() if k in declared}


FAST_OPTIONS = {"time_limit_s": 1, "workers": 1}


def deterministic(plan: Plan) -> bool:
    """False for a plan a wall-clock guard cut short (ilp under heavy load): such a plan
    may differ from run to run, so only its validity is checked."""
    return plan.info.get("deterministic", True) is not False


@pytest.mark.parametrize("strategy", strategy_names())
def test_plan_matches_local_solve_byte_for_byte(client, strategy):
    body = {**BODY, "strategy": strategy, "options": options_for(strategy)}
    r = client.post("/v1/plan", json=body)
    assert r.status_code == 200, r.text
    expected = solve(PlanRequest(doc_lengths=DEBUG.doc_lengths, cp_size=4, strategy=strategy,
                                 context_length=32768, options=options_for(strategy)))
    if deterministic(expected) and deterministic(Plan.from_json(r.content)):
        assert r.content == expected.to_json().encode()
        assert r.headers["x-plan-id"] == expected.plan_id
    assert r.headers["server-timing"].startswith("solve;dur=")
    validate_plan(Plan.from_json(r.content))


def test_repeated_request_is_a_cache_hit_with_same_bytes(client):
    body = {**BODY, "cp_size": 3}
    first = client.post("/v1/plan", json=body)
    second = client.post("/v1/plan", json=body)
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("miss", "hit")
    assert first.content == second.content


def test_compare_returns_every_strategy_with_the_plan_bytes_of_plan(client):
    declared = {o for s in STRATEGIES.values() for o in s.options}
    options = {k: v for k, v in FAST_OPTIONS.items() if k in declared}
    r = client.post("/v1/compare", json={**BODY, "options": options})
    assert r.status_code == 200, r.text
    data = r.json()
    assert [e["strategy"] for e in data["results"]] == strategy_names()
    assert data["errors"] == {}
    for entry in data["results"]:
        name = entry["strategy"]
        single = client.post("/v1/plan", json={**BODY, "strategy": name,
                                               "options": options_for(name)})
        assert Plan.from_dict(entry["plan"]).to_json().encode() == single.content
        assert entry["plan"]["metrics"]["imbalance"] >= 1.0


def test_compare_subset_and_rejects_unknown_strategy(client):
    r = client.post("/v1/compare", json={**BODY, "strategies": ["ring", "flashcp"]})
    assert [e["strategy"] for e in r.json()["results"]] == ["ring", "flashcp"]
    bad = client.post("/v1/compare", json={**BODY, "strategies": ["flashcp", "nope"]})
    assert bad.status_code == 422 and bad.json()["field"] == "strategies"


def test_strategies_lists_names_descriptions_and_options(client):
    data = client.get("/v1/strategies").json()
    assert [s["name"] for s in data] == strategy_names()
    assert all(s["description"] and isinstance(s["options"], dict) for s in data)


def test_health_ready_metrics_docs_and_page(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200
    client.post("/v1/plan", json={**BODY, "strategy": "ring"})
    text = client.get("/metrics").text
    assert 'planner_requests_total{endpoint="/v1/plan",status="200",strategy="ring",' \
           'transport="http"}' in text
    for name in ("planner_solve_seconds_bucket", "planner_queue_depth", "planner_cache_hits_total",
                 "planner_fallbacks_total", "planner_request_seconds_bucket",
                 "planner_ready 1.0"):
        assert name in text
    assert client.get("/openapi.json").json()["paths"]["/v1/plan"]["post"]
    assert client.get("/docs").status_code == 200
    page = client.get("/")
    assert page.status_code == 200 and "<svg" not in page.text and "app.js" in page.text
    assert client.get("/static/app.js").status_code == 200


def test_sample_returns_a_packed_sequence_and_rejects_paths(client):
    data = client.get("/v1/sample", params={"dataset": "pile", "context_length": 65536}).json()
    assert sum(data["doc_lengths"]) == 65536
    bad = client.get("/v1/sample", params={"dataset": "file:/etc/passwd"})
    assert bad.status_code == 422 and bad.json()["field"] == "dataset"


BAD_BODIES = [
    ({"cp_size": 4}, "doc_lengths"),
    ({"doc_lengths": [5, 6]}, "cp_size"),
    ({"doc_lengths": "12", "cp_size": 4}, "doc_lengths"),
    ({"doc_lengths": [5, "6"], "cp_size": 4}, "doc_lengths.1"),
    ({"doc_lengths": [5, 6.5], "cp_size": 4}, "doc_lengths.1"),
    ({"doc_lengths": [5, -6], "cp_size": 4}, "doc_lengths.1"),
    ({"doc_lengths": [5, 0], "cp_size": 4}, "doc_lengths.1"),
    ({"doc_lengths": [5, 10**30], "cp_size": 4}, "doc_lengths.1"),
    ({"doc_lengths": [], "cp_size": 4}, "doc_lengths"),
    ({"doc_lengths": [1] * 65, "cp_size": 4}, "doc_lengths"),
    ({"doc_lengths": [5], "cp_size": 0}, "cp_size"),
    ({"doc_lengths": [5], "cp_size": -3}, "cp_size"),
    ({"doc_lengths": [5], "cp_size": 65}, "cp_size"),
    ({"doc_lengths": [5], "cp_size": 10**20}, "cp_size"),
    ({"doc_lengths": [5], "cp_size": True}, "cp_size"),
    ({"doc_lengths": [5], "cp_size": 2, "strategy": "nope"}, "strategy"),
    ({"doc_lengths": [5], "cp_size": 2, "strategy": 3}, "strategy"),
    ({"doc_lengths": [5], "cp_size": 2, "options": {"bogus": 1}}, "options"),
    ({"doc_lengths": [5], "cp_size": 2, "options": {"time_limit_s": 1e9}},
     "options.time_limit_s"),
    ({"doc_lengths": [5], "cp_size": 2, "comm_mode": "pigeon"}, "comm_mode"),
    ({"doc_lengths": [5], "cp_size": 2, "imbalance_target": 0.5}, "imbalance_target"),
    ({"doc_lengths": [5], "cp_size": 2, "kernel": "tpu"}, "kernel"),
    ({"doc_lengths": [5], "cp_size": 2, "model": {"num_heads": 3}}, "model.num_kv_heads"),
    ({"doc_lengths": [5], "cp_size": 2, "model": {"heads": 3}}, "model.heads"),
    ({"doc_lengths": [50, 60], "cp_size": 2, "context_length": 70}, "doc_lengths"),
    ({"doc_lengths": [5], "cp_size": 2, "surprise": 1}, "surprise"),
]


@pytest.mark.parametrize("body,field", BAD_BODIES)
def test_rejects_bad_input_naming_the_field(client, body, field):
    r = client.post("/v1/plan", json=body)
    assert r.status_code == 422, r.text
    data = r.json()
    assert data["field"] == field
    assert field.split(".")[0] in data["detail"]
    assert client.get("/healthz").status_code == 200


def test_rejects_malformed_json_and_non_object(client):
    r = client.post("/v1/plan", content=b'{"doc_lengths": [1,',
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 422
    assert client.post("/v1/plan", json=[1, 2]).status_code == 422


def test_rejects_oversized_body_with_413(client):
    body = {"doc_lengths": [1] * 3000, "cp_size": 2}
    assert client.post("/v1/plan", json=body).status_code == 413

    def chunks():  # no Content-Length: the limit holds for chunked uploads too
        yield b'{"doc_lengths": ['
        for _ in range(1000):
            yield b"1,1,1,1,"
        yield b"1], \"cp_size\": 2}"

    r = client.post("/v1/plan", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["field"] == "body"
    assert client.get("/healthz").status_code == 200


def test_rejects_missing_or_wrong_token_but_not_on_health():
    with make_client(token=TOKEN) as c:
        assert c.post("/v1/plan", json=BODY).status_code == 401
        wrong = c.post("/v1/plan", json=BODY, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
        for path in ("/metrics", "/v1/strategies", "/docs", "/openapi.json"):
            assert c.get(path).status_code == 401, path
        assert c.post("/v1/plan", json=BODY, headers=AUTH).status_code == 200
        for path in ("/healthz", "/readyz", "/", "/static/app.js"):
            assert c.get(path).status_code == 200, path


def test_jobs_submit_fetch_idempotent_conflict_and_unknown(client):
    body = {**BODY, "cp_size": 2}
    put = client.put("/v1/jobs/job-a/batches/7", json=body)
    assert put.status_code in (200, 202) and put.json()["status"] in ("pending", "done")
    got = client.get("/v1/jobs/job-a/batches/7", params={"wait_ms": 5000})
    assert got.status_code == 200
    again = client.put("/v1/jobs/job-a/batches/7", json=body)
    assert again.status_code == 200 and again.json()["plan_id"] == got.headers["x-plan-id"]
    assert again.json()["request_hash"] == put.json()["request_hash"]
    assert client.post("/v1/plan", json=body).content == got.content
    conflict = client.put("/v1/jobs/job-a/batches/7", json={**body, "cp_size": 3})
    assert conflict.status_code == 409 and "different content" in conflict.json()["detail"]
    assert client.get("/v1/jobs/job-a/batches/8").status_code == 404
    assert client.get("/v1/jobs/job-a/batches/7", params={"wait_ms": -1}).status_code == 422
    bad_id = client.put("/v1/jobs/job-a/batches/-x", json=body)
    assert bad_id.status_code == 422 and bad_id.json()["field"] == "batch"


def test_jobs_evict_a_jobs_old_batches():
    with make_client(max_batches_per_job=2) as c:
        for batch in range(4):
            c.put(f"/v1/jobs/j/batches/{batch}", json={**BODY, "cp_size": batch + 1})
        assert c.get("/v1/jobs/j/batches/3", params={"wait_ms": 5000}).status_code == 200
        assert c.get("/v1/jobs/j/batches/2", params={"wait_ms": 5000}).status_code == 200
        assert c.get("/v1/jobs/j/batches/0").status_code == 404
        assert 'planner_job_evictions_total{reason="job_window",store="plans"} 2.0' in c.get("/metrics").text


SCHEDULE = {"sequences": [[30000, 2000], [512, 700, 9000], [4096]], "num_ranks": 4,
            "memory_tokens": 16384}


@pytest.mark.parametrize("change,field", [
    ({"sequences": [[]]}, "sequences.0"),
    ({"sequences": [[5, -1]]}, "sequences.0.1"),
    ({"num_ranks": 0}, "num_ranks"),
    ({"num_ranks": 65}, "num_ranks"),
    ({"memory_tokens": "lots"}, "memory_tokens"),
    ({"profile": "file:/etc/passwd"}, "profile"),
])
def test_schedule_rejects_bad_input_naming_the_field(client, change, field):
    r = client.post("/v1/schedule", json={**SCHEDULE, **change})
    assert r.status_code == 422 and r.json()["field"] == field, r.text


def test_schedule_runs_fcp_when_installed(client):
    pytest.importorskip("planner_service.fcp")
    r = client.post("/v1/schedule", json=SCHEDULE)
    assert r.status_code == 200, r.text
    data = r.json()
    assert len(data["degrees"]) == 3 and all(1 <= d <= 4 for d in data["degrees"])
    unknown = client.post("/v1/schedule", json={**SCHEDULE, "surprise": 1})
    assert unknown.status_code == 422 and "surprise" in unknown.json()["detail"]
