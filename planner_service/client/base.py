"""What every back end of the client shares: the result type, the error, the protocol.

A module of its own so that the back ends (backends.py, grpc_backend.py) and the local
planner (local.py) import it, and not one another: no import circle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from planner_service.core.solved import SolvedPlan

SCHEDULE_LABEL = "fcp"
"""The ``strategy`` of a global batch's schedule (the service's label for FCP)."""

ServiceResult = SolvedPlan
"""A back end's answer: the core's SolvedPlan (the name the client's API has exported)."""


class ServiceComparison(NamedTuple):
    results: list[tuple[str, SolvedPlan]]
    """(strategy, result) in the order asked for."""
    errors: dict[str, str]


class ServiceError(ValueError):
    """The service answered an error or could not be reached.

    ``code`` is the HTTP status (as text), the gRPC status name, or ``unavailable`` when
    no answer came; ``field`` names the offending request field for invalid input.
    """

    def __init__(self, code: str, message: str, *, field: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s

    @property
    def invalid_input(self) -> bool:
        return self.code in ("422", "INVALID_ARGUMENT")


class Backend(Protocol):
    """What PlanClient and ScheduleClient need from a planner (all methods are blocking
    and thread-safe): single plans and their job batches, and global batches."""

    name: str

    def warm(self) -> None: ...

    def plan(self, request: dict[str, Any], timeout_s: float, *, fallbacks: int = 0
             ) -> SolvedPlan: ...

    def compare(self, request: dict[str, Any], strategies: Sequence[str] | None,
                timeout_s: float) -> ServiceComparison: ...

    def submit(self, job: str, batch: str, request: dict[str, Any], timeout_s: float, *,
               fallbacks: int = 0) -> None: ...

    def fetch(self, job: str, batch: str, wait_s: float, timeout_s: float
              ) -> SolvedPlan | None: ...

    def submit_global(self, job: str, batch: str, request: dict[str, Any], timeout_s: float
                      ) -> None: ...

    def fetch_global(self, job: str, batch: str, wait_s: float, timeout_s: float
                     ) -> SolvedPlan | None:
        """A global batch's FCP schedule (its JSON and schedule_id in the result's
        plan_json and plan_id), None while pending."""

    def close(self) -> None: ...
