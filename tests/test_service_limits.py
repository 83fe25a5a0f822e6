"""Service safety parts without a server: the solver pool's deadlines and
readiness, byte-bounded cache, per-client job bound, JSON depth, auth and content type
parsing, profile resolution."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from planner_service.core.errors import FieldError
from planner_service.core.request import debug_request
from planner_service.fcp.cost_model import PROFILES, forbid_profile_files, get_profile
from planner_service.service import pool as pool_mod
from planner_service.service.executor import DeadlineExceeded, Executor
from planner_service.service.jobs import JobStore
from planner_service.service.metrics import ServiceMetrics
from planner_service.service.middleware import bearer_token, is_json
from planner_service.service.profiles import ProfileCatalog
from planner_service.service.schemas import check_json_depth, request_key
from planner_service.service.settings import load_settings


def test_a_stuck_pool_is_not_ready_until_its_worker_is_replaced(monkeypatch):
    async def main():
        pool = pool_mod.WorkerPool(1)
        pool.start()
        real_kill = pool._kill
        monkeypatch.setattr(pool, "_kill", lambda worker, why: None)  # an unkillable solver
        with pytest.raises(pool_mod.TaskExpired):
            await pool.submit(time.sleep, 3600, timeout_s=0.2)  # a solver that never ends
        assert pool.healthy()  # just expired: within STUCK_AFTER_S
        await asyncio.sleep(pool_mod.STUCK_AFTER_S + 0.2)
        assert pool.stuck() == 1 and not pool.healthy()
        real_kill(pool._workers[0], "test")  # what the pool does when the kill works
        loop = asyncio.get_running_loop()
        until = loop.time() + 10
        while not pool.healthy() and loop.time() < until:
            await asyncio.sleep(0.02)
        assert pool.healthy() and pool.kills == 1
        assert await pool.submit(abs, -3, timeout_s=30) == 3
        await pool.close(loop.time())
    asyncio.run(main())


def test_an_abandoned_or_late_solve_frees_its_worker():
    async def main():
        ex = Executor(load_settings(workers=1, fast_workers=0), ServiceMetrics())
        await ex.start()
        task = asyncio.ensure_future(ex.call(time.sleep, 3600, timeout_s=60))
        await asyncio.sleep(0.3)
        task.cancel()  # the caller went away
        with pytest.raises(asyncio.CancelledError):
            await task
        result = await ex.solve(debug_request(), request_key(debug_request()), timeout_s=10)
        assert result.plan_json and ex.kills == 1
        with pytest.raises(DeadlineExceeded):
            await ex.call(time.sleep, 3600, timeout_s=0.3)
        assert (await ex.call(abs, -2, timeout_s=10))[0] == 2 and ex.kills == 2
        await ex.close()
    asyncio.run(main())


def test_the_cache_is_bounded_in_bytes():
    async def main():
        ex = Executor(load_settings(workers=0, cache_mb=0.02), ServiceMetrics())
        await ex.start()
        for n in range(2, 12):
            request = debug_request(cp_size=n, strategy="per_doc")
            await ex.solve(request, request_key(request))
            assert ex.cache_bytes <= 0.02 * 2**20
        assert 0 < ex.cache_entries < 10
        await ex.close()
    asyncio.run(main())


def test_a_client_flooding_job_ids_evicts_only_its_own(monkeypatch):
    store = JobStore(ttl_s=600, max_jobs=8, max_batches_per_job=2, memory_bytes=2**30,
                     deadline_s=60, metrics=ServiceMetrics(), max_jobs_per_client=3)

    async def main():
        loop = asyncio.get_running_loop()

        def start():
            return loop.create_future()

        store.submit("victim", "0", "k", start, client="a")
        for i in range(100):
            store.submit(f"flood-{i}", "0", "k", start, client="b")
        assert store.get("victim", "0").job == "victim"
        assert store.num_jobs == 4  # the victim and the flooder's last 3
        for i in range(6):  # a full store evicts from the client holding the most
            store.submit(f"c-{i}", "0", "k", start, client=f"c{i}")
        assert store.get("victim", "0") and store.num_jobs <= 8
    asyncio.run(main())


@pytest.mark.parametrize("text,ok", [
    (b'{"a": [1, {"b": 2}]}', True),
    (b'[[[1]]]', True),
    (b'[[[[1]]]]', False),
    (b'{"s": "[[[[[[[[", "t": "\\\\"}', True),
    (b'{"s": "\\"[[[[[[[[", "t": 1}', True),
    (b'"' + b"\\\\" * 3 + b'"[[[[]]]]', False),
])
def test_json_depth_counts_only_structure_outside_strings(text, ok):
    if ok:
        check_json_depth(text, 3)
    else:
        with pytest.raises(FieldError, match="PLANNER_MAX_JSON_DEPTH"):
            check_json_depth(text, 3)


def test_json_depth_fast_path_agrees_with_the_scan_across_chunk_edges(monkeypatch):
    """The numpy path (bodies without a backslash), read in 7-byte chunks, gives the
    depth Python's json gives, strings holding brackets included."""
    import json
    import random

    from planner_service.service import schemas

    def depth(v):
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        return 0 if items is None else 1 + max(map(depth, items), default=0)

    def tree(rng, d):
        if d == 0 or rng.random() < 0.2:
            return rng.choice([1, "a[b{", "]}", 2.5, None, "x"])
        if rng.random() < 0.5:
            return [tree(rng, d - 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(["k", "[", "}{"]): tree(rng, d - 1) for _ in range(rng.randint(0, 3))}

    monkeypatch.setattr(schemas, "_DEPTH_CHUNK", 7)
    rng = random.Random(0)
    for _ in range(500):
        value = tree(rng, rng.randint(0, 8))
        assert schemas._deepest_unescaped(json.dumps(value).encode()) == depth(value)


def test_grpc_peers_name_clients_like_http_does():
    from planner_service.service.grpc_server import peer_address

    assert peer_address("ipv4:10.0.0.5:4242") == "10.0.0.5"
    assert peer_address("ipv6:[::1]:4242") == "::1"
    assert peer_address("unix:/tmp/s") == "unix:/tmp/s"


def test_bearer_scheme_is_case_insensitive_and_json_types_are_recognised():
    assert bearer_token(b"bearer abc") == bearer_token(b"BEARER abc") == b"abc"
    assert bearer_token(b"Basic abc") is None and bearer_token(b"Bearer") is None
    assert is_json(b"application/json; charset=utf-8") and is_json(b"Application/JSON")
    assert not is_json(b"text/plain") and not is_json(None)


def test_profiles_resolve_names_and_values_but_never_paths(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would block: the test would hang if anything opened it
    site = tmp_path / "site.json"
    import json

    site.write_text(json.dumps({**PROFILES["cpu-gloo"].to_dict(), "name": "site"}))
    catalog = ProfileCatalog([str(site)])
    assert catalog.resolve("h100-llama3-8b", "p") == "h100-llama3-8b"
    assert catalog.resolve("site", "p")["name"] == "site"
    assert catalog.resolve(PROFILES["cpu-gloo"].to_dict(), "p")["name"] == "cpu-gloo"
    for spec in (f"file:{fifo}", str(fifo), "file:/etc/passwd", 7):
        with pytest.raises(FieldError, match="paths are not accepted"):
            catalog.resolve(spec, "p")


def test_solver_processes_refuse_profile_files(tmp_path, monkeypatch):
    import planner_service.fcp.cost_model as cost_model

    monkeypatch.setattr(cost_model, "_PROFILE_FILES_ALLOWED", True)
    path = tmp_path / "p.json"
    path.write_text(__import__("json").dumps(PROFILES["cpu-gloo"].to_dict()))
    assert get_profile(f"file:{path}") == PROFILES["cpu-gloo"]  # local CLI use
    forbid_profile_files()
    with pytest.raises(ValueError, match="not accepted here"):
        get_profile(f"file:{path}")
    assert get_profile(PROFILES["cpu-gloo"].to_dict()) == PROFILES["cpu-gloo"]
