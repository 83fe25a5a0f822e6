"""Global batches in the job API: submit a batch of sequences now, fetch its FCP schedule
later (one batch ahead, as the FCP paper runs its scheduler).

The same contract as single plans (jobs.py, whose JobStore this reuses as a second
instance): ids of 1-128 characters, idempotent resubmission of the same content, a
Conflict for other content under a used batch id, finished schedules kept
``PLANNER_JOB_TTL_S``, and the same bounds on jobs, batches and bytes. The body is that
of ``POST /v1/schedule`` with the same limits; the stored answer is the schedule's
timing-free canonical JSON (schedule_wire.py), so a client's local fallback for the same
request is byte-identical.

HTTP: ``PUT/GET /v1/jobs/{job}/global-batches/{batch}``; gRPC: the ``GlobalBatches``
service of planner_service/proto/planner.proto. Both call :class:`GlobalJobs`.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import grpc
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from planner_service.core.errors import FieldError
from planner_service.core.solved import SolvedPlan
from planner_service.service.executor import solver_error
from planner_service.service.jobs import BatchEntry, JobStore, check_id
from planner_service.service.ops import PlannerService
from planner_service.service.schedule_wire import ScheduleJson, request_hash, schedule_payload
from planner_service.service.schemas import (
    ErrorOut,
    ScheduleRequestIn,
    check_json_depth,
    refuse_sequence_flood,
)

STRATEGY_LABEL = "fcp"
JSON = "application/json"
ERROR_CODES = (404, 409, 413, 422, 429, 503, 504)


class GlobalBatchStatusOut(BaseModel):
    job: str
    batch: str
    status: Literal["pending", "done", "failed"]
    request_hash: str
    schedule_id: str | None = None


RESPONSES: dict[int | str, dict[str, Any]] = {code: {"model": ErrorOut} for code in ERROR_CODES}
SCHEDULE_BODY = {"requestBody": {"required": True, "content": {JSON: {"schema": {
    "$ref": f"#/components/schemas/{ScheduleRequestIn.__name__}"}}}}}
"""The body is parsed by hand (see http_app.parse_body); http_app documents the model."""


class GlobalJobs:
    """The global-batch job store of one PlannerService (see :func:`global_jobs`)."""

    def __init__(self, svc: PlannerService) -> None:
        s = svc.settings
        self.svc = svc
        # The service's metrics, labelled store="global" (planner_jobs, planner_job_batches,
        # planner_job_bytes, planner_job_evictions_total), with the same per-client bounds.
        self.store = JobStore(
            ttl_s=s.job_ttl_s, max_jobs=s.max_jobs, max_batches_per_job=s.max_batches_per_job,
            memory_bytes=int(s.job_memory_mb * 2**20), deadline_s=s.request_timeout_s,
            metrics=svc.metrics, max_jobs_per_client=s.max_jobs_per_client,
            max_client_bytes=int(s.max_client_job_mb * 2**20), store="global")

    def submit(self, job: str, batch: str, body: ScheduleRequestIn, client: str = ""
               ) -> tuple[BatchEntry, bool]:
        """Start scheduling a global batch for ``client`` (its peer address); returns
        (entry, created). Raises FieldError, Conflict, Overloaded."""
        check_id(job, "job")
        check_id(batch, "batch")
        payload = self.svc.schedule_payload(body)
        key = request_hash(payload)
        return self.store.submit(job, batch, key, lambda: self._start(payload, client),
                                 client=client)

    def _start(self, payload: dict[str, Any], client: str) -> asyncio.Future[SolvedPlan]:
        raw = self.svc.executor.start_call(schedule_payload, payload, client=client)
        result: asyncio.Future[SolvedPlan] = asyncio.get_running_loop().create_future()

        def finish(f: asyncio.Future[tuple[ScheduleJson, float]]) -> None:
            if f.cancelled():
                result.cancel()
                return
            exc = f.exception()
            if exc is not None:
                result.set_exception(solver_error(exc))
                result.exception()  # mark retrieved: nobody may be waiting any more
                return
            done, ms = f.result()
            result.set_result(SolvedPlan(done.schedule_json, done.schedule_id, STRATEGY_LABEL,
                                         ms))

        raw.add_done_callback(finish)
        return result

    async def fetch(self, job: str, batch: str, wait_ms: int) -> BatchEntry:
        """Long-poll a global batch up to ``wait_ms`` (capped at PLANNER_MAX_WAIT_MS)."""
        if wait_ms < 0:
            raise FieldError("wait_ms", f"wait_ms must be >= 0, got {wait_ms}")
        wait_s = min(wait_ms, self.svc.settings.max_wait_ms) / 1e3
        return await self.store.fetch(job, batch, wait_s)


_STORES: weakref.WeakKeyDictionary[PlannerService, GlobalJobs] = weakref.WeakKeyDictionary()


def global_jobs(svc: PlannerService) -> GlobalJobs:
    """The one GlobalJobs of ``svc``, shared by its HTTP and gRPC edges."""
    store = _STORES.get(svc)
    if store is None:
        store = _STORES[svc] = GlobalJobs(svc)
    return store


def status_dict(entry: BatchEntry) -> dict[str, Any]:
    return {"job": entry.job, "batch": entry.batch, "status": entry.status,
            "request_hash": entry.key, "schedule_id": entry.plan_id}


def _parse(raw: bytes | str, svc: PlannerService) -> ScheduleRequestIn:
    """A schedule body from JSON text; raises FieldError (422 / INVALID_ARGUMENT)."""
    from pydantic import ValidationError

    from planner_service.service.schemas import validation_message

    check_json_depth(raw, svc.limits.max_json_depth, "body")  # first: names the nesting
    refuse_sequence_flood(raw, svc.limits.max_sequences)
    try:
        return ScheduleRequestIn.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        raise validation_message(exc) from None


# ---- HTTP -------------------------------------------------------------------------------

def add_routes(app: FastAPI, svc: PlannerService) -> None:
    """``PUT/GET /v1/jobs/{job}/global-batches/{batch}`` (errors through the app's
    handlers: 422, 404, 409, 429, 504)."""
    jobs = global_jobs(svc)

    @app.put("/v1/jobs/{job}/global-batches/{batch}", status_code=202, tags=["jobs"],
             response_model=GlobalBatchStatusOut, responses=RESPONSES,
             openapi_extra=SCHEDULE_BODY,
             summary="Submit a global batch for FCP scheduling; returns at once (idempotent)")
    async def submit_global(job: str, batch: str, request: Request) -> JSONResponse:
        body = _parse(await request.body(), svc)
        request.state.strategy = STRATEGY_LABEL
        entry, _ = jobs.submit(job, batch, body,
                               client=request.client.host if request.client else "")
        return JSONResponse(status_dict(entry), status_code=200 if entry.status == "done" else 202)

    @app.get("/v1/jobs/{job}/global-batches/{batch}", tags=["jobs"],
             responses={**RESPONSES, 202: {"model": GlobalBatchStatusOut,
                                           "description": "still pending"}},
             summary="The global batch's FCP schedule, long-polling up to wait_ms")
    async def fetch_global(job: str, batch: str,
                           wait_ms: Annotated[int, Query(ge=0, le=3_600_000)] = 0) -> Response:
        entry = await jobs.fetch(job, batch, wait_ms)
        if entry.status == "pending":
            return JSONResponse(status_dict(entry), status_code=202)
        result = entry.future.result()  # re-raises a failed schedule's error
        return Response(result.plan_json, media_type=JSON, headers={
            "Server-Timing": f"solve;dur={result.solve_ms:.3f}",
            "X-Schedule-Id": result.plan_id})


# ---- gRPC -------------------------------------------------------------------------------

StatusOf = Callable[[BaseException], tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]]


class GlobalBatchesServicer:
    """cpplanner.v1.GlobalBatches: the same operations as the HTTP routes.

    ``status_of`` and ``http_equivalent`` are grpc_server's error translation and status
    labels (passed in, so this module does not import the gRPC edge)."""

    def __init__(self, svc: PlannerService, pb2: Any, status_of: StatusOf,
                 http_equivalent: Mapping[str, str],
                 peer_of: Callable[[grpc.aio.ServicerContext], str] = lambda _: "") -> None:
        self.svc = svc
        self.peer_of = peer_of
        self.jobs = global_jobs(svc)
        self.pb2 = pb2
        self.status_of = status_of
        self.http_equivalent = http_equivalent

    async def _call(self, context: grpc.aio.ServicerContext, endpoint: str, fn: Any) -> Any:
        loop = asyncio.get_running_loop()
        start = loop.time()
        code = grpc.StatusCode.OK
        try:
            return await fn()
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            code, message, trailers = self.status_of(exc)
            if trailers:
                context.set_trailing_metadata(trailers)
            await context.abort(code, message)
        finally:
            m = self.svc.metrics
            m.requests.labels("grpc", endpoint, STRATEGY_LABEL,
                              self.http_equivalent.get(code.name, "500")).inc()
            m.request_seconds.labels("grpc", endpoint).observe(loop.time() - start)

    async def SubmitGlobalBatch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def run() -> Any:
            body = _parse(request.request_json, self.svc)
            entry, _ = self.jobs.submit(request.job, request.batch, body,
                                        client=self.peer_of(context))
            return self.pb2.GlobalBatchStatus(**{k: v or "" for k, v in
                                                 status_dict(entry).items()})
        return await self._call(context, "SubmitGlobalBatch", run)

    async def GetGlobalBatch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def run() -> Any:
            entry = await self.jobs.fetch(request.job, request.batch, request.wait_ms)
            if entry.status == "pending":
                return self.pb2.GetGlobalBatchReply(status="pending")
            result = entry.future.result()
            return self.pb2.GetGlobalBatchReply(
                status="done", schedule_json=result.plan_json.encode(),
                schedule_id=result.plan_id, solve_ms=result.solve_ms)
        return await self._call(context, "GetGlobalBatch", run)


