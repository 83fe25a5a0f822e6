"""The HTTP edge: a FastAPI app whose routes only convert types and call PlannerService.

Plans are returned as their canonical JSON bytes (identical to gRPC's ``plan_json``);
solve time travels in the ``Server-Timing`` header, never in the plan.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ValidationError

from planner_service.core.errors import FieldError
from planner_service.core.plan import canonical_json
from planner_service.core.solved import SolvedPlan
from planner_service.core.validate import PlanError
from planner_service.service import global_jobs
from planner_service.service.executor import DeadlineExceeded, Overloaded
from planner_service.service.jobs import BatchEntry, Conflict, NotFound
from planner_service.service.middleware import AuthAndLimits
from planner_service.service.ops import PlannerService, sample_lengths
from planner_service.service.pool import WorkerDied
from planner_service.service.schemas import (
    CompareOut,
    CompareRequestIn,
    ErrorOut,
    JobStatusOut,
    PlanOut,
    PlanRequestIn,
    ScheduleRequestIn,
    StrategyOut,
    check_json_depth,
    refuse_sequence_flood,
)
from planner_service.service.settings import Settings, load_settings

WEB_DIR = Path(__file__).resolve().parents[1] / "web"
JSON = "application/json"
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (401, 404, 409, 413, 415, 422, 429, 503, 504)}
DeadlineHeader = Annotated[int | None, Header(alias="X-Planner-Deadline-Ms", ge=1,
                                              le=3_600_000)]
FallbackHeader = Annotated[str | None, Header(alias="X-Planner-Fallbacks")]


MAX_DETAIL_CHARS = 500
"""Error messages are cut to this many characters (they may quote the input): with the
field and the first errors, an error body stays under 2 KB."""
MAX_FIELD_CHARS = 128
MAX_LISTED_ERRORS = 3


def clip(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` cut to ``limit`` characters, marked with an ellipsis where cut."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def client_of(request: Request) -> str:
    """The peer address of an HTTP request (the per-client bounds' key)."""
    return request.client.host if request.client else ""


def error(status: int, message: str, field: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": clip(message),
                         "field": None if field is None else clip(field, MAX_FIELD_CHARS)},
                        status_code=status, headers=headers)


def plan_response(result: SolvedPlan, status: int = 200) -> Response:
    return Response(result.plan_json, status_code=status, media_type=JSON, headers={
        "Server-Timing": f"solve;dur={result.solve_ms:.3f}",
        "X-Plan-Id": result.plan_id,
        "X-Cache": "hit" if result.cached else "miss",
    })


def job_status(entry: BatchEntry) -> dict[str, Any]:
    return {"job": entry.job, "batch": entry.batch, "status": entry.status,
            "request_hash": entry.key, "plan_id": entry.plan_id}


def _seconds(ms: int | None) -> float | None:
    return None if ms is None else ms / 1e3


def create_app(settings: Settings | None = None, service: PlannerService | None = None
               ) -> FastAPI:
    """The app; it starts and stops ``service`` itself unless one is passed in."""
    settings = settings or load_settings()
    owned = service is None
    svc = service or PlannerService(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        if owned:
            await svc.start()
        yield
        if owned:
            await svc.close()

    app = FastAPI(
        title="Context-parallel planner", version="1", lifespan=lifespan,
        description="Shard packed sequences over context-parallel ranks (FlashCP, baselines, "
        "FCP). Plans are canonical JSON, byte-identical over HTTP and gRPC.")
    app.state.service = svc
    app.add_middleware(AuthAndLimits, service=svc)
    _add_error_handlers(app)

    @app.post("/v1/plan", response_model=PlanOut, responses=ERRORS, tags=["plans"],
              summary="Plan one packed sequence with one strategy",
              openapi_extra=body_doc(PlanRequestIn))
    async def plan(request: Request, deadline_ms: DeadlineHeader = None,
                   fallbacks: FallbackHeader = None) -> Response:
        body = await parse_body(request, PlanRequestIn, svc.limits.max_json_depth)
        request.state.strategy = body.strategy
        svc.report_fallbacks(fallbacks)
        return plan_response(await svc.plan(body, _seconds(deadline_ms), client_of(request)))

    @app.post("/v1/compare", response_model=CompareOut, responses=ERRORS, tags=["plans"],
              summary="Plan the same input with every strategy (or those listed)",
              openapi_extra=body_doc(CompareRequestIn))
    async def compare(request: Request, deadline_ms: DeadlineHeader = None) -> Response:
        body = await parse_body(request, CompareRequestIn, svc.limits.max_json_depth)
        result = await svc.compare(body, _seconds(deadline_ms), client_of(request))
        # Splice the plans' canonical bytes in unchanged.
        entries = ",".join(
            f'{{"cached":{"true" if r.cached else "false"},"plan":{r.plan_json},'
            f'"solve_ms":{canonical_json(r.solve_ms)},"strategy":{canonical_json(r.strategy)}}}'
            for r in result.results)
        text = f'{{"errors":{canonical_json(result.errors)},"results":[{entries}]}}'
        return Response(text, media_type=JSON)

    @app.post("/v1/schedule", responses=ERRORS, tags=["plans"],
              summary="FCP: schedule a batch of sequences into CP groups",
              openapi_extra=body_doc(ScheduleRequestIn))
    async def schedule(request: Request, deadline_ms: DeadlineHeader = None) -> Response:
        raw = await request.body()
        check_json_depth(raw, svc.limits.max_json_depth)  # first: names the nesting
        refuse_sequence_flood(raw, svc.limits.max_sequences)
        body = await parse_body(request, ScheduleRequestIn, svc.limits.max_json_depth)
        text, ms = await svc.schedule(body, _seconds(deadline_ms), client_of(request))
        return Response(text, media_type=JSON, headers={"Server-Timing": f"solve;dur={ms:.3f}"})

    @app.get("/v1/strategies", response_model=list[StrategyOut], tags=["plans"])
    async def strategies() -> list[dict[str, Any]]:
        return svc.strategies()

    @app.put("/v1/jobs/{job}/batches/{batch}", response_model=JobStatusOut, status_code=202,
             responses=ERRORS, tags=["jobs"],
             summary="Submit a batch for planning; returns at once (idempotent)",
             openapi_extra=body_doc(PlanRequestIn))
    async def submit(job: str, batch: str, request: Request,
                     fallbacks: FallbackHeader = None) -> JSONResponse:
        body = await parse_body(request, PlanRequestIn, svc.limits.max_json_depth)
        request.state.strategy = body.strategy
        svc.report_fallbacks(fallbacks)
        entry, created = svc.submit(job, batch, body, client=client_of(request))
        code = 200 if entry.status == "done" else 202
        return JSONResponse(job_status(entry), status_code=code)

    @app.get("/v1/jobs/{job}/batches/{batch}", response_model=PlanOut, tags=["jobs"],
             responses={**ERRORS, 202: {"model": JobStatusOut, "description": "still pending"}},
             summary="The batch's plan, long-polling up to wait_ms")
    async def fetch(job: str, batch: str,
                    wait_ms: Annotated[int, Query(ge=0, le=3_600_000)] = 0) -> Response:
        entry = await svc.fetch(job, batch, wait_ms)
        if entry.status == "pending":
            return JSONResponse(job_status(entry), status_code=202)
        return plan_response(entry.future.result())  # re-raises a failed solve's error

    @app.get("/v1/sample", tags=["web"], responses={422: ERRORS[422]},
             summary="Doc lengths of one packed sequence of a data set (for the web page)")
    async def sample(dataset: str = "wlbllm",
                     context_length: Annotated[int, Query(ge=1, le=4 * 2**20)] = 131072,
                     seed: Annotated[int, Query(ge=0, le=2**32)] = 0) -> dict[str, Any]:
        lengths = sample_lengths(dataset, context_length, seed)
        return {"dataset": dataset, "context_length": context_length, "seed": seed,
                "doc_lengths": lengths}

    @app.get("/healthz", tags=["ops"], summary="Liveness")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"], summary="Readiness: pool warm, not shutting down, not "
             "every solver process stuck past a deadline, and the fast lane not backed up; "
             "the body gives each lane's admitted and waiting solves")
    async def readyz() -> JSONResponse:
        if svc.is_ready:
            return JSONResponse({"status": "ready", "lanes": svc.lanes()})
        return JSONResponse({"status": "not ready", "lanes": svc.lanes()}, status_code=503)

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics")
    async def metrics() -> Response:
        svc.metrics.cache_entries.set(svc.executor.cache_entries)
        svc.metrics.cache_bytes.set(svc.executor.cache_bytes)
        return Response(svc.metrics.render(), media_type=svc.metrics.content_type)

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html", media_type="text/html")

    global_jobs.add_routes(app, svc)
    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")
    _document_bodies(app, (PlanRequestIn, CompareRequestIn, ScheduleRequestIn))
    return app


Model = TypeVar("Model", bound=BaseModel)


async def parse_body(request: Request, model: type[Model], max_depth: int) -> Model:
    """Validate the raw JSON body with pydantic-core in one pass, after refusing nesting
    deeper than ``max_depth``.

    Routes read bodies this way rather than through FastAPI's body parameters: that path
    decodes JSON into Python objects first and costs more per request than the rest of
    the edge together. Raises RequestValidationError (answered 422) like FastAPI would.
    """
    body = await request.body()
    check_json_depth(body, max_depth)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI requestBody of a route that parses ``model`` itself (see parse_body)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {JSON: {"schema": ref}}}}


def _document_bodies(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """Add the request models (and their nested models) to the OpenAPI components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, sub in js.pop("$defs", {}).items():
                    components.setdefault(name, sub)
                components[model.__name__] = js
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def _add_error_handlers(app: FastAPI) -> None:
    """Translate service exceptions to HTTP answers (the only place that knows codes)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request"}
        loc = clip(".".join(str(p) for p in first["loc"][1:]) or str(first["loc"][0]),
                   MAX_FIELD_CHARS)
        body = {"detail": clip(f"{loc}: {first['msg']}"), "field": loc,
                "errors": [{"field": clip(".".join(str(p) for p in e["loc"][1:]),
                                          MAX_FIELD_CHARS), "msg": clip(str(e["msg"]), 200)}
                           for e in errors[:MAX_LISTED_ERRORS]]}
        return JSONResponse(body, status_code=422)

    @app.exception_handler(FieldError)
    async def field_error(_: Request, exc: FieldError) -> JSONResponse:
        return error(422, str(exc), exc.field)

    @app.exception_handler(Overloaded)
    async def overloaded(_: Request, exc: Overloaded) -> JSONResponse:
        return error(429, str(exc), headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(DeadlineExceeded)
    async def late(_: Request, exc: DeadlineExceeded) -> JSONResponse:
        return error(504, str(exc))

    @app.exception_handler(Conflict)
    async def conflict(_: Request, exc: Conflict) -> JSONResponse:
        return error(409, str(exc), "batch")

    @app.exception_handler(NotFound)
    async def not_found(_: Request, exc: NotFound) -> JSONResponse:
        return error(404, str(exc), "batch")

    @app.exception_handler(WorkerDied)
    async def worker_died(_: Request, exc: WorkerDied) -> JSONResponse:
        return error(503, f"{exc}; retry", headers={"Retry-After": "1"})

    @app.exception_handler(PlanError)
    async def bug(_: Request, exc: PlanError) -> JSONResponse:
        return error(500, f"the solver produced an invalid plan (a bug): {exc}")
