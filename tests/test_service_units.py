"""Service parts without a server: settings, executor bounds, job store, proto stubs."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from planner_service import proto_build
from planner_service.core.errors import FieldError
from planner_service.core.profiles import default_kernel_name
from planner_service.core.request import debug_request
from planner_service.core.solved import SolvedPlan
from planner_service.service import executor as executor_mod
from planner_service.service.executor import DeadlineExceeded, Executor, Overloaded
from planner_service.service.jobs import Conflict, JobStore, NotFound
from planner_service.service.metrics import ServiceMetrics
from planner_service.service.schemas import request_key
from planner_service.service.settings import load_settings

ENV_NAMES = {
    "PLANNER_HOST": ("host", "0.0.0.0", "0.0.0.0"),
    "PLANNER_HTTP_PORT": ("http_port", "9001", 9001),
    "PLANNER_GRPC_PORT": ("grpc_port", "9002", 9002),
    "PLANNER_WORKERS": ("workers", "3", 3),
    "PLANNER_QUEUE_SIZE": ("queue_size", "5", 5),
    "PLANNER_REQUEST_TIMEOUT_S": ("request_timeout_s", "2.5", 2.5),
    "PLANNER_MAX_DOCS": ("max_docs", "100", 100),
    "PLANNER_MAX_CP_SIZE": ("max_cp_size", "64", 64),
    "PLANNER_MAX_TOKENS": ("max_tokens", "1000000", 1_000_000),
    "PLANNER_MAX_TIME_LIMIT_S": ("max_time_limit_s", "7", 7.0),
    "PLANNER_MAX_BODY_BYTES": ("max_body_bytes", "65536", 65536),
    "PLANNER_JOB_TTL_S": ("job_ttl_s", "60", 60.0),
    "PLANNER_MAX_JOBS": ("max_jobs", "10", 10),
    "PLANNER_JOB_MEMORY_MB": ("job_memory_mb", "8", 8.0),
    "PLANNER_CACHE_SIZE": ("cache_size", "0", 0),
    "PLANNER_SHUTDOWN_GRACE_S": ("shutdown_grace_s", "1", 1.0),
}


def test_settings_read_every_documented_env_name(monkeypatch):
    for env, (_, raw, _) in ENV_NAMES.items():
        monkeypatch.setenv(env, raw)
    monkeypatch.setenv("PLANNER_TOKEN", "zq9-secret")
    s = load_settings()
    for field, _, value in ENV_NAMES.values():
        assert getattr(s, field) == value, field
    assert s.token_value() == "zq9-secret"
    assert "zq9-secret" not in repr(s)


def test_settings_default_to_localhost_and_reject_bad_values(monkeypatch):
    assert load_settings().host == "127.0.0.1"
    monkeypatch.setenv("PLANNER_HTTP_PORT", "70000")
    with pytest.raises(ValueError, match="http_port"):
        load_settings()


def slow_solve(delay_s: float):
    real = executor_mod.solve_in_worker

    def solve(request, *args):
        time.sleep(delay_s)
        return real(request, *args)
    return solve


def run(coro):
    return asyncio.run(coro)


def test_executor_rejects_beyond_the_queue_bound_with_retry_after(monkeypatch):
    monkeypatch.setattr(executor_mod, "solve_in_worker", slow_solve(0.2))

    async def main():
        ex = Executor(load_settings(workers=0, queue_size=1), ServiceMetrics())
        await ex.start()
        requests = [debug_request(cp_size=n) for n in (2, 3, 5)]
        futures = [ex.submit(r, request_key(r)) for r in requests[:2]]
        with pytest.raises(Overloaded) as info:
            ex.submit(requests[2], request_key(requests[2]))
        assert info.value.retry_after_s >= 1 and ex.depth == 2
        results = await asyncio.gather(*futures)
        assert ex.depth == 0 and all(isinstance(r, SolvedPlan) for r in results)
        await ex.close()
    run(main())


def test_executor_deadline_answers_on_time_and_still_caches(monkeypatch):
    monkeypatch.setattr(executor_mod, "solve_in_worker", slow_solve(0.3))

    async def main():
        ex = Executor(load_settings(workers=0), ServiceMetrics())
        await ex.start()
        request = debug_request(cp_size=6)
        start = time.perf_counter()
        with pytest.raises(DeadlineExceeded):
            await ex.solve(request, request_key(request), timeout_s=0.05)
        assert time.perf_counter() - start < 0.25
        await asyncio.sleep(0.4)
        hit = await ex.solve(request, request_key(request), timeout_s=0.05)
        assert hit.cached
        await ex.close()
    run(main())


def test_executor_shares_one_solve_between_identical_requests(monkeypatch):
    calls = []
    real = executor_mod.solve_in_worker

    def counting(request, *args):
        calls.append(request)
        time.sleep(0.05)
        return real(request, *args)
    monkeypatch.setattr(executor_mod, "solve_in_worker", counting)

    async def main():
        ex = Executor(load_settings(workers=0), ServiceMetrics())
        await ex.start()
        request = debug_request(cp_size=7)
        results = await asyncio.gather(*(ex.solve(request, request_key(request))
                                         for _ in range(5)))
        assert len(calls) == 1 and len({r.plan_json for r in results}) == 1
        await ex.close()
    run(main())


def test_executor_process_pool_answers_like_a_local_solve():
    async def main():
        ex = Executor(load_settings(workers=1), ServiceMetrics())
        await ex.start()
        request = debug_request(strategy="per_doc")
        result = await ex.solve(request, request_key(request))
        await ex.close()
        return result
    from planner_service.solvers.registry import solve

    assert run(main()).plan_json == solve(debug_request(strategy="per_doc")).to_json()


def test_request_key_ignores_spelling_of_defaults():
    a = debug_request()
    b = debug_request(imbalance_target=1.05, kernel=default_kernel_name())
    assert request_key(a) == request_key(b) != request_key(debug_request(cp_size=5))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_store(clock: FakeClock, **kw: int | float) -> JobStore:
    args: dict = {"ttl_s": 10.0, "max_jobs": 3, "max_batches_per_job": 2,
                  "memory_bytes": 10**9, "deadline_s": 5.0, **kw}
    return JobStore(metrics=ServiceMetrics(), clock=clock, **args)


def done_future(plan_json: str = "{}") -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(SolvedPlan(plan_json, "id-" + plan_json[:8], "flashcp", 1.0, False, {}))
    return future


def test_job_store_ttl_conflict_and_window():
    async def main():
        clock = FakeClock()
        store = make_store(clock)
        entry, created = store.submit("j", "1", "k1", done_future)
        await asyncio.sleep(0)
        assert created and entry.status == "done"
        again, created = store.submit("j", "1", "k1", done_future)
        assert again is entry and not created
        with pytest.raises(Conflict):
            store.submit("j", "1", "k2", done_future)
        with pytest.raises(FieldError, match="job"):
            store.submit("bad id", "1", "k1", done_future)
        clock.now = 11.0
        with pytest.raises(NotFound):
            store.get("j", "1")
        for b in "abc":
            store.submit("j", b, "k" + b, done_future)
        await asyncio.sleep(0)
        assert store.num_batches == 2 and store.get("j", "c")
    run(main())


def test_job_store_reports_a_pending_batch_past_its_deadline():
    async def main():
        clock = FakeClock()
        store = make_store(clock)
        loop = asyncio.get_running_loop()
        store.submit("j", "1", "k", loop.create_future)
        assert (await store.fetch("j", "1", 0.01)).status == "pending"
        clock.now = 6.0
        with pytest.raises(DeadlineExceeded):
            await store.fetch("j", "1", 0.01)
    run(main())


@hsettings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 9), st.integers(1, 3000)),
                min_size=1, max_size=60))
def test_job_store_never_exceeds_its_bounds(ops):
    async def main():
        store = make_store(FakeClock(), memory_bytes=8000)
        for job, batch, size in ops:
            try:
                store.submit(f"j{job}", str(batch), f"{job}-{batch}-{size}",
                             lambda s=size: done_future("x" * s))
            except Conflict:
                pass
            await asyncio.sleep(0)
            assert store.num_jobs <= 3
            assert store.bytes_used <= 8000
            assert all(len(b) <= 2 for b in store._jobs.values())
            assert store.num_batches == sum(len(b) for b in store._jobs.values())
    run(main())


def test_proto_stubs_regenerate_when_missing_or_stale(tmp_path):
    proto = tmp_path / "planner.proto"
    shutil.copy(proto_build.PROTO_FILE, proto)
    out = tmp_path / "gen"
    assert proto_build.is_stale(proto, out)
    proto_build.ensure_stubs(proto, out)
    assert not proto_build.is_stale(proto, out)
    assert "from planner_service.proto_gen import planner_pb2" in \
        (out / "planner_pb2_grpc.py").read_text()
    proto.write_text(proto.read_text() + "\n// changed\n")
    assert proto_build.is_stale(proto, out)
    proto_build.ensure_stubs(proto, out)
    assert not proto_build.is_stale(proto, out)
