"""Local planning for the client: the embedded back end and the fallback plans."""

from __future__ import annotations

from typing import Any

from planner_service.client.backends import ServiceError
from planner_service.solvers.registry import Solved, timed_solve

FAST_STRATEGIES = frozenset({"flashcp", "llama3", "per_doc", "ring", "zigzag"})
"""Heuristics that plan a 128K sequence in milliseconds: safe to run as a fallback."""


def solve_dict(request: dict[str, Any]) -> Solved:
    """Validate a JSON request like the service does and solve it here.

    Raises ServiceError with code '422' and the field for invalid input.
    """
    from planner_service.service.schemas import FieldError, Limits, parse_plan_request

    limits = Limits(max_docs=10**7, max_cp_size=1024, max_tokens=2**31 - 1,
                    max_time_limit_s=3600.0, max_sequences=10**6)
    try:
        return timed_solve(parse_plan_request(request, limits))
    except FieldError as exc:
        raise ServiceError("422", str(exc), field=exc.field) from None


def fallback_request(request: dict[str, Any], fallback_strategy: str) -> dict[str, Any]:
    """The request a fallback plans: the same one if its strategy is fast, else
    ``fallback_strategy`` without strategy-specific options."""
    if request.get("strategy", "flashcp") in FAST_STRATEGIES:
        return request
    return {**request, "strategy": fallback_strategy, "options": {}}
