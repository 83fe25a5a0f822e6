"""The service under cost attacks: a request's plan size is priced before it is queued,
bad numbers anywhere are 4xx with short bodies, the job stores isolate clients by bytes,
and the lanes' state is in /metrics and /readyz. No timed assertions: outcomes and
counters (a refusal before any solve leaves planner_cache_misses_total unchanged)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner_service.core.request import debug_request
from planner_service.core.solved import SolvedPlan
from planner_service.proto_build import load
from planner_service.service import pool as pool_mod
from planner_service.service.cost_gate import FAST, SLOW, plan_bytes_bound, request_cost
from planner_service.service.executor import Executor, Overloaded
from planner_service.service.global_jobs import global_jobs
from planner_service.service.http_app import create_app
from planner_service.service.jobs import JobStore
from planner_service.service.metrics import ServiceMetrics
from planner_service.service.schemas import request_key
from planner_service.service.settings import load_settings
from planner_service.service.testing import grpc_in_thread

SETTINGS = {"workers": 0, "max_sequences": 16, "max_cp_size": 1024}
SCHEDULE = {"sequences": [[100, 50], [300]], "num_ranks": 2, "memory_tokens": 1000}
JSON = {"Content-Type": "application/json"}
MAX_ERROR_BYTES = 2048


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    with TestClient(create_app(load_settings(**SETTINGS))) as client:
        yield client


def misses(client: TestClient) -> float:
    """planner_cache_misses_total: solves the executor started."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("planner_cache_misses_total "):
            return float(line.split()[1])
    raise AssertionError("planner_cache_misses_total missing")


def refused(response, field: str) -> dict:
    assert response.status_code == 422, (response.status_code, response.text[:300])
    assert len(response.content) <= MAX_ERROR_BYTES, len(response.content)
    body = response.json()
    assert body["field"] == field, body
    return body


# ---- cost before work -------------------------------------------------------------------

@pytest.mark.parametrize(("docs", "length", "ranks", "strategy"), [
    (2048, 4096, 1024, "per_doc"),   # a 12 KB body whose plan is about 142 MB
    (4096, 4096, 512, "per_doc"),
    (65536, 256, 16, "zigzag"),
])
def test_plans_too_large_are_refused_before_any_solve(http, docs, length, ranks, strategy):
    before = misses(http)
    body = {"doc_lengths": [length] * docs, "cp_size": ranks, "strategy": strategy}
    detail = refused(http.post("/v1/plan", json=body), "cp_size")["detail"]
    assert "PLANNER_MAX_PLAN_BYTES" in detail
    refused(http.put("/v1/jobs/cost/batches/0", json=body), "cp_size")
    assert misses(http) == before, "no solve may start for a refused request"
    assert 'planner_rejected_total{reason="cost"}' in http.get("/metrics").text


def test_compare_skips_a_strategy_whose_plan_is_too_large_without_solving_it(http):
    body = {"doc_lengths": [4096] * 2048, "cp_size": 1024, "strategies": ["per_doc"]}
    before = misses(http)
    r = http.post("/v1/compare", json=body)
    assert r.status_code == 200 and "PLANNER_MAX_PLAN_BYTES" in r.json()["errors"]["per_doc"]
    assert misses(http) == before


def test_schedule_with_a_splitting_strategy_is_priced_too(http):
    body = {"sequences": [[64] * 4096] * 16, "num_ranks": 1024, "memory_tokens": 1 << 20,
            "strategy": "per_doc"}
    settings = {**SETTINGS, "max_shards": 2**40}
    with TestClient(create_app(load_settings(**settings))) as client:
        before = misses(client)
        assert "PLANNER_MAX_PLAN_BYTES" in refused(client.post("/v1/schedule", json=body),
                                                   "num_ranks")["detail"]
        assert misses(client) == before


def test_the_plan_bound_is_above_every_real_plan_and_close_for_large_ones():
    from planner_service.core.request import PlanRequest
    from planner_service.solvers.registry import solve

    for docs, n in (((1, 7, 300, 4096), 8), ((5000,) * 40, 16), ((3, 1, 2), 64)):
        for strategy in ("per_doc", "zigzag", "llama3", "ring"):
            try:
                plan = solve(PlanRequest(doc_lengths=docs, cp_size=n, strategy=strategy))
            except ValueError:
                continue  # a request the strategy refuses (e.g. the ring's model bound)
            bound = plan_bytes_bound(strategy, docs, n)
            assert bound is not None and bound >= len(plan.to_json()), (strategy, docs, n)
    big = (300,) * 2000
    real = len(solve(PlanRequest(doc_lengths=big, cp_size=64, strategy="per_doc")).to_json())
    assert plan_bytes_bound("per_doc", big, 64) <= 1.1 * real


def test_lanes_follow_the_strategy_and_the_work():
    assert request_cost("flashcp", (100,) * 64, 8, 65536).lane == FAST
    assert request_cost("flashcp", (100,) * 4096, 1024, 65536).lane == SLOW
    assert request_cost("ilp", (100,) * 4, 2, 65536).lane == SLOW
    assert request_cost("fcp", (100,) * 4, 2, 65536).lane == SLOW


# ---- every bad number is a 4xx ---------------------------------------------------------

BAD_GLOBAL = [
    (b'{"sequences":[[100,50]],"num_ranks":2,"memory_tokens":1000,"zz":NaN}', "zz"),
    (b'{"sequences":[[100,50]],"num_ranks":2,"memory_tokens":NaN}', "memory_tokens"),
    (b'{"sequences":[[100,50]],"num_ranks":2,"memory_tokens":1000,"imbalance_target":1e400}',
     "imbalance_target"),
    (b'{"sequences":[[100,50]],"num_ranks":2,"memory_tokens":1000,"imbalance_target":Infinity}',
     "imbalance_target"),
    (b'{"sequences":[[100,50]],"num_ranks":2,"memory_tokens":1000,"kernel":[1]}', "kernel"),
    (b'{"sequences":[[100,50]],"num_ranks":1e400,"memory_tokens":1000}', "num_ranks"),
    (b'{"sequences":[[100,50]],"num_ranks":2,"memory_tokens":1000,"unknown":1}', "unknown"),
]


@pytest.mark.parametrize(("raw", "field"), BAD_GLOBAL)
def test_bad_numbers_and_fields_are_refused_at_submit_on_every_schedule_route(http, raw, field):
    refused(http.put("/v1/jobs/j/global-batches/b1", content=raw, headers=JSON), field)
    refused(http.post("/v1/schedule", content=raw, headers=JSON), field)
    # Nothing was stored: the batch is unknown, not a 500 at every GET.
    assert http.get("/v1/jobs/j/global-batches/b1").status_code == 404


def test_a_profile_with_nan_coefficients_is_refused_at_submit(http):
    body = {**SCHEDULE, "profile": {"name": "x", "alpha": float("nan")}}
    raw = json.dumps(body).encode()  # json.dumps writes NaN
    r = http.put("/v1/jobs/j/global-batches/nanprofile", content=raw, headers=JSON)
    assert r.status_code == 422 and len(r.content) <= MAX_ERROR_BYTES, r.text[:300]


@pytest.mark.parametrize("depth", [40, 3000])
def test_deep_nesting_is_refused_at_submit_naming_the_nesting(http, depth):
    raw = ('{"sequences":[[100]],"num_ranks":2,"memory_tokens":10,"model":'
           + "[" * depth + "]" * depth + "}").encode()
    body = refused(http.put("/v1/jobs/j/global-batches/deep", content=raw, headers=JSON),
                   "body")
    assert "PLANNER_MAX_JSON_DEPTH" in body["detail"]
    assert "PLANNER_MAX_JSON_DEPTH" in refused(
        http.post("/v1/schedule", content=raw, headers=JSON), "body")["detail"]


def test_error_bodies_never_echo_large_inputs(http):
    many = {**SCHEDULE, "full_attention": ["x"] * 5000}
    r = http.post("/v1/schedule", json=many)
    assert r.status_code == 422 and len(r.content) <= MAX_ERROR_BYTES, len(r.content)
    model = {f"k{i}": i for i in range(30_000)}
    for path, body in (("/v1/schedule", {**SCHEDULE, "model": model}),
                       ("/v1/plan", {"doc_lengths": [1, 2], "cp_size": 2, "model": model}),
                       ("/v1/plan", {"doc_lengths": [1, 2], "cp_size": 2,
                                     "strategy": "x" * 60})):
        r = http.post(path, json=body)
        assert r.status_code == 422 and len(r.content) <= MAX_ERROR_BYTES, (path, len(r.content))


def test_grpc_schedule_routes_refuse_bad_numbers_as_invalid_argument():
    stubs = load()
    with grpc_in_thread(load_settings(**SETTINGS)) as (url, _):
        channel = grpc.insecure_channel(url.removeprefix("grpc://"))
        planner = stubs.pb2_grpc.PlannerStub(channel)
        batches = stubs.pb2_grpc.GlobalBatchesStub(channel)
        for raw, field in BAD_GLOBAL:
            with pytest.raises(grpc.RpcError) as info:
                batches.SubmitGlobalBatch(stubs.pb2.SubmitGlobalBatchRequest(
                    job="j", batch="b", request_json=raw.decode()), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, info.value)
            with pytest.raises(grpc.RpcError) as info:
                planner.Schedule(stubs.pb2.ScheduleRequest(request_json=raw.decode()),
                                 timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, info.value)
        channel.close()


# ---- job stores isolate clients by bytes -----------------------------------------------

def _done(size: int) -> asyncio.Future[SolvedPlan]:
    future: asyncio.Future[SolvedPlan] = asyncio.get_running_loop().create_future()
    future.set_result(SolvedPlan("x" * size, f"id{size}", "flashcp", 1.0, False, {}))
    return future


def test_one_client_with_huge_batches_evicts_only_its_own():
    async def main() -> None:
        metrics = ServiceMetrics()
        store = JobStore(ttl_s=600, max_jobs=1024, max_batches_per_job=8,
                         memory_bytes=64 * 2**20, deadline_s=60, metrics=metrics,
                         max_jobs_per_client=64, max_client_bytes=32 * 2**20, store="plans")
        store.submit("victim", "0", "k-victim", lambda: _done(1000), client="10.0.0.2")
        for i in range(40):  # 17 MB batches
            store.submit(f"attacker{i}", "0", f"k{i}", lambda: _done(17 * 2**20),
                         client="10.0.0.1")
            await asyncio.sleep(0)
        assert store.get("victim", "0").status == "done"
        assert store.client_bytes("10.0.0.1") <= 32 * 2**20
        assert store.bytes_used <= 64 * 2**20
        text = metrics.render().decode()
        assert 'planner_job_evictions_total{reason="client_memory",store="plans"}' in text
        assert 'planner_job_bytes{store="plans"}' in text
    asyncio.run(main())


def test_the_store_wide_bound_evicts_the_biggest_client_first():
    async def main() -> None:
        store = JobStore(ttl_s=600, max_jobs=1024, max_batches_per_job=8, memory_bytes=10_000,
                         deadline_s=60, metrics=ServiceMetrics(), max_client_bytes=8_000)
        store.submit("victim", "0", "kv", lambda: _done(1000), client="b")
        for i in range(20):
            store.submit(f"a{i}", "0", f"k{i}", lambda: _done(1500), client="a")
            await asyncio.sleep(0)
        assert store.get("victim", "0").status == "done"
    asyncio.run(main())


def test_the_global_batch_store_has_per_client_bounds_and_metrics(http):
    svc = http.app.state.service
    store = global_jobs(svc).store
    assert store.max_jobs_per_client == svc.settings.max_jobs_per_client
    assert store.max_client_bytes == int(svc.settings.max_client_job_mb * 2**20)
    assert http.put("/v1/jobs/gm/global-batches/0", json=SCHEDULE).status_code in (200, 202)
    text = http.get("/metrics").text
    assert 'planner_jobs{store="global"}' in text
    assert 'planner_job_batches{store="global"}' in text


def test_one_client_flooding_global_job_ids_keeps_the_victims_batch(http):
    svc = http.app.state.service
    store = global_jobs(svc).store

    async def main() -> None:
        store.submit("victim-job", "0", "kv", lambda: _done(100), client="10.0.0.9")
        for i in range(svc.settings.max_jobs_per_client + 50):
            store.submit(f"flood{i}", "0", f"kf{i}", lambda: _done(100), client="10.0.0.8")
        assert store.get("victim-job", "0").status == "done"
    asyncio.run(main())


# ---- lanes in /metrics and /readyz -------------------------------------------------------

def test_readyz_and_metrics_report_the_lanes(http):
    r = http.get("/readyz")
    assert r.status_code == 200 and set(r.json()["lanes"]) == {"fast", "slow"}
    text = http.get("/metrics").text
    for name in ("planner_lane_depth", "planner_lane_waiting", "planner_lane_oldest_wait_seconds"):
        assert f'{name}{{lane="fast"}}' in text and f'{name}{{lane="slow"}}' in text
    assert http.post("/v1/plan", json={"doc_lengths": [5, 6, 7], "cp_size": 2,
                                       "strategy": "ring"}).status_code == 200
    assert 'planner_solve_seconds_count{outcome="ok",strategy="ring"}' in \
        http.get("/metrics").text


# ---- fuzz: the global-batch routes over gRPC -------------------------------------------

FIELDS = ("sequences", "num_ranks", "memory_tokens", "strategy", "profile", "full_attention",
          "search", "method", "micro_batches", "build_plans", "model", "kernel", "link",
          "imbalance_target", "zz")
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)


@given(extra=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=4))
@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_grpc_global_batch_fuzz_finds_no_internal_error(grpc_stubs, extra):
    stubs, planner, batches = grpc_stubs
    raw = json.dumps({**SCHEDULE, **extra})  # NaN and Infinity written as JSON extensions
    for call in (lambda: batches.SubmitGlobalBatch(stubs.pb2.SubmitGlobalBatchRequest(
                     job="fuzz", batch=f"b{abs(hash(raw)) % 10**9}", request_json=raw),
                     timeout=60),
                 lambda: planner.Schedule(stubs.pb2.ScheduleRequest(request_json=raw),
                                          timeout=60)):
        try:
            call()
        except grpc.RpcError as exc:
            assert exc.code() in OK_CODES, (exc.code(), exc.details(), raw[:300])
            assert len(exc.details() or "") <= MAX_ERROR_BYTES


OK_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED)


@pytest.fixture(scope="module")
def grpc_stubs():
    stubs = load()
    with grpc_in_thread(load_settings(**SETTINGS)) as (url, _):
        channel = grpc.insecure_channel(url.removeprefix("grpc://"))
        yield (stubs, stubs.pb2_grpc.PlannerStub(channel),
               stubs.pb2_grpc.GlobalBatchesStub(channel))
        channel.close()


# ---- lanes: a cheap plan never waits behind a slow one --------------------------------

def test_a_fast_task_runs_while_every_slow_worker_is_busy():
    async def main() -> None:
        pool = pool_mod.WorkerPool(1, reserved=1)
        pool.start()
        loop = asyncio.get_running_loop()
        slow = [pool.submit(time.sleep, 3600, timeout_s=3600, lane="slow", client=c)
                for c in ("a", "b")]
        assert await pool.submit(abs, -3, timeout_s=3600, lane="fast") == 3
        assert not any(f.done() for f in slow)
        assert pool.waiting("slow") == 1 and pool.waiting("fast") == 0
        for f in slow:
            f.cancel()
        await pool.close(loop.time())
    asyncio.run(main())


def test_waiting_slow_tasks_start_round_robin_over_clients():
    async def main() -> None:
        pool = pool_mod.WorkerPool(1)
        pool.start()
        loop = asyncio.get_running_loop()
        finished: list[str] = []
        # z holds the one worker while a's three and b's one queue up.
        names = [("z", "z", 0.3), ("a", "a1", 0), ("a", "a2", 0), ("a", "a3", 0),
                 ("b", "b1", 0)]
        futures = []
        for client, name, seconds in names:
            f = pool.submit(time.sleep, seconds, timeout_s=3600, lane="slow", client=client)
            f.add_done_callback(lambda _, name=name: finished.append(name))
            futures.append(f)
        await asyncio.gather(*futures)
        assert finished == ["z", "a1", "b1", "a2", "a3"]
        await pool.close(loop.time())
    asyncio.run(main())


def test_one_client_cannot_hold_more_than_its_share_of_the_slow_lane():
    async def main() -> None:
        ex = Executor(load_settings(workers=1, max_slow_per_client=1, slow_queue_size=4),
                      ServiceMetrics())
        await ex.start()
        held = ex.start_call(time.sleep, 3600, client="10.0.0.1")
        with pytest.raises(Overloaded, match="PLANNER_MAX_SLOW_PER_CLIENT"):
            ex.start_call(time.sleep, 3600, client="10.0.0.1")
        other = ex.start_call(abs, -1, client="10.0.0.2")  # another client is admitted
        assert ex.lane_depth("slow") == 2
        # The fast lane answers meanwhile, on its reserved process.
        result = await ex.solve(debug_request(), request_key(debug_request()), timeout_s=60)
        assert result.plan_json
        assert 'planner_rejected_total{reason="client_slow"} 1.0' in ex.metrics.render().decode()
        held.cancel()
        other.cancel()
        await ex.close(asyncio.get_running_loop().time())
    asyncio.run(main())


def _refuse() -> None:
    from planner_service.core.errors import FieldError

    raise FieldError("cp_size", "cp_size: the plan is too large (a solver's refusal)")


def test_every_started_solve_is_observed_whatever_its_outcome():
    async def main() -> None:
        seen: list[tuple[str, str]] = []
        pool = pool_mod.WorkerPool(1, observer=lambda label, s, outcome: seen.append(
            (label, outcome)))
        pool.start()
        loop = asyncio.get_running_loop()
        assert await pool.submit(abs, -2, timeout_s=60, label="ok") == 2
        with pytest.raises(ValueError):
            await pool.submit(_refuse, timeout_s=60, label="refused")
        with pytest.raises(pool_mod.TaskExpired):
            await pool.submit(time.sleep, 3600, timeout_s=0.3, label="late")
        abandoned = pool.submit(time.sleep, 3600, timeout_s=3600, label="gone")
        until = loop.time() + 60
        while pool.waiting("slow") and loop.time() < until:  # the replacement takes it
            await asyncio.sleep(0.01)
        assert not pool.waiting("slow")
        abandoned.cancel()
        await asyncio.sleep(0)
        assert seen == [("ok", "ok"), ("refused", "refused"), ("late", "timeout"),
                        ("gone", "abandoned")]
        await pool.close(loop.time())
    asyncio.run(main())


def test_a_ring_too_large_to_price_is_refused_before_any_solve(http):
    # 65,536 docs of 30 tokens at N = 16: a plan within the byte limit whose ring the model
    # cannot price (the solve took seconds, then answered this refusal).
    before = misses(http)
    body = {"doc_lengths": [30] * 65536, "cp_size": 16, "strategy": "zigzag"}
    assert "MAX_RING_PAIRS" in refused(http.post("/v1/plan", json=body), "comm_mode")["detail"]
    assert misses(http) == before, "no solve may start for a refused request"


def test_the_ring_floor_is_at_most_the_real_pairs():
    from planner_service.core.request import PlanRequest
    from planner_service.core.step_time.runs import ring_pairs
    from planner_service.service.cost_gate import ring_pairs_floor
    from planner_service.solvers.registry import solve

    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(1, 40))
        docs = tuple(int(x) for x in rng.integers(1, 4 * n + 3, size=int(rng.integers(1, 30))))
        for strategy in ("per_doc", "zigzag"):
            plan = solve(PlanRequest(doc_lengths=docs, cp_size=n, strategy=strategy,
                                     comm_mode="alltoallv"))
            shards = [(r, s.doc) for r, held in enumerate(plan.groups[0].shards) for s in held
                      if s.end > s.start]
            rank, doc = (np.array(x, dtype=np.int64) for x in zip(*shards, strict=True))
            floor = ring_pairs_floor(strategy, docs, n)
            assert floor <= ring_pairs(rank, doc), (strategy, docs, n)
            if max(docs) <= n:  # one token per rank: the floor is exact
                assert floor == ring_pairs(rank, doc)
