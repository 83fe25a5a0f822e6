"""Context-parallel sharding planner: pure planning core, solvers and service edges.

The planner never imports torch; plans are the only contract with ``worker_runtime``.
"""

from planner_service.core.model import ModelSpec
from planner_service.core.plan import Group, Plan, Shard
from planner_service.core.request import PlanRequest
from planner_service.core.validate import PlanError, validate_plan
from planner_service.solvers.registry import STRATEGIES, get_strategy, solve, timed_solve

__all__ = [
    "STRATEGIES",
    "Group",
    "ModelSpec",
    "Plan",
    "PlanError",
    "PlanRequest",
    "Shard",
    "get_strategy",
    "solve",
    "timed_solve",
    "validate_plan",
]
