"""Client of the planner service: one interface over HTTP, gRPC and in-process planning.

``PlanClient(url, cp_size=8).prefetch(step + 1, lengths)`` then ``.get(step + 1)``: the
service's plan when it is ready, else a deterministic local fallback within the deadline.
``remote_plan`` / ``remote_compare`` are one-shot calls for the CLI's ``--url``.
"""

from planner_service.client.backends import (
    Backend,
    EmbeddedBackend,
    HttpBackend,
    ServiceError,
    ServiceResult,
    make_backend,
)
from planner_service.client.prefetch import ClientPlan, ClientStats, PlanClient
from planner_service.client.remote import (
    RemoteComparison,
    RemotePlan,
    remote_compare,
    remote_plan,
)

__all__ = [
    "Backend",
    "ClientPlan",
    "ClientStats",
    "EmbeddedBackend",
    "HttpBackend",
    "PlanClient",
    "RemoteComparison",
    "RemotePlan",
    "ServiceError",
    "ServiceResult",
    "make_backend",
    "remote_compare",
    "remote_plan",
]
