"""One-shot calls for the CLI's ``--url``: plan or compare on a running service."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from planner_service.client.backends import make_backend
from planner_service.core.plan import Plan
from planner_service.core.request import PlanRequest
from planner_service.core.solved import SolvedPlan

RemotePlan = SolvedPlan
"""A service's plan: the core's SolvedPlan with the parsed plan (the name the client's API
has exported)."""


class RemoteComparison(NamedTuple):
    results: list[SolvedPlan]
    errors: dict[str, str]
    """strategy -> why it gave no plan."""


def as_body(request: dict[str, Any] | PlanRequest) -> dict[str, Any]:
    """The JSON body for a request given as a dict or as a core PlanRequest."""
    if isinstance(request, PlanRequest):
        from planner_service.service.schemas import request_dict

        return request_dict(request)
    return request


def remote_plan(url: str, request: dict[str, Any] | PlanRequest, *, token: str | None = None,
                timeout_s: float = 60.0) -> SolvedPlan:
    """Ask the service at ``url`` for the plan of ``request`` (a /v1/plan body or a
    PlanRequest).

    ``url``: ``http://host:port`` or ``grpc://host:port``; ``token`` defaults to
    $PLANNER_TOKEN. Raises ServiceError (a ValueError: ``.code``, ``.field``) when the
    service rejects the request or cannot be reached.
    """
    backend = make_backend(url, token=token)
    try:
        r = backend.plan(as_body(request), timeout_s)
    finally:
        backend.close()
    plan = Plan.from_json(r.plan_json)
    return r._replace(strategy=plan.strategy, plan=plan)


def remote_compare(url: str, request: dict[str, Any] | PlanRequest,
                   strategies: Sequence[str] | None = None, *, token: str | None = None,
                   timeout_s: float = 120.0) -> RemoteComparison:
    """Every strategy (or ``strategies``) on the same input, planned by the service.

    ``request`` is a /v1/plan body or a PlanRequest; its strategy is ignored. Raises
    ServiceError.
    """
    backend = make_backend(url, token=token)
    try:
        out = backend.compare(as_body(request), strategies, timeout_s)
    finally:
        backend.close()
    results = [r._replace(strategy=name, plan=Plan.from_json(r.plan_json))
               for name, r in out.results]
    return RemoteComparison(results, out.errors)
