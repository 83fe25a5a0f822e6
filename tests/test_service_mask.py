"""The attention mask at the service edge: HTTP bodies (window / layers), the gRPC
message, the content hash, and the plan the service answers equal to a local solve."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from planner_service.core.errors import FieldError
from planner_service.core.mask import CAUSAL, AttentionMask, LayerGroup
from planner_service.core.plan import Plan
from planner_service.core.request import PlanRequest
from planner_service.proto_build import load
from planner_service.service.grpc_wire import dict_to_request, request_to_dict
from planner_service.service.http_app import create_app
from planner_service.service.schemas import Limits, parse_plan_request, request_key
from planner_service.service.settings import load_settings
from planner_service.solvers.registry import solve

DOCS = [4099, 37, 1023, 8191, 1, 511]
LIMITS = Limits(max_docs=64, max_cp_size=64, max_tokens=1 << 20, max_time_limit_s=10.0,
                max_sequences=16)
GEMMA_LIKE = AttentionMask((LayerGroup(window=1024, layers=5), LayerGroup(window=None, layers=1)))


def body(**extra: object) -> dict:
    return {"doc_lengths": DOCS, "cp_size": 4, **extra}


@pytest.mark.parametrize("extra,mask", [
    ({}, CAUSAL),
    ({"window": None}, CAUSAL),
    ({"window": 128}, AttentionMask.uniform(128)),
    ({"layers": [{"window": 1024, "count": 5}, {"window": None, "count": 1}]}, GEMMA_LIKE),
])
def test_a_body_names_its_mask(extra: dict, mask: AttentionMask) -> None:
    assert parse_plan_request(body(**extra), LIMITS).mask == mask


@pytest.mark.parametrize("extra,field", [
    ({"window": 0}, "window"),
    ({"window": 128, "layers": [{"window": 1, "count": 1}]}, "layers"),
    ({"layers": []}, "layers"),
    ({"layers": [{"window": 8, "count": 0}]}, "layers.0.count"),
    ({"layers": [{"window": -1, "count": 2}]}, "layers.0.window"),
])
def test_a_bad_mask_is_a_field_error(extra: dict, field: str) -> None:
    with pytest.raises(FieldError) as info:
        parse_plan_request(body(**extra), LIMITS)
    assert info.value.field == field


def test_the_content_hash_keeps_causal_requests_and_tells_masks_apart() -> None:
    causal = request_key(parse_plan_request(body(), LIMITS))
    assert request_key(parse_plan_request(body(window=None), LIMITS)) == causal
    assert request_key(parse_plan_request(body(window=128), LIMITS)) != causal


@pytest.mark.parametrize("extra", [{"window": 128},
                                   {"layers": [{"window": 1024, "count": 5},
                                               {"window": None, "count": 1}]}])
def test_the_grpc_message_carries_the_mask(extra: dict) -> None:
    pb2, _ = load()
    data = body(**extra)
    assert request_to_dict(dict_to_request(pb2, data)) == data


def test_the_service_plans_under_the_mask_like_a_local_solve() -> None:
    settings = load_settings(workers=0, max_docs=64, max_cp_size=64)
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/plan", json=body(window=128))
        assert r.status_code == 200, r.text
        bad = client.post("/v1/plan", json=body(window=0))
        assert bad.status_code == 422 and "window" in bad.text
    plan = Plan.from_json(r.text)
    local = solve(PlanRequest(doc_lengths=tuple(DOCS), cp_size=4, mask=AttentionMask.uniform(128)))
    assert plan.mask == AttentionMask.uniform(128)
    assert plan.to_json() == local.to_json()
