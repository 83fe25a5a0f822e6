"""The one place the service touches FCP: ``planner_service.solvers.fcp_schedule``.

Kept thin on purpose: FCP owns its request and result types; the service passes the
validated JSON body and serialises what comes back.
"""

from __future__ import annotations

from typing import Any

from planner_service.core.errors import FieldError
from planner_service.core.mask import parse_mask
from planner_service.core.model import ModelSpec
from planner_service.core.plan import canonical_json
from planner_service.solvers.fcp_schedule import ScheduleRequest, schedule

SCHEDULE_WIRE_NAMES = {"mask": ("window", "layers")}
"""ScheduleRequest field -> the body fields that carry it (as core/request.py WIRE_NAMES
for a plan request): the mask travels as ``window`` or ``layers`` (core/mask.parse_mask)."""


def build_request(payload: dict[str, Any]) -> ScheduleRequest:
    """The ScheduleRequest of a JSON body; raises FieldError naming a bad or unknown field.
    A field set to null takes its default, in ``model`` too (ScheduleRequestIn's unset
    fields dump as None); ``window`` / ``layers`` give the mask (``parse_mask``)."""
    data = {name: value for name, value in payload.items() if value is not None}
    known = [wire for name in ScheduleRequest.__dataclass_fields__
             for wire in SCHEDULE_WIRE_NAMES.get(name, (name,))]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise FieldError(unknown[0], f"{unknown[0]} is not a field of a schedule request; "
                         f"valid: {', '.join(known)}")
    data["sequences"] = tuple(tuple(seq) for seq in data["sequences"])
    if isinstance(data.get("full_attention"), list):
        data["full_attention"] = tuple(data["full_attention"])
    if isinstance(data.get("model"), dict):
        data["model"] = ModelSpec.from_dict({k: v for k, v in data["model"].items()
                                             if v is not None})
    if "window" in data or "layers" in data:
        data["mask"] = parse_mask(window=data.pop("window", None),
                                  layers=data.pop("layers", None))
    return ScheduleRequest(**data)


def schedule_in_worker(payload: dict[str, Any]) -> str:
    """Run FCP on a validated /v1/schedule body (in a solver process): the result's
    canonical JSON; raises FieldError for bad input."""
    return canonical_json(schedule(build_request(payload)).to_dict())
