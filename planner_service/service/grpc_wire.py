"""Conversions between the proto messages and the JSON-shaped dicts of the HTTP API.

Pure and light (no FastAPI): the server validates the dicts with the same pydantic models
as HTTP, and the client builds messages from the same dicts it would POST.
"""

from __future__ import annotations

import json
from typing import Any

from planner_service.core.errors import FieldError
from planner_service.core.solved import SolvedPlan


def request_to_dict(msg: Any) -> dict[str, Any]:
    """A PlanRequest message as the JSON body of POST /v1/plan; raises FieldError."""
    data: dict[str, Any] = {"doc_lengths": list(msg.doc_lengths), "cp_size": msg.cp_size}
    if msg.strategy:
        data["strategy"] = msg.strategy
    if msg.HasField("context_length"):
        data["context_length"] = msg.context_length
    if msg.truncate:
        data["truncate"] = True
    if msg.HasField("imbalance_target"):
        data["imbalance_target"] = msg.imbalance_target
    if msg.HasField("max_kv_tokens_per_rank"):
        data["max_kv_tokens_per_rank"] = msg.max_kv_tokens_per_rank
    if msg.HasField("window"):
        data["window"] = msg.window
    if msg.layers:
        data["layers"] = [{"window": g.window if g.HasField("window") else None, "count": g.count}
                          for g in msg.layers]
    if msg.comm_mode:
        data["comm_mode"] = msg.comm_mode
    if msg.HasField("model"):
        data["model"] = {f.name: v for f, v in msg.model.ListFields()}
    if msg.kernel:
        data["kernel"] = msg.kernel
    if msg.link:
        data["link"] = msg.link
    if msg.options_json:
        try:
            options = json.loads(msg.options_json)
        except ValueError as exc:
            raise FieldError("options_json", f"options_json is not valid JSON: {exc}") from None
        if not isinstance(options, dict):
            raise FieldError("options_json", "options_json must be a JSON object")
        data["options"] = options
    return data


def dict_to_request(pb2: Any, data: dict[str, Any]) -> Any:
    """The PlanRequest message for a JSON body; raises FieldError for a field the proto
    cannot carry (so the client fails loudly instead of sending something else)."""
    known = {"doc_lengths", "cp_size", "strategy", "context_length", "truncate",
             "imbalance_target", "comm_mode", "model", "kernel", "link", "options",
             "max_kv_tokens_per_rank", "window", "layers"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise FieldError(unknown[0], f"request has fields the planner does not know: "
                         f"{unknown}")
    msg = pb2.PlanRequest(doc_lengths=list(data.get("doc_lengths", [])),
                          cp_size=int(data.get("cp_size", 0)))
    for name in ("strategy", "comm_mode", "kernel", "link"):
        if data.get(name) is not None:
            setattr(msg, name, data[name])
    if data.get("context_length") is not None:
        msg.context_length = data["context_length"]
    if data.get("truncate"):
        msg.truncate = True
    if data.get("imbalance_target") is not None:
        msg.imbalance_target = data["imbalance_target"]
    if data.get("max_kv_tokens_per_rank") is not None:
        msg.max_kv_tokens_per_rank = data["max_kv_tokens_per_rank"]
    if data.get("window") is not None:
        msg.window = data["window"]
    for group in data.get("layers") or ():
        layer = msg.layers.add(count=group.get("count", 0))
        if group.get("window") is not None:
            layer.window = group["window"]
    if data.get("model"):
        msg.model.SetInParent()
        for name, value in data["model"].items():
            if value is not None:
                setattr(msg.model, name, value)
    if data.get("options"):
        msg.options_json = json.dumps(data["options"], sort_keys=True)
    return msg


def plan_reply(pb2: Any, result: SolvedPlan) -> Any:
    """The PlanReply of a solve (the same fields as SolvedPlan)."""
    return pb2.PlanReply(
        plan_json=result.plan_json.encode(), plan_id=result.plan_id, strategy=result.strategy,
        solve_ms=result.solve_ms, cached=result.cached,
        metrics=pb2.PlanMetrics(**(result.headline or {})))
