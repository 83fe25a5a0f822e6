"""A global batch's schedule as deterministic bytes: what the job API stores and serves,
and what the client's local fallback reproduces for the same request.

FcpResult.to_dict() carries wall-clock times (``solve_ms``, ``plan_ms``); they are left
out here so that the same request gives the same bytes and the same ``schedule_id``
whoever computes it (the service or a training rank that falls back).
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

from planner_service.core.plan import canonical_json

TIMING_FIELDS = ("solve_ms", "plan_ms")


class ScheduleJson(NamedTuple):
    schedule_json: str
    """Canonical JSON of the schedule without timing, with ``schedule_id`` inside."""
    schedule_id: str
    """sha256 of the canonical JSON of everything else."""
    solve_ms: float
    """Wall time of scheduling and plan building (not part of the bytes)."""


def schedule_json(result: Any) -> ScheduleJson:
    """Canonical, timing-free JSON of an FcpResult (or of its ``to_dict()``)."""
    data = dict(result.to_dict() if hasattr(result, "to_dict") else result)
    solve_ms = float(data.get("solve_ms", 0.0)) + float(data.get("plan_ms", 0.0))
    for name in (*TIMING_FIELDS, "schedule_id"):
        data.pop(name, None)
    schedule_id = hashlib.sha256(canonical_json(data).encode()).hexdigest()
    return ScheduleJson(canonical_json({**data, "schedule_id": schedule_id}), schedule_id,
                        solve_ms)


def request_hash(payload: dict[str, Any]) -> str:
    """Content hash of a schedule request body (the job API's idempotency key)."""
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


def schedule_payload(payload: dict[str, Any]) -> ScheduleJson:
    """Schedule a validated ``/v1/schedule`` body here (a service worker or a client's
    fallback); raises ValueError naming a bad field."""
    from planner_service.service.fcp_bridge import build_request
    from planner_service.solvers.fcp_schedule import schedule

    return schedule_json(schedule(build_request(payload)))
