"""Local planning for the client: the embedded back end and the fallback plans."""

from __future__ import annotations

import time
from typing import Any

from planner_service.client.base import SCHEDULE_LABEL, ServiceError
from planner_service.core.errors import FieldError
from planner_service.core.solved import SolvedPlan
from planner_service.solvers.registry import strategies_of_complexity, timed_solve

FAST_STRATEGIES = strategies_of_complexity("linear", "heuristic")
"""Heuristics that plan a small request in milliseconds: fallbacks on small inputs."""
BOUNDED_STRATEGIES = strategies_of_complexity("linear")
"""Strategies whose cost is linear in documents + ranks by construction (fixed chunks):
a fallback on any input."""
BOUNDED_FALLBACK = "llama3"
"""The fallback for an input too large for a heuristic (llama3 balances causal work)."""
SMALL_TOKEN_RANKS = 2**21
"""A heuristic fallback runs only if tokens x ranks is at most this (128K tokens on 16
ranks) ..."""
SMALL_DOC_RANKS = 2**16
"""... and documents x ranks at most this; larger inputs get BOUNDED_FALLBACK."""


def solve_dict(request: dict[str, Any]) -> SolvedPlan:
    """Validate a JSON request like the service does and solve it here.

    Raises ServiceError with code '422' and the field for invalid input (found by the
    edge's checks or by the strategy's own, as the service would answer it).
    """
    from planner_service.service.schemas import Limits, parse_plan_request

    try:
        return timed_solve(parse_plan_request(request, Limits.library()))
    except FieldError as exc:
        raise ServiceError("422", str(exc), field=exc.field) from None


def solve_schedule_dict(request: dict[str, Any]) -> SolvedPlan:
    """Validate a global batch (the body of ``PUT /v1/jobs/{job}/global-batches/{batch}``)
    like the service does and schedule it here: the schedule's JSON and schedule_id in the
    result's plan_json and plan_id, byte-identical to the service's (FCP is deterministic
    and the stored form has no timings).

    Raises ServiceError with code '422' and the field for invalid input.
    """
    from pydantic import ValidationError

    from planner_service.service.schedule_wire import schedule_payload
    from planner_service.service.schemas import (
        ScheduleRequestIn,
        schedule_body,
        validation_message,
    )

    try:
        payload = schedule_body(ScheduleRequestIn.model_validate(request))
        start = time.perf_counter()
        done = schedule_payload(payload)
    except ValidationError as exc:
        err = validation_message(exc)
        raise ServiceError("422", str(err), field=err.field) from None
    except ValueError as exc:  # as the service answers it (executor.solver_error)
        field = exc.field if isinstance(exc, FieldError) else "body"
        raise ServiceError("422", str(exc), field=field) from None
    return SolvedPlan(done.schedule_json, done.schedule_id, SCHEDULE_LABEL,
                      (time.perf_counter() - start) * 1e3)


def prepare() -> None:
    """Import what a local plan needs and make one bounded plan, so that the plan
    ``get`` may have to make at its deadline costs only its own (linear) time."""
    solve_dict(bounded_request({"doc_lengths": [4096, 1024, 8], "cp_size": 4}))


def is_small(request: dict[str, Any]) -> bool:
    """Whether a request is small enough for a heuristic fallback (SMALL_* bounds)."""
    lengths = request.get("doc_lengths") or ()
    ranks = request.get("cp_size")
    if not isinstance(ranks, int) or not isinstance(lengths, list):
        return True  # invalid: validation answers before any solver runs
    tokens = sum(x for x in lengths if isinstance(x, int))
    return tokens * ranks <= SMALL_TOKEN_RANKS and len(lengths) * ranks <= SMALL_DOC_RANKS


def fallback_request(request: dict[str, Any], fallback_strategy: str) -> dict[str, Any]:
    """The request a fallback plans, chosen from the request alone (so every rank makes the
    same choice): the same one if its strategy is bounded, or fast and the input small;
    else ``fallback_strategy`` (without strategy-specific options) on the same terms; else
    BOUNDED_FALLBACK, linear-time by construction."""
    strategy = request.get("strategy", "flashcp")
    small = is_small(request)
    if strategy in BOUNDED_STRATEGIES or (strategy in FAST_STRATEGIES and small):
        return request
    if fallback_strategy in BOUNDED_STRATEGIES or (fallback_strategy in FAST_STRATEGIES
                                                   and small):
        return {**request, "strategy": fallback_strategy, "options": {}}
    return bounded_request(request)


def bounded_request(request: dict[str, Any]) -> dict[str, Any]:
    """The request planned with BOUNDED_FALLBACK: the plan a client can always afford."""
    return {**request, "strategy": BOUNDED_FALLBACK, "options": {}}
