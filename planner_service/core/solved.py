"""SolvedPlan: a plan and the wall time of the solve that made it.

The one result type of a solve in every layer: the registry's ``timed_solve``, the solver
process's answer, the service's executor and cache, the wire (gRPC ``PlanReply`` has the
same fields) and the client's back ends. Solve time is kept beside the plan, never in it,
so the same request gives the same plan bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from planner_service.core.plan import Plan


class SolvedPlan(NamedTuple):
    plan_json: str
    """Canonical JSON of the plan (Plan.to_json())."""
    plan_id: str
    strategy: str
    """The strategy that made it (a schedule's label for FCP global batches)."""
    solve_ms: float
    """Wall time of the solve that made this plan (also for cache hits)."""
    cached: bool = False
    """Served from the service's content-hash cache."""
    headline: Mapping[str, Any] | None = None
    """A few plan metrics (PlanMetrics of the proto) without parsing plan_json; None where
    the layer that made this result did not compute them."""
    plan: Plan | None = None
    """The parsed plan where this process holds it (a local solve); None where only the
    JSON travelled (a solver process's or the service's answer)."""

    @classmethod
    def of(cls, plan: Plan, solve_ms: float) -> SolvedPlan:
        """The result of a local solve: the plan, its JSON and its solve time."""
        return cls(plan.to_json(), plan.plan_id, plan.strategy, solve_ms, plan=plan)

    def parsed(self) -> Plan:
        """The plan: the one held, else parsed from ``plan_json`` (O(plan size))."""
        return self.plan if self.plan is not None else Plan.from_json(self.plan_json)

    def wire(self) -> SolvedPlan:
        """This result without the parsed plan: what crosses a process boundary or sits
        in a cache (only the JSON's bytes are counted there)."""
        return self._replace(plan=None)
