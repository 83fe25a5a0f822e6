"""Conversions between the proto messages and the JSON-shaped dicts of the HTTP API.

Pure and light (no FastAPI): the server validates the dicts with the same pydantic models
as HTTP, and the client builds messages from the same dicts it would POST.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from planner_service.core.errors import FieldError
from planner_service.core.request import BODY_FIELDS, REQUIRED_FIELDS
from planner_service.core.solved import SolvedPlan

PROTO_NAMES = {"options": "options_json"}
"""Body fields whose proto field has another name (the options travel as JSON text)."""


def _layers_of(msg: Any) -> list[dict[str, Any]]:
    return [{"window": g.window if g.HasField("window") else None, "count": g.count}
            for g in msg.layers]


def _options_of(msg: Any) -> dict[str, Any]:
    try:
        options = json.loads(msg.options_json)
    except ValueError as exc:
        raise FieldError("options_json", f"options_json is not valid JSON: {exc}") from None
    if not isinstance(options, dict):
        raise FieldError("options_json", "options_json must be a JSON object")
    return options


FROM_PROTO: dict[str, Callable[[Any], Any]] = {
    "doc_lengths": lambda msg: list(msg.doc_lengths),
    "model": lambda msg: {f.name: v for f, v in msg.model.ListFields()},
    "layers": _layers_of,
    "options": _options_of,
}
"""Body fields that are not a proto scalar of the same meaning, and their reading."""


def request_to_dict(msg: Any) -> dict[str, Any]:
    """A PlanRequest message as the JSON body of POST /v1/plan; raises FieldError.

    Every body field (core.request.BODY_FIELDS) the message sets: the required ones
    always, a field with presence (``optional``, a message) when present, another when
    not empty (proto3 cannot tell an empty string, false or an empty list from unset).
    """
    data: dict[str, Any] = {}
    fields = msg.DESCRIPTOR.fields_by_name
    for name in BODY_FIELDS:
        proto = PROTO_NAMES.get(name, name)
        if name in REQUIRED_FIELDS:
            given = True
        elif fields[proto].has_presence:
            given = msg.HasField(proto)
        else:
            given = bool(getattr(msg, proto))
        if given:
            read = FROM_PROTO.get(name)
            data[name] = read(msg) if read is not None else getattr(msg, proto)
    return data


def _set_model(msg: Any, model: Any) -> None:
    if model:
        msg.model.SetInParent()
        for name, value in model.items():
            if value is not None:
                setattr(msg.model, name, value)


def _set_layers(msg: Any, layers: Any) -> None:
    for group in layers or ():
        layer = msg.layers.add(count=group.get("count", 0))
        if group.get("window") is not None:
            layer.window = group["window"]


def _set_options(msg: Any, options: Any) -> None:
    if options:
        msg.options_json = json.dumps(options, sort_keys=True)


def _set_truncate(msg: Any, truncate: Any) -> None:
    if truncate:
        msg.truncate = True


TO_PROTO: dict[str, Callable[[Any, Any], None]] = {
    "truncate": _set_truncate,
    "model": _set_model,
    "layers": _set_layers,
    "options": _set_options,
}
"""Body fields that are not set as a proto scalar of the same name, and their writing
(the required ones are given to the message's constructor)."""


def dict_to_request(pb2: Any, data: dict[str, Any]) -> Any:
    """The PlanRequest message for a JSON body; raises FieldError for a field the proto
    cannot carry (so the client fails loudly instead of sending something else). A
    field that is None is left unset."""
    unknown = sorted(set(data) - set(BODY_FIELDS))
    if unknown:
        raise FieldError(unknown[0], f"request has fields the planner does not know: "
                         f"{unknown}")
    msg = pb2.PlanRequest(doc_lengths=list(data.get("doc_lengths", [])),
                          cp_size=int(data.get("cp_size", 0)))
    for name in BODY_FIELDS:
        if name in REQUIRED_FIELDS:
            continue
        value = data.get(name)
        write = TO_PROTO.get(name)
        if write is not None:
            write(msg, value)
        elif value is not None:
            setattr(msg, PROTO_NAMES.get(name, name), value)
    return msg


def plan_reply(pb2: Any, result: SolvedPlan) -> Any:
    """The PlanReply of a solve (the same fields as SolvedPlan)."""
    return pb2.PlanReply(
        plan_json=result.plan_json.encode(), plan_id=result.plan_id, strategy=result.strategy,
        solve_ms=result.solve_ms, cached=result.cached,
        metrics=pb2.PlanMetrics(**(result.headline or {})))
