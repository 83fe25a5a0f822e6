"""Context-parallel sharding planner: pure planning core, solvers and service edges.

The planner never imports torch; plans are the only contract with ``worker_runtime``.
The names below load on first use (PEP 562), so importing the contract
(``planner_service.core.plan``) or the validator does not load the solvers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planner_service.core.errors import FieldError
    from planner_service.core.model import ModelSpec
    from planner_service.core.plan import Group, Plan, Shard
    from planner_service.core.request import PlanRequest
    from planner_service.core.validate import PlanError, validate_plan
    from planner_service.solvers.registry import STRATEGIES, get_strategy, solve, timed_solve

_EXPORTS = {
    "FieldError": "planner_service.core.errors",
    "ModelSpec": "planner_service.core.model",
    "Group": "planner_service.core.plan",
    "Plan": "planner_service.core.plan",
    "Shard": "planner_service.core.plan",
    "PlanRequest": "planner_service.core.request",
    "PlanError": "planner_service.core.validate",
    "validate_plan": "planner_service.core.validate",
    "STRATEGIES": "planner_service.solvers.registry",
    "get_strategy": "planner_service.solvers.registry",
    "solve": "planner_service.solvers.registry",
    "timed_solve": "planner_service.solvers.registry",
}

__all__ = [
    "STRATEGIES",
    "FieldError",
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


def __getattr__(name: str) -> Any:
    """Import an exported name's module on first use (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'planner_service' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
