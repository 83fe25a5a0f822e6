"""The attention mask of an FCP schedule request on every edge: the core request, the
HTTP and gRPC bodies (``window`` / ``layers``), the client's local scheduler and the
CLI. A masked schedule's plans carry the mask and declare their balance under it; a
request without a mask schedules as before (its body and bytes unchanged)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from timing import scaled
from typer.testing import CliRunner

from planner_service.cli import app as cli_app
from planner_service.client.backends import ServiceError, make_backend
from planner_service.client.local import solve_schedule_dict
from planner_service.core.build import GroupLayout, Layout
from planner_service.core.errors import FieldError
from planner_service.core.mask import CAUSAL, AttentionMask, LayerGroup
from planner_service.core.plan import Plan
from planner_service.core.request import DEFAULT_IMBALANCE_TARGET, PlanRequest
from planner_service.service.fcp_bridge import SCHEDULE_WIRE_NAMES, build_request
from planner_service.service.http_app import create_app
from planner_service.service.schedule_wire import request_hash, schedule_json
from planner_service.service.schemas import ScheduleRequestIn, schedule_body
from planner_service.service.settings import load_settings
from planner_service.service.testing import grpc_in_thread
from planner_service.solvers.fcp_schedule import ScheduleRequest, schedule
from planner_service.solvers.flashcp_masked import group_imbalances
from planner_service.solvers.kv_bound import listed

BODY = {"sequences": [[30000, 2000], [512, 700, 9000], [6000, 6000]], "num_ranks": 8,
        "memory_tokens": 16384}
GEMMA_LIKE = AttentionMask((LayerGroup(window=1024, layers=5), LayerGroup(window=None, layers=1)))
MASKS = [({"window": 1024}, AttentionMask.uniform(1024)),
         ({"layers": [{"window": 1024, "count": 5}, {"window": None, "count": 1}]}, GEMMA_LIKE)]
BAD = [({"window": 0}, "window"),
       ({"window": 128, "layers": [{"window": 1, "count": 1}]}, "layers"),
       ({"layers": []}, "layers"),
       ({"layers": [{"window": 8, "count": 0}]}, "layers.0.count"),
       ({"layers": [{"window": -1, "count": 2}]}, "layers.0.window"),
       ({"window": 64, "full_attention": [True, False, False]}, "full_attention")]
SETTINGS = {"workers": 0}


def core(mask: AttentionMask = CAUSAL, **extra: Any) -> ScheduleRequest:
    return ScheduleRequest(sequences=tuple(tuple(s) for s in BODY["sequences"]),
                           num_ranks=BODY["num_ranks"], memory_tokens=BODY["memory_tokens"],
                           mask=mask, **extra)


def payload(body: dict[str, Any]) -> dict[str, Any]:
    return schedule_body(ScheduleRequestIn.model_validate(body))


def check_plans(schedule_text: str, mask: AttentionMask) -> None:
    """Every micro-batch plan is made for ``mask`` and declares the balance its groups'
    layer-weighted imbalances give (recomputed here, group by group)."""
    data = json.loads(schedule_text)
    assert data["micro_batches"]
    for mb in data["micro_batches"]:
        plan = Plan.from_dict(mb["plan"])
        assert plan.mask == mask
        worst = max(brute_imbalance(group.shards, mask) for group in plan.groups)
        met = worst <= DEFAULT_IMBALANCE_TARGET
        assert plan.info.get("imbalance_target_met", True) is met, (worst, plan.info)
        if not met:
            assert plan.info["imbalance_reached"] == pytest.approx(worst, rel=1e-9)


def brute_imbalance(shards: Any, mask: AttentionMask) -> float:
    """max / mean over the group's ranks of the layer-weighted pair count: the query at
    document position p attends min(p + 1, W) keys in a layer of window W (p + 1 causal).
    O(tokens x windows): the obviously correct reference."""
    work = []
    for rank in shards:
        work.append(sum(group.layers * sum(
            p + 1 if group.window is None else min(p + 1, group.window)
            for shard in rank for p in range(shard.start, shard.end))
            for group in mask.groups))
    return max(work) * len(work) / sum(work)


def test_the_reference_is_the_planners_weighted_imbalance() -> None:
    result = schedule(core(GEMMA_LIKE, strategy="zigzag"))
    for mb in result.micro_batches:
        assert mb.plan is not None
        request = PlanRequest(doc_lengths=mb.plan.doc_lengths, cp_size=8, mask=GEMMA_LIKE)
        layout = listed(Layout([GroupLayout(tuple(g.ranks), [list(r) for r in g.shards])
                                for g in mb.plan.groups], {}))
        assert group_imbalances(layout, request) == pytest.approx(
            [brute_imbalance(g.shards, GEMMA_LIKE) for g in mb.plan.groups], rel=1e-12)


def test_the_body_fields_are_the_request_fields_under_their_wire_names() -> None:
    wire = [w for name in ScheduleRequest.__dataclass_fields__
            for w in SCHEDULE_WIRE_NAMES.get(name, (name,))]
    assert list(ScheduleRequestIn.model_fields) == wire


@pytest.mark.parametrize("extra,mask", [({}, CAUSAL), ({"window": None}, CAUSAL),
                                        ({"layers": [{"window": None, "count": 3}]}, CAUSAL),
                                        *MASKS])
def test_a_body_names_its_mask_in_one_canonical_form(extra: dict, mask: AttentionMask) -> None:
    data = payload({**BODY, **extra})
    assert build_request(data).mask == mask
    if mask.is_causal:  # the body of a request without a mask: its hash unchanged
        assert data == payload(BODY)
    else:
        assert data == {**payload(BODY), "layers": mask.to_list()}
    assert payload({**BODY, "layers": mask.to_list()}) == data


@pytest.mark.parametrize("extra,field", BAD)
def test_a_bad_mask_is_a_field_error(extra: dict, field: str) -> None:
    with pytest.raises(FieldError) as info:
        build_request(payload({**BODY, **extra}))
    assert info.value.field == field and "\n" not in str(info.value)


def test_a_masked_schedule_plans_every_group_under_the_mask() -> None:
    result = schedule(core(GEMMA_LIKE))
    causal = schedule(core())
    assert schedule_json(result).schedule_id != schedule_json(causal).schedule_id
    check_plans(json.dumps(result.to_dict()), GEMMA_LIKE)
    for mb in causal.micro_batches:
        assert mb.plan is not None and mb.plan.mask == CAUSAL
    # The schedule names its mask, also without plans; a causal one has no such key.
    assert result.to_dict()["mask"] == GEMMA_LIKE.to_list()
    assert schedule(core(GEMMA_LIKE, build_plans=False)).to_dict()["mask"] == \
        GEMMA_LIKE.to_list()
    assert "mask" not in causal.to_dict()
    assert "mask" not in schedule(core(AttentionMask.uniform(None, 3))).to_dict()


def test_a_plan_that_misses_the_target_under_the_mask_says_so() -> None:
    # zigzag balances causal work; under a window of 256 its groups miss R = 1.05, and
    # the plan declares the weighted figure (the causal schedule declares nothing).
    request = ScheduleRequest(sequences=((3000, 200), (512, 700, 900), (600, 600)),
                              num_ranks=8, memory_tokens=1024, strategy="zigzag",
                              mask=AttentionMask.uniform(256))
    result = schedule(request)
    assert any(mb.plan is not None and mb.plan.info.get("imbalance_target_met") is False
               for mb in result.micro_batches)
    check_plans(json.dumps(result.to_dict()), AttentionMask.uniform(256))
    causal = schedule(dataclasses.replace(request, mask=CAUSAL))
    assert all(mb.plan is not None and "imbalance_reached" not in mb.plan.info
               for mb in causal.micro_batches)


def test_a_request_without_a_mask_gives_the_same_bytes_as_the_core() -> None:
    for extra in ({}, {"window": None}, {"build_plans": False}):
        data = payload({**BODY, **extra})
        assert request_hash(data) == request_hash(payload({k: v for k, v in
                                                           {**BODY, **extra}.items()
                                                           if k != "window"}))
        text = schedule_json(schedule(build_request(data))).schedule_json
        base = core(build_plans=extra.get("build_plans", True))
        assert text == schedule_json(schedule(base)).schedule_json


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    with TestClient(create_app(load_settings(**SETTINGS))) as client:
        yield client


@pytest.mark.parametrize("extra,mask", MASKS)
def test_http_schedules_under_the_mask_like_the_local_scheduler(http, extra, mask) -> None:
    body = {**BODY, **extra}
    r = http.post("/v1/schedule", json=body)
    assert r.status_code == 200, r.text
    check_plans(r.text, mask)
    local = solve_schedule_dict(body)
    assert json.loads(local.plan_json)["micro_batches"] == r.json()["micro_batches"]


@pytest.mark.parametrize("extra,field", BAD)
def test_http_and_the_local_scheduler_answer_a_bad_mask_with_the_field(http, extra, field
                                                                        ) -> None:
    body = {**BODY, **extra}
    r = http.post("/v1/schedule", json=body)
    assert r.status_code == 422 and r.json()["field"] == field, r.text
    with pytest.raises(ServiceError) as info:
        solve_schedule_dict(body)
    assert info.value.field == field and info.value.message == r.json()["detail"]


@pytest.fixture(scope="module")
def grpc_url() -> Iterator[str]:
    with grpc_in_thread(load_settings(**SETTINGS), timeout_s=scaled(30)) as (url, _):
        yield url


def test_grpc_schedules_under_the_mask_and_refuses_a_bad_one(grpc_url) -> None:
    backend = make_backend(grpc_url, token="")
    try:
        text = backend.schedule({**BODY, "window": 1024}, scaled(30))
        check_plans(text, AttentionMask.uniform(1024))
        causal = backend.schedule(BODY, scaled(30))
        for field_extra, field in BAD[:2]:
            with pytest.raises(ServiceError) as info:
                backend.schedule({**BODY, **field_extra}, scaled(30))
            assert info.value.code == "INVALID_ARGUMENT" and info.value.field == field
    finally:
        backend.close()
    ours = json.loads(causal)
    mine = schedule(core()).to_dict()
    assert ours["micro_batches"] == json.loads(json.dumps(mine))["micro_batches"]


SEQS = "30000,2000;512,700,9000;6000,6000"


def run_cli(*args: str) -> Any:
    return CliRunner().invoke(cli_app, ["schedule", "--sequences", SEQS, "-N", "8", "-E",
                                        "16384", *args])


@pytest.mark.parametrize("args,flag", [(["--window", "0"], "--window"),
                                       (["--window", "wide"], "--window"),
                                       (["--layers", "0x64"], "--layers"),
                                       (["--window", "64", "--layers", "1x64"], "--layers")])
def test_the_cli_exits_2_on_a_bad_mask_naming_the_flag(args: list[str], flag: str) -> None:
    result = run_cli(*args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().endswith(f"; change {flag}"), result.stderr


def test_the_cli_refuses_compare_under_a_mask() -> None:
    result = run_cli("--window", "64", "--compare")
    assert result.exit_code == 2 and "--compare" in result.stderr


def test_the_cli_schedules_under_the_mask_and_without_one_as_before() -> None:
    masked = run_cli("--layers", "5x1024,1xfull", "--json")
    assert masked.exit_code == 0, masked.output
    check_plans(masked.stdout, GEMMA_LIKE)
    causal = run_cli("--json")
    full = run_cli("--window", "full", "--json")
    strip = lambda text: {k: v for k, v in json.loads(text).items()  # noqa: E731
                          if k not in ("solve_ms", "plan_ms")}
    assert strip(causal.stdout) == strip(full.stdout) == strip(json.dumps(
        schedule(core()).to_dict()))
    assert strip(causal.stdout) != strip(masked.stdout)


def test_a_global_batch_under_a_mask_is_one_request_whatever_its_spelling(http) -> None:
    path = "/v1/jobs/masked/global-batches/0"
    body = {**BODY, "window": 1024}
    first = http.put(path, json=body)
    assert first.status_code in (200, 202), first.text
    same = http.put(path, json={**BODY, "layers": [{"window": 1024, "count": 1}]})
    assert same.status_code in (200, 202), same.text
    assert same.json()["request_hash"] == first.json()["request_hash"]
    assert http.put(path, json={**BODY, "window": 512}).status_code == 409
    two = {**BODY, "layers": [{"window": 1024, "count": 2}]}  # another model: counts kept
    assert http.put(path, json=two).status_code == 409
    assert http.put(path, json=BODY).status_code == 409  # causal is another request
    got = http.get(path, params={"wait_ms": int(scaled(20) * 1e3)})
    assert got.status_code == 200, got.text
    check_plans(got.text, AttentionMask.uniform(1024))
    local = solve_schedule_dict(body)
    assert local.plan_json.encode() == got.content
    bad = http.put("/v1/jobs/masked/global-batches/1", json={**BODY, "window": 0})
    assert bad.status_code == 422 and bad.json()["field"] == "window", bad.text



def test_the_cli_takes_hf_config_like_planner_plan(tmp_path) -> None:
    # The flag reads the config by cli/mask_opts.mask_of, as planner plan does (its
    # transformers path: tests/test_cli_mask.py); a missing one is refused before FCP runs.
    missing = run_cli("--hf-config", str(tmp_path / "nope"))
    assert missing.exit_code == 2 and missing.stderr.strip().endswith("; change --hf-config")
    both = run_cli("--hf-config", str(tmp_path), "--window", "64")
    assert both.exit_code == 2 and "exclusive" in both.stderr
