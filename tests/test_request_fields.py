"""PlanRequest, the HTTP schema and the proto message agree field for field.

``core.request.REQUEST_FIELDS`` (PlanRequest's fields) with ``WIRE_NAMES`` is the one list
of a request's fields; the HTTP body (``PlanRequestIn``), the proto's ``PlanRequest`` and
the conversions between them and the core request follow it.
"""

from __future__ import annotations

from dataclasses import fields

from planner_service.core.mask import CAUSAL
from planner_service.core.model import ModelSpec
from planner_service.core.profiles import KERNEL_PROFILES, default_kernel_name
from planner_service.core.request import (
    BODY_FIELDS,
    REQUEST_FIELDS,
    WIRE_NAMES,
    PlanRequest,
    debug_request,
)
from planner_service.proto_build import load
from planner_service.service.grpc_wire import PROTO_NAMES, dict_to_request, request_to_dict
from planner_service.service.schemas import (
    Limits,
    ModelSpecIn,
    PlanRequestIn,
    request_dict,
    to_plan_request,
)

PB2 = load().pb2

FULL_BODY = {
    "doc_lengths": [4099, 37, 1023], "cp_size": 2, "strategy": "zigzag",
    "context_length": 8192, "truncate": True, "imbalance_target": 1.25,
    "comm_mode": "p2p_ring", "model": {"num_heads": 16, "head_dim": 64},
    "kernel": next(k for k in KERNEL_PROFILES if k != default_kernel_name()),
    "link": "infiniband", "options": {"x": 1},
    "max_kv_tokens_per_rank": 9000, "layers": [{"window": 512, "count": 3},
                                               {"window": None, "count": 1}],
}
"""A body that sets every field to a value that is not its default (the mask by
``layers``; ``window`` is the other spelling of the same field)."""


def test_body_fields_are_the_request_fields_under_their_wire_names():
    assert set(REQUEST_FIELDS) - set(WIRE_NAMES) <= set(BODY_FIELDS)
    assert set(BODY_FIELDS) == (set(REQUEST_FIELDS) - set(WIRE_NAMES)
                                | {n for names in WIRE_NAMES.values() for n in names})


def test_http_schema_has_exactly_the_body_fields():
    assert list(PlanRequestIn.model_fields) == list(BODY_FIELDS)


def test_proto_message_has_exactly_the_body_fields():
    proto = [f.name for f in PB2.PlanRequest.DESCRIPTOR.fields]
    assert proto == [PROTO_NAMES.get(n, n) for n in BODY_FIELDS]


def test_model_spec_agrees_in_core_http_and_proto():
    core = [f.name for f in fields(ModelSpec)]
    assert list(ModelSpecIn.model_fields) == core
    assert [f.name for f in PB2.ModelSpec.DESCRIPTOR.fields] == core


def test_every_field_crosses_the_proto_and_reaches_the_core_request():
    assert set(FULL_BODY) == set(BODY_FIELDS) - {"window"}
    assert request_to_dict(dict_to_request(PB2, FULL_BODY)) == FULL_BODY
    request = to_plan_request(PlanRequestIn.model_validate(FULL_BODY), Limits.library())
    defaults = PlanRequest(doc_lengths=(1,), cp_size=1)
    changed = [f for f in REQUEST_FIELDS if getattr(request, f) != getattr(defaults, f)]
    assert changed == list(REQUEST_FIELDS)
    data = request_dict(request)
    assert set(data) == set(FULL_BODY)
    again = to_plan_request(PlanRequestIn.model_validate(data), Limits.library())
    assert again == request


def test_window_is_the_mask_too():
    body = {"doc_lengths": [4096], "cp_size": 2, "window": 256}
    assert request_to_dict(dict_to_request(PB2, body)) == body
    request = to_plan_request(PlanRequestIn.model_validate(body), Limits.library())
    assert request.mask != CAUSAL and "layers" in request_dict(request)


def test_unset_fields_stay_unset_over_the_proto():
    body = {"doc_lengths": list(debug_request().doc_lengths), "cp_size": 4}
    assert request_to_dict(dict_to_request(PB2, body)) == body
    assert "max_kv_tokens_per_rank" not in request_dict(debug_request())
    assert "layers" not in request_dict(debug_request())
