"""PlanClient: plan batch i+1 while step i trains, and never stall training.

``prefetch(batch_id, doc_lengths)`` returns at once; a background thread asks the
service (job API: submit, then long-poll). ``get(batch_id, timeout)`` returns the
service's plan when it is there, and otherwise a deterministic plan computed locally,
within ``timeout``, marked ``fallback=True``. The state machine (degraded mode, logging
and counting fallbacks, reporting them to the service with the next request) is
ahead.AheadClient, which ScheduleClient shares.

``get(timeout)`` returns within the timeout plus the cost of a linear-time plan, always:
fallbacks run on daemon threads that can be abandoned, and a batch with no plan at the
deadline gets ``llama3`` (linear in documents + ranks by construction) computed there.
Which strategy a fallback uses depends on the request only (local.fallback_request), so
ranks that fall back on the same batch plan alike.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Sequence
from typing import Any, NamedTuple

from planner_service.client.ahead import FALLBACKS, AheadClient, Batch, in_background
from planner_service.client.base import Backend
from planner_service.client.local import (
    bounded_request,
    fallback_request,
    prepare,
    solve_dict,
)
from planner_service.core.plan import Plan
from planner_service.core.request import debug_request
from planner_service.core.solved import SolvedPlan

_job_ids = itertools.count()


def _warm_solvers() -> None:
    solve_dict({"doc_lengths": list(debug_request().doc_lengths), "cp_size": 4})


class ClientPlan(NamedTuple):
    """A plan the client hands out: the solve's result and where it came from."""

    solved: SolvedPlan
    """The plan (parsed), its canonical JSON (byte-identical to the service's answer for
    the same request) and its solve time."""
    source: str
    """'http', 'grpc', 'embedded' or 'local' (a fallback)."""
    fallback: bool
    reason: str | None
    """Why a fallback was used: 'late', 'unavailable' or 'error' (None otherwise)."""

    @property
    def plan(self) -> Plan:
        return self.solved.parsed()

    @property
    def plan_json(self) -> str:
        return self.solved.plan_json

    @property
    def plan_id(self) -> str:
        return self.solved.plan_id

    @property
    def solve_ms(self) -> float:
        return self.solved.solve_ms


class ClientStats(NamedTuple):
    service_plans: int
    fallbacks: int
    fallbacks_by_reason: dict[str, int]
    degraded: bool
    last_error: str | None


class PlanClient(AheadClient[ClientPlan]):
    """One-batch-ahead planning over HTTP, gRPC or in-process, with local fallback.

    Args:
        backend: a URL (``http://127.0.0.1:8000``, ``grpc://127.0.0.1:50051``,
            ``embedded``) or a Backend.
        cp_size: ranks N of every request.
        strategy: the strategy asked of the service.
        request_defaults: merged into every request (e.g. ``context_length``, ``model``).
        job: the job id on the service (default: host, process id and a counter).
        timeout_s: ``get``'s default timeout.
        request_timeout_s: the deadline of one call to the service.
        prefetch_timeout_s: how long a batch's long-poll may go on.
        fallback_strategy: the fallback for a strategy too slow to run locally (see
            local.fallback_request).
        max_batches: prefetched batches kept; the oldest are dropped beyond it.
        network_threads: threads asking the service.
        token: the bearer token (default $PLANNER_TOKEN).

    Safe to pickle into dataloader workers: threads and connections are re-created in
    each process.
    """

    KEEP = (*AheadClient.KEEP, "cp_size", "strategy", "request_defaults", "fallback_strategy")

    def __init__(self, backend: Backend | str, *, cp_size: int, strategy: str = "flashcp",
                 request_defaults: dict[str, Any] | None = None, job: str | None = None,
                 timeout_s: float = 1.0, request_timeout_s: float = 5.0,
                 prefetch_timeout_s: float = 30.0, fallback_strategy: str = "flashcp",
                 max_batches: int = 64, network_threads: int = 2,
                 token: str | None = None) -> None:
        self.cp_size = cp_size
        self.strategy = strategy
        self.request_defaults = dict(request_defaults or {})
        self.fallback_strategy = fallback_strategy
        super().__init__(backend, job=job or f"{socket.gethostname()}-{os.getpid()}-"
                         f"{next(_job_ids)}", token=token, timeout_s=timeout_s,
                         request_timeout_s=request_timeout_s,
                         prefetch_timeout_s=prefetch_timeout_s, max_batches=max_batches,
                         network_threads=network_threads)

    @property
    def backend(self) -> Backend:
        return self.channel  # type: ignore[return-value]

    # ---- public API -------------------------------------------------------------------

    def request(self, doc_lengths: Sequence[int], **overrides: Any) -> dict[str, Any]:
        """The JSON request this client sends for ``doc_lengths``."""
        return {"cp_size": self.cp_size, "strategy": self.strategy, **self.request_defaults,
                **overrides, "doc_lengths": [int(x) for x in doc_lengths]}

    def prefetch(self, batch_id: Any, doc_lengths: Sequence[int], **overrides: Any) -> None:
        """Start planning a batch in the background; returns at once. A batch id already
        prefetched is ignored (keep ids unique per job, e.g. the step number)."""
        self._prefetch(str(batch_id), lambda: self.request(doc_lengths, **overrides))

    def get(self, batch_id: Any, timeout: float | None = None,
            doc_lengths: Sequence[int] | None = None) -> ClientPlan:
        """The plan of a prefetched batch within ``timeout`` seconds (default: the
        client's ``timeout_s``); a local fallback if the service has not answered.

        Pass ``doc_lengths`` to plan a batch that was not prefetched. Raises KeyError for
        an unknown batch, ServiceError (code '422') for input no planner accepts.
        """
        key = str(batch_id)
        if key not in self._batches:
            if doc_lengths is None:
                raise KeyError(f"batch {key!r} was not prefetched; pass doc_lengths")
            self.prefetch(key, doc_lengths)
        return self._get(key, timeout)

    def plan(self, doc_lengths: Sequence[int], timeout: float | None = None,
             **overrides: Any) -> ClientPlan:
        """Plan one sequence now (prefetch + get)."""
        key = f"now-{next(_job_ids)}"
        self.prefetch(key, doc_lengths, **overrides)
        return self.get(key, timeout)

    @property
    def stats(self) -> ClientStats:
        with self._cond:
            return ClientStats(self._service_answers, sum(self._fallbacks.values()),
                               dict(self._fallbacks), self._degraded, self._last_error)

    # ---- the state machine's hooks ----------------------------------------------------

    def _prepare(self) -> None:
        # Import and warm the solvers now: the first batch then costs what later ones do
        # (a cold process spends ~0.3 s on imports and a first solve). The bounded plan is
        # ready before the constructor returns: get() may need it.
        prepare()
        in_background(_warm_solvers)

    def _answer(self, result: SolvedPlan) -> ClientPlan:
        return ClientPlan(result._replace(plan=Plan.from_json(result.plan_json)),
                          self.channel.name, False, None)

    def _fallback(self, request: dict[str, Any], reason: str) -> ClientPlan:
        return self._solve_local(fallback_request(request, self.fallback_strategy), reason)

    def _at_deadline(self, batch: Batch[ClientPlan]) -> ClientPlan:
        """No plan at the deadline: the linear-time one, computed here."""
        return self._solve_local(bounded_request(batch.request), "late")

    def _solve_local(self, request: dict[str, Any], reason: str) -> ClientPlan:
        return ClientPlan(solve_dict(request), "local", True, reason)

    def _outage_warning(self, reason: str, error: str | None) -> str:
        return (f"planner service {'is late' if reason == 'late' else 'failed'} "
                f"({error or reason}): using local {self.fallback_strategy} plans until it "
                "answers again")


__all__ = ["FALLBACKS", "ClientPlan", "ClientStats", "PlanClient"]
