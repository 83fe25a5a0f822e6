"""The tasks the solver processes run (module level: they are pickled by name).

Each returns plain data, so the event loop only moves strings and numbers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from planner_service.core.errors import FieldError
from planner_service.core.request import PlanRequest, debug_request
from planner_service.core.solved import SolvedPlan
from planner_service.solvers.registry import strategies_of_complexity, timed_solve

WARM_STRATEGIES = tuple(sorted(strategies_of_complexity("linear", "heuristic")))
"""Solved once on each worker at start: every strategy that answers in milliseconds."""
WARM_TIMEOUT_S = 120.0
"""Deadline of one worker's warm-up (imports and one small solve per fast strategy)."""


def solve_in_worker(request: PlanRequest, max_plan_bytes: int | None = None) -> SolvedPlan:
    """Solve and serialise in the worker, so the event loop only moves a string (the
    result carries the plan's JSON and headline metrics, not the parsed plan).

    Raises FieldError (``cp_size``) when the plan's JSON is above ``max_plan_bytes``.
    """
    solved = timed_solve(request, admitted=True)  # ops.PlannerService.request checked it
    assert solved.plan is not None
    m = solved.plan.metrics
    headline = {"imbalance": m.imbalance, "comm_tokens": m.comm_tokens,
                "full_comm_tokens": m.full_comm_tokens, "comm_saving": m.comm_saving,
                "est_step_ms": m.est_step_ms, "tokens_per_rank": m.tokens_per_rank}
    text = solved.plan_json
    if max_plan_bytes is not None and len(text) > max_plan_bytes:
        raise FieldError("cp_size", f"cp_size: the plan is {len(text)} bytes of JSON, above "
                         f"the limit {max_plan_bytes} (PLANNER_MAX_PLAN_BYTES); use fewer "
                         "ranks or documents, or a strategy that splits fewer documents")
    return solved.wire()._replace(headline=headline)


def warm_worker() -> int:
    """Import the solvers and run each fast strategy once, so first requests are fast."""
    for strategy in WARM_STRATEGIES:
        timed_solve(debug_request(strategy=strategy))
    return os.getpid()


def call_in_worker(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """Run ``fn(*args)`` and time it (used for FCP scheduling)."""
    import time

    start = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - start) * 1e3
