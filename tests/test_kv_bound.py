"""``max_kv_tokens_per_rank``: every strategy meets the bound or refuses naming the
smallest bound it can meet, and a request at exactly that figure succeeds; the field
travels through HTTP, gRPC, the client's wire dicts and the CLI."""

from __future__ import annotations

import asyncio
import json
import pickle
import random
from dataclasses import replace
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from planner_service.cli import app
from planner_service.core.build import GroupLayout, Layout, build_plan
from planner_service.core.model import ModelSpec
from planner_service.core.plan import Plan, Shard
from planner_service.core.request import MAX_TOKENS, PlanRequest, debug_request
from planner_service.core.validate import validate_plan
from planner_service.proto_build import load
from planner_service.service.grpc_server import start_grpc
from planner_service.service.grpc_wire import dict_to_request, request_to_dict
from planner_service.service.http_app import create_app
from planner_service.service.ops import PlannerService
from planner_service.service.schemas import request_dict, request_key
from planner_service.service.settings import load_settings
from planner_service.solvers.flashcp_bounded import flashcp_candidates
from planner_service.solvers.kv_bound import (
    FIELD,
    KvBoundError,
    group_peak,
    kv_floor,
    layout_peak,
    listed,
    plan_peak,
)
from planner_service.solvers.memory_first import memory_first_shards
from planner_service.solvers.registry import solve

DEBUG = debug_request()
ILP = PlanRequest(doc_lengths=(500, 400, 300, 200, 100, 50), cp_size=3, strategy="ilp",
                  imbalance_target=1.3,
                  options={"time_limit_s": 0.5, "granularity": 32, "workers": 1})
"""A tiny ILP instance, single-threaded (deterministic) with a short limit."""


def _bounded(request: PlanRequest, bound: Any) -> PlanRequest:
    return replace(request, max_kv_tokens_per_rank=bound)


def least_of(request: PlanRequest) -> KvBoundError:
    """The strategy's refusal of a bound of 1 (below every plan)."""
    with pytest.raises(KvBoundError) as info:
        solve(_bounded(request, 1))
    return info.value


def assert_contract(request: PlanRequest, bounds: list[int]) -> tuple[Plan, KvBoundError]:
    """Each bound is met or refused, a refusal naming the same figure; a bound at the
    figure is met. Returns the plan without a bound and the refusal of bound 1."""
    free = solve(request)
    refusal = least_of(request)
    assert str(refusal).startswith(f"{FIELD}=1 is below the smallest this strategy can meet")
    assert f": {refusal.least} (" in str(refusal)
    assert refusal.floor <= refusal.least <= plan_peak(free)
    for bound in [*bounds, refusal.least, refusal.least - 1, plan_peak(free)]:
        if bound < 1:
            continue
        if bound >= refusal.least:
            plan = solve(_bounded(request, bound))
            validate_plan(plan)
            assert plan_peak(plan) <= bound
            assert plan.info[FIELD] == bound
        else:
            with pytest.raises(KvBoundError) as info:
                solve(_bounded(request, bound))
            assert info.value.least == refusal.least
    return free, refusal


# ---- the request -------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -5, MAX_TOKENS + 1, 1.5, True, "100"])
def test_rejects_a_bound_that_is_not_an_int_in_range(value):
    with pytest.raises(ValueError, match=r"^max_kv_tokens_per_rank must be"):
        _bounded(DEBUG, value)


def test_an_unset_bound_leaves_the_request_hash_and_the_plan_unchanged():
    assert DEBUG.max_kv_tokens_per_rank is None
    assert FIELD not in request_dict(DEBUG)
    assert request_key(DEBUG) != request_key(_bounded(DEBUG, 10**6))
    assert FIELD not in solve(DEBUG).info
    # A bound the plan meets anyway gives the same shards, recorded in the info.
    free, held = solve(DEBUG), solve(_bounded(DEBUG, 10**6))
    assert held.groups == free.groups
    assert held.info == {**free.info, FIELD: 10**6, "kv_candidate": "flashcp"}


def test_refusal_pickles_for_the_worker_pool():
    exc = KvBoundError(10, 20, "how", 15)
    again = pickle.loads(pickle.dumps(exc))
    assert (str(again), again.least, again.floor) == (str(exc), 20, 15)
    assert isinstance(again, ValueError)


# ---- measuring ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["alltoallv", "compact_allgather", "full", "p2p_ring"])
def test_group_peak_equals_the_plans_rank_stats(mode):
    rng = random.Random(7)
    for _ in range(30):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 8))]
        n = rng.randint(1, 5)
        shards: list[list[Shard]] = [[] for _ in range(n)]
        for doc, length in enumerate(lengths):
            cuts = sorted({0, length, *(rng.randint(1, length) for _ in range(rng.randint(0, 3)))})
            for a, b in zip(cuts, cuts[1:], strict=False):
                shards[rng.randrange(n)].append(Shard(doc, a, b))
        layout = Layout([GroupLayout(tuple(range(n)), shards)], {})
        plan = build_plan(layout, strategy="t", cp_size=n, doc_lengths=lengths,
                          context_length=None, comm_mode=mode, model=ModelSpec(),
                          kernel="h100-fa3", link="nvlink")
        # flash-attn runs a ring plan as a ring (the segment ring), as the PyTorch kernel does
        assert group_peak(shards, mode) == layout_peak(listed(layout), mode) == plan_peak(plan)
        assert plan_peak(plan) >= kv_floor(lengths, n, mode)


def test_memory_first_holds_t_tokens_per_rank_and_meets_the_floor_without_spill():
    rng = random.Random(3)
    for _ in range(50):
        lengths = [rng.randint(1, 5000) for _ in range(rng.randint(1, 30))]
        n = rng.randint(1, 16)
        shards = memory_first_shards(lengths, n)
        cap = -(-sum(lengths) // n)
        assert all(sum(s.end - s.start for s in rank) <= cap for rank in shards)
        covered = sorted((s.doc, s.start, s.end) for rank in shards for s in rank)
        for doc, length in enumerate(lengths):
            parts = [(a, b) for d, a, b in covered if d == doc]
            assert parts[0][0] == 0 and parts[-1][1] == length
            assert all(b == c for (_, b), (c, _) in zip(parts, parts[1:], strict=False))
        assert group_peak(shards, "alltoallv") >= kv_floor(lengths, n, "alltoallv")
    # Docs that pack exactly, and one longer than T: the floor, max(L, T), is met.
    for lengths, n in (([4, 4, 2, 2, 2, 2], 4), ([10, 3, 2, 1], 4), ([7], 3), ([5, 1], 6)):
        assert group_peak(memory_first_shards(lengths, n), "alltoallv") == \
            kv_floor(lengths, n, "alltoallv")


# ---- the strategies ----------------------------------------------------------------------


def test_flashcp_holds_the_bound_or_names_its_least_candidate_peak():
    free, refusal = assert_contract(DEBUG, [12000, 10000, 9000, 8500])
    n, mode = DEBUG.cp_size, "alltoallv"
    candidates = flashcp_candidates(DEBUG.doc_lengths, _bounded(DEBUG, 1))
    peaks = [layout_peak(listed(c.solve()), mode) for c in candidates]
    assert refusal.least == min(peaks)
    assert peaks[0] == plan_peak(free)
    assert refusal.least == kv_floor(DEBUG.doc_lengths, n, mode)  # memory_first reaches it
    assert "and no plan can hold less" in str(refusal)


@pytest.mark.parametrize("mode", ["compact_allgather", "p2p_ring"])
def test_flashcp_in_other_exchanges(mode):
    # Both kernels run p2p_ring as a ring (the PyTorch kernel's, flash-attn's segment ring).
    kernel = "cpu-torch" if mode == "p2p_ring" else "h100-fa3"
    free, refusal = assert_contract(debug_request(comm_mode=mode, kernel=kernel), [12000, 10000])
    if mode == "p2p_ring":  # own tokens plus two blocks of T, whatever the layout
        assert refusal.least == plan_peak(free) == 3 * -(-sum(DEBUG.doc_lengths) // 4)


def test_a_baseline_refuses_with_its_plans_peak():
    request = debug_request(strategy="llama3")
    free, refusal = assert_contract(request, [20000, 10000])
    assert refusal.least == plan_peak(free)
    assert "which does not depend on the bound" in str(refusal)
    held = solve(_bounded(request, plan_peak(free)))
    assert held.groups == free.groups


def test_fcp_holds_the_bound_in_every_group():
    request = debug_request(strategy="fcp")
    assert_contract(request, [12000, 10000, 9000])
    plan = solve(_bounded(request, 9000))
    assert all(max(g.rank_stats.kv_tokens_peak) <= 9000 for g in plan.groups)
    assert plan.info["kv_candidate"].startswith("fcp")


def test_auto_picks_among_the_candidates_within_the_bound():
    request = debug_request(strategy="auto")
    assert_contract(request, [12000])


def test_ilp_holds_the_bound_on_a_tiny_instance():
    free = solve(ILP)
    bound = plan_peak(free) - 1
    plan = solve(_bounded(ILP, bound))
    validate_plan(plan)
    assert plan_peak(plan) <= bound
    assert plan.info["kv_candidate"] in ("ilp bounded", "memory_first") or \
        plan.info["kv_candidate"].startswith("flashcp")
    # Below the floor (T = ceil(1550 / 3) tokens) no step can succeed: refused at once.
    with pytest.raises(KvBoundError) as info:
        solve(_bounded(ILP, 499))
    least = info.value.least
    assert least >= info.value.floor == 517
    at_least = solve(_bounded(ILP, least))
    assert plan_peak(at_least) <= least


# ---- the edges ---------------------------------------------------------------------------

BODY = {"doc_lengths": list(DEBUG.doc_lengths), "cp_size": 4, "context_length": 32768}


@pytest.fixture(scope="module")
def http():
    settings = load_settings(workers=0, max_docs=64, max_cp_size=64, max_body_bytes=4096)
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.mark.parametrize("value", [0, -1, "9000", 1.5])
def test_http_answers_422_for_an_invalid_bound(http, value):
    r = http.post("/v1/plan", json={**BODY, FIELD: value})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == FIELD


def test_http_plans_within_the_bound_and_refuses_below_it(http):
    r = http.post("/v1/plan", json={**BODY, FIELD: 9000})
    assert r.status_code == 200, r.text
    assert r.content == solve(debug_request(max_kv_tokens_per_rank=9000)).to_json().encode()
    r = http.post("/v1/plan", json={**BODY, FIELD: 8000})
    assert r.status_code == 422
    assert r.json()["field"] == FIELD and ": 8191 (" in r.json()["detail"]


def test_wire_dicts_carry_the_bound_both_ways():
    pb2 = load().pb2
    data = {**BODY, FIELD: 9000}
    assert request_to_dict(dict_to_request(pb2, data))[FIELD] == 9000
    assert FIELD not in request_to_dict(dict_to_request(pb2, BODY))
    assert request_dict(debug_request(max_kv_tokens_per_rank=9000))[FIELD] == 9000


async def _grpc_plans(bodies: list[dict]) -> list[tuple[grpc.StatusCode, str, str, bytes]]:
    stubs = load()
    service = PlannerService(load_settings(workers=0))
    await service.start()
    server = await start_grpc(service, "127.0.0.1", 0)
    out = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = stubs.pb2_grpc.PlannerStub(channel)
            for body in bodies:
                try:
                    reply = await stub.Plan(dict_to_request(stubs.pb2, body), timeout=30)
                    out.append((grpc.StatusCode.OK, "", "", reply.plan_json))
                except grpc.aio.AioRpcError as exc:
                    field = dict(exc.trailing_metadata() or ()).get("field", "")
                    out.append((exc.code(), field, exc.details() or "", b""))
    finally:
        await server.stop(0)
        await service.close()
    return out


def test_grpc_plans_within_the_bound_and_answers_invalid_argument_otherwise():
    ok, invalid, below = asyncio.run(_grpc_plans([
        {**BODY, FIELD: 9000}, {**BODY, FIELD: 0}, {**BODY, FIELD: 8000}]))
    assert ok[0] == grpc.StatusCode.OK
    assert ok[3] == solve(debug_request(max_kv_tokens_per_rank=9000)).to_json().encode()
    assert invalid[:2] == (grpc.StatusCode.INVALID_ARGUMENT, FIELD)
    assert below[:2] == (grpc.StatusCode.INVALID_ARGUMENT, FIELD)
    assert ": 8191 (" in below[2]


def test_cli_flag_bounds_the_plan_and_reports_the_least():
    runner = CliRunner()
    docs = ",".join(map(str, DEBUG.doc_lengths))
    result = runner.invoke(app, ["plan", "--docs", docs, "--cp", "4",
                                 "--max-kv-tokens-per-rank", "9000", "--json"])
    assert result.exit_code == 0, result.output
    plan = Plan.from_json(result.stdout)
    assert plan.info[FIELD] == 9000 and plan_peak(plan) <= 9000
    result = runner.invoke(app, ["plan", "--docs", docs, "--cp", "4",
                                 "--max-kv-tokens-per-rank", "8000"])
    assert result.exit_code == 2
    assert "max_kv_tokens_per_rank=8000 is below" in result.output and ": 8191 (" in result.output
    assert json.loads(json.dumps(plan.info))[FIELD] == 9000


def test_a_ring_plan_holds_the_rings_kv_under_either_kernel():
    # flash-attn runs a p2p_ring plan as the segment ring, the PyTorch kernel as its ring:
    # own tokens plus two blocks of T either way; flash-attn's gathered path (opt-out)
    # would run it as the full all-gather.
    lengths = (3000, 1200, 800, 600, 400)
    for kernel, link in (("h100-fa2", "nvlink"), ("cpu-torch", "gloo-local")):
        ring = solve(PlanRequest(doc_lengths=lengths, cp_size=4, strategy="zigzag",
                                 kernel=kernel, link=link))
        t = ring.groups[0]
        per_rank = max(x + p for x, p in zip(t.rank_stats.tokens, t.padding, strict=True))
        assert t.rank_stats.kv_tokens_peak == tuple(x + 2 * per_rank for x in t.rank_stats.tokens)
