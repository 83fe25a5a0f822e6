"""The service's operations, shared by the HTTP routes and the gRPC servicer.

Both edges only convert wire types to calls on :class:`PlannerService` and its results
back; validation, limits, queueing, caching and the job store all live behind it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any, NamedTuple

from planner_service.core.errors import FieldError
from planner_service.core.request import PlanRequest
from planner_service.core.solved import SolvedPlan
from planner_service.service import fcp_bridge
from planner_service.service.cost_gate import (
    FAST,
    LANES,
    SLOW,
    Cost,
    check_plan_bytes,
    check_ring_floor,
    plan_bytes_bound,
    request_cost,
)
from planner_service.service.executor import DeadlineExceeded, Executor, Overloaded
from planner_service.service.jobs import BatchEntry, JobStore
from planner_service.service.metrics import ServiceMetrics
from planner_service.service.profiles import ProfileCatalog
from planner_service.service.schemas import (
    CompareRequestIn,
    Limits,
    PlanRequestIn,
    ScheduleRequestIn,
    check_schedule,
    check_shards,
    request_key,
    schedule_body,
    to_plan_request,
)
from planner_service.service.settings import Settings
from planner_service.solvers.registry import (
    checked_strategy,
    compared_options,
    get_strategy,
    strategy_names,
)

log = logging.getLogger("planner_service.service")

MAX_REPORTED_FALLBACKS = 1
"""Most fallbacks one request may add to planner_fallbacks_total{reason="client_reported"}:
a client cannot inflate the counter (and fire alerts) faster than it sends requests."""


class StrategyComparison(NamedTuple):
    results: list[SolvedPlan]
    """One per strategy that gave a plan, in the order asked for."""
    errors: dict[str, str]
    """strategy -> why it gave no plan."""


class PlannerService:
    """Settings, limits, metrics, the solver executor and the job store of one process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.limits = Limits.from_settings(settings)
        self.metrics = ServiceMetrics()
        self.executor = Executor(settings, self.metrics)
        self.profiles = ProfileCatalog(settings.fcp_profiles)
        self.jobs = JobStore(
            ttl_s=settings.job_ttl_s, max_jobs=settings.max_jobs,
            max_batches_per_job=settings.max_batches_per_job,
            memory_bytes=int(settings.job_memory_mb * 2**20),
            deadline_s=settings.request_timeout_s, metrics=self.metrics,
            max_jobs_per_client=settings.max_jobs_per_client,
            max_client_bytes=int(settings.max_client_job_mb * 2**20), store="plans")
        self.stream_slots = asyncio.Semaphore(settings.max_streams_pending)
        """Bounds the unanswered StreamPlans messages of all streams (grpc_server.py)."""
        self.streams_unanswered = 0
        self.ready = False
        """Lifecycle: true once the pool is warm, false again as soon as shutdown starts."""
        self.metrics.ready.set_function(lambda: 1.0 if self.is_ready else 0.0)
        self.metrics.solver_kills.set_function(lambda: float(self.executor.kills))
        self.metrics.streams_pending.set_function(lambda: float(self.streams_unanswered))
        for lane in LANES:
            self._lane_gauges(lane)

    def _lane_gauges(self, lane: str) -> None:
        """Bind the per-lane gauges of ``lane`` to the executor's figures."""
        ex = self.executor
        self.metrics.lane_depth.labels(lane).set_function(lambda: float(ex.lane_depth(lane)))
        self.metrics.lane_waiting.labels(lane).set_function(
            lambda: float(ex.lane_waiting(lane)))
        self.metrics.lane_age.labels(lane).set_function(lambda: ex.lane_age_s(lane))

    @property
    def is_ready(self) -> bool:
        """Readiness (/readyz, gRPC health): started, not draining, at least one solver
        process not stuck past a deadline (stuck ones are being replaced), and no fast-lane
        solve waiting longer than PLANNER_READY_MAX_QUEUE_AGE_S."""
        return (self.ready and self.executor.healthy
                and self.executor.lane_age_s(FAST) <= self.settings.ready_max_queue_age_s)

    def lanes(self) -> dict[str, dict[str, float]]:
        """Per lane: solves admitted, waiting, and the oldest one's wait (for /readyz)."""
        ex = self.executor
        return {lane: {"admitted": ex.lane_depth(lane), "capacity": ex.lane_capacity[lane],
                       "waiting": ex.lane_waiting(lane),
                       "oldest_wait_s": round(ex.lane_age_s(lane), 3)} for lane in LANES}

    async def start(self) -> None:
        await self.executor.start()
        self.ready = True

    async def close(self, deadline: float | None = None) -> None:
        """Drain and stop the solvers by loop time ``deadline`` (default: the grace)."""
        self.ready = False
        await self.executor.close(deadline)

    # ---- requests ---------------------------------------------------------------------

    def request(self, body: PlanRequestIn, strategy: str | None = None
                ) -> tuple[PlanRequest, str]:
        """Core request and its content hash, priced (service/cost_gate.py); raises
        FieldError."""
        try:
            request = self._with_profile(to_plan_request(body, self.limits, strategy=strategy))
            checked_strategy(request)
            self.check_cost(request)
        except FieldError as exc:
            if any(limit in str(exc) for limit in ("PLANNER_MAX_PLAN_BYTES", "PLANNER_MAX_SHARDS",
                                                   "MAX_RING_PAIRS")):
                self.metrics.rejected.labels("cost").inc()
            raise
        return request, request_key(request)

    def check_cost(self, request: PlanRequest) -> None:
        """Refuse a request whose plan would exceed PLANNER_MAX_PLAN_BYTES or the ring
        model's MAX_RING_PAIRS, before any solve (cost_gate.py); raises FieldError
        (``cp_size``, ``comm_mode``)."""
        cost = request_cost(request.strategy, request.doc_lengths, request.cp_size,
                            self.settings.fast_lane_max_work)
        check_plan_bytes(cost, self.settings.max_plan_bytes)
        comm_mode = request.comm_mode or get_strategy(request.strategy).comm_mode
        check_ring_floor(request.strategy, request.doc_lengths, request.cp_size, comm_mode)

    def _with_profile(self, request: PlanRequest) -> PlanRequest:
        """``options.profile`` resolved to a built-in name or a profile by value."""
        if "profile" not in request.options:
            return request
        options = dict(request.options)
        options["profile"] = self.profiles.resolve(options["profile"], "options.profile")
        return replace(request, options=options)

    async def plan(self, body: PlanRequestIn, timeout_s: float | None = None,
                   client: str = "") -> SolvedPlan:
        """Solve one request; raises FieldError, Overloaded, DeadlineExceeded, PlanError."""
        request, key = self.request(body)
        return await self.executor.solve(request, key, timeout_s, client)

    async def compare(self, body: CompareRequestIn, timeout_s: float | None = None,
                      client: str = "") -> StrategyComparison:
        """Plan the same input with several strategies concurrently.

        Each strategy gets the options it declares (registry.compared_options); an option
        no strategy declares is a FieldError. Overload of any one makes the whole call
        Overloaded (back-pressure).
        """
        names = body.strategies if body.strategies is not None else strategy_names()
        compared_options(names, body.options)
        base = self._with_profile(to_plan_request(body, self.limits, strategy=names[0]))
        deadline = self.executor.timeout_for(timeout_s, base)
        submitted: list[tuple[str, asyncio.Future[SolvedPlan]]] = []
        refused: dict[str, str] = {}
        try:
            for name, options in compared_options(names, base.options).items():
                request = replace(base, strategy=name, options=options)
                try:
                    self.check_cost(request)
                except FieldError as exc:  # this strategy's plan would be too large
                    self.metrics.rejected.labels("cost").inc()
                    refused[name] = str(exc)
                    continue
                key = request_key(request)
                submitted.append((key, self.executor.submit(request, key, deadline, client)))
            outcomes = await asyncio.gather(
                *(asyncio.wait_for(asyncio.shield(f), deadline) for _, f in submitted),
                return_exceptions=True)
        finally:  # every solve this call started stops with it (deadline or cancel)
            for key, future in submitted:
                self.executor.release(key, future)
        results: list[SolvedPlan] = []
        errors = dict(refused)
        solved = [name for name in names if name not in refused]
        for name, outcome in zip(solved, outcomes, strict=True):
            if isinstance(outcome, SolvedPlan):
                results.append(outcome)
            elif isinstance(outcome, (TimeoutError, DeadlineExceeded)):
                errors[name] = f"no plan within the deadline of {deadline:g} s"
            elif isinstance(outcome, FieldError):
                errors[name] = str(outcome)
            else:
                raise outcome
        return StrategyComparison(results, errors)

    async def schedule(self, body: ScheduleRequestIn, timeout_s: float | None = None,
                       client: str = "") -> tuple[str, float]:
        """FCP scheduling of a batch of sequences; returns (result JSON, solve ms)."""
        payload = self.schedule_payload(body)
        return await self.executor.call(fcp_bridge.schedule_in_worker, payload,
                                        timeout_s=timeout_s, client=client)

    def schedule_payload(self, body: ScheduleRequestIn) -> dict[str, Any]:
        """The scheduler's input for a /v1/schedule body within this service's limits;
        raises FieldError (also used by the job API for global batches)."""
        if len(body.sequences) > self.limits.max_sequences:
            raise FieldError("sequences", f"sequences has {len(body.sequences)} entries, above "
                             f"the limit {self.limits.max_sequences} (PLANNER_MAX_SEQUENCES)")
        for i, seq in enumerate(body.sequences):
            if not seq:
                raise FieldError(f"sequences.{i}", f"sequences.{i} must not be empty")
            if len(seq) > self.limits.max_docs:
                raise FieldError(f"sequences.{i}", f"sequences.{i} has {len(seq)} documents, "
                                 f"above the limit {self.limits.max_docs} (PLANNER_MAX_DOCS)")
            if sum(seq) > self.limits.max_tokens:
                raise FieldError(f"sequences.{i}", f"sequences.{i} sums to {sum(seq)} tokens, "
                                 f"above the limit {self.limits.max_tokens} (PLANNER_MAX_TOKENS)")
        if body.num_ranks > self.limits.max_cp_size:
            raise FieldError("num_ranks", f"num_ranks must be in [1, {self.limits.max_cp_size}] "
                             f"(PLANNER_MAX_CP_SIZE), got {body.num_ranks}")
        try:
            check_shards(sum(len(seq) for seq in body.sequences), body.num_ranks,
                         self.limits, "num_ranks")
            strategy = body.strategy if isinstance(body.strategy, str) else "flashcp"
            bounds = [plan_bytes_bound(strategy, seq, body.num_ranks) for seq in body.sequences]
            if all(b is not None for b in bounds):
                total = sum(b for b in bounds if b is not None)
                check_plan_bytes(Cost(SLOW, 0, total), self.settings.max_plan_bytes,
                                 "num_ranks")
        except FieldError:
            self.metrics.rejected.labels("cost").inc()
            raise
        payload = schedule_body(body)
        if "profile" in payload:
            payload["profile"] = self.profiles.resolve(payload["profile"], "profile")
        check_schedule(payload)
        return payload

    # ---- jobs -------------------------------------------------------------------------

    def submit(self, job: str, batch: str, body: PlanRequestIn, client: str = ""
               ) -> tuple[BatchEntry, bool]:
        """Start planning a batch for ``client`` (its peer address: the per-client bounds
        of the job store and the slow lane); returns (entry, created). Raises FieldError,
        Conflict, Overloaded."""
        request, key = self.request(body)
        return self.jobs.submit(
            job, batch, key, lambda: self.executor.submit(request, key, client=client),
            client=client)

    async def fetch(self, job: str, batch: str, wait_ms: int) -> BatchEntry:
        """Long-poll a batch up to ``wait_ms`` (capped at PLANNER_MAX_WAIT_MS)."""
        if wait_ms < 0:
            raise FieldError("wait_ms", f"wait_ms must be >= 0, got {wait_ms}")
        wait_s = min(wait_ms, self.settings.max_wait_ms) / 1e3
        return await self.jobs.fetch(job, batch, wait_s)

    # ---- misc -------------------------------------------------------------------------

    @staticmethod
    def strategies() -> list[dict[str, Any]]:
        return [{"name": s.name, "description": s.description, "comm_mode": s.comm_mode,
                 "options": dict(s.options)} for s in (get_strategy(n) for n in strategy_names())]

    def report_fallbacks(self, value: str | None) -> None:
        """Count fallbacks a client reports (header X-Planner-Fallbacks), at most
        MAX_REPORTED_FALLBACKS per request and labelled client_reported; ignores junk."""
        if not value or len(value) > 12:
            return
        try:
            count = int(value)
        except ValueError:
            return
        if count > 0:
            self.metrics.fallbacks.labels("client_reported").inc(
                min(count, MAX_REPORTED_FALLBACKS))


__all__ = ["DeadlineExceeded", "Overloaded", "StrategyComparison", "PlannerService"]


def sample_lengths(dataset: str, context_length: int, seed: int) -> list[int]:
    """One packed sequence of ``dataset`` (for the web page); raises FieldError."""
    from planner_service.data import FAMILIES, SHARED_FILES, make_source, pack_sequences

    allowed = sorted(set(SHARED_FILES) | set(FAMILIES))
    if dataset not in allowed:  # never file:PATH: the server's files are not for callers
        raise FieldError("dataset", f"dataset must be one of {', '.join(allowed)}, "
                         f"got {dataset!r}")
    if not 1 <= context_length <= 4 * 2**20:
        raise FieldError("context_length", f"context_length must be in [1, {4 * 2**20}], "
                         f"got {context_length}")
    if not 0 <= seed <= 2**32:
        raise FieldError("seed", f"seed must be in [0, {2**32}], got {seed}")
    try:
        if dataset not in _SOURCES:
            _SOURCES[dataset] = make_source(dataset)  # a lengths file is read once
        src = _SOURCES[dataset]
    except ValueError as exc:
        raise FieldError("dataset", str(exc)) from None
    return pack_sequences(src, context_length=context_length, num_sequences=1, seed=seed)[0]


_SOURCES: dict[str, Any] = {}
