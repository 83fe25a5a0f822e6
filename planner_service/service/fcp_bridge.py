"""The one place the service touches FCP (issue 4): ``planner_service.fcp.schedule``.

Kept thin on purpose: the FCP package owns its request and result types; the service
passes the validated JSON body and serialises whatever comes back.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from planner_service.core.plan import canonical_json

FCP_MODULE = "planner_service.fcp"


def load_schedule() -> Callable[[Any], Any] | None:
    """``planner_service.fcp.schedule`` if FCP is installed, else None."""
    try:
        module = importlib.import_module(FCP_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name == FCP_MODULE:
            return None
        raise
    schedule = getattr(module, "schedule", None)
    return schedule if callable(schedule) else None


def result_json(result: Any) -> str:
    """Serialise an FcpResult: canonical JSON of ``to_dict()`` (or of the value)."""
    if hasattr(result, "to_dict"):
        return canonical_json(result.to_dict())
    return canonical_json(result)


def build_request(payload: dict[str, Any]) -> Any:
    """``planner_service.fcp.ScheduleRequest`` from the JSON body (the dict itself if FCP
    has no such type); raises ValueError naming a bad or unknown field."""
    from planner_service.core.model import ModelSpec

    request_type = getattr(importlib.import_module(FCP_MODULE), "ScheduleRequest", None)
    if request_type is None:
        return payload
    data = dict(payload)
    data["sequences"] = tuple(tuple(seq) for seq in data["sequences"])
    if isinstance(data.get("full_attention"), list):
        data["full_attention"] = tuple(data["full_attention"])
    if isinstance(data.get("model"), dict):
        data["model"] = ModelSpec.from_dict(data["model"])
    try:
        return request_type(**data)
    except TypeError as exc:  # an unexpected keyword: a field FCP does not know
        raise ValueError(f"body: {exc}".replace("__init__() ", "")) from None


def schedule_in_worker(payload: dict[str, Any]) -> str:
    """Run FCP on a validated /v1/schedule body (in a solver process); raises ValueError
    for bad input and RuntimeError if FCP is not installed."""
    schedule = load_schedule()
    if schedule is None:
        raise RuntimeError("FCP is not installed")
    return result_json(schedule(build_request(payload)))
