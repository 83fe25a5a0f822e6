"""The gRPC edge (grpc.aio): the same operations as HTTP on the same PlannerService.

Requests are turned into the HTTP JSON shape and validated by the same pydantic models,
so both edges accept and reject the same inputs with the same messages. Also serves the
standard health service (NOT_SERVING as soon as shutdown starts) and reflection.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import BaseModel, ValidationError

from planner_service.core.errors import FieldError
from planner_service.core.validate import PlanError
from planner_service.proto_build import load
from planner_service.service import global_jobs, grpc_wire
from planner_service.service.executor import DeadlineExceeded, Overloaded
from planner_service.service.jobs import Conflict, NotFound
from planner_service.service.middleware import bearer_token
from planner_service.service.ops import PlannerService
from planner_service.service.pool import WorkerDied
from planner_service.service.schemas import (
    CompareRequestIn,
    PlanRequestIn,
    ScheduleRequestIn,
    check_json_depth,
    refuse_sequence_flood,
    validation_message,
)
from planner_service.solvers.registry import STRATEGIES

SERVICE_NAME = "cpplanner.v1.Planner"
HTTP_EQUIVALENT = {
    "OK": "200", "INVALID_ARGUMENT": "422", "UNAUTHENTICATED": "401", "NOT_FOUND": "404",
    "ALREADY_EXISTS": "409", "RESOURCE_EXHAUSTED": "429", "UNIMPLEMENTED": "501",
    "INTERNAL": "500", "UNAVAILABLE": "503", "DEADLINE_EXCEEDED": "504", "CANCELLED": "499",
}
"""The ``status`` label of planner_requests_total is the HTTP answer the same outcome
gets over HTTP, so one alert rule covers both transports (``transport`` tells them apart)."""
HEALTH_PREFIX = "/grpc.health.v1.Health/"
MAX_DETAILS = 1000
"""Longest status message sent: it travels in the grpc-message trailer, and a client's
long input echoed there must not turn an INVALID_ARGUMENT into RESOURCE_EXHAUSTED."""
Code = grpc.StatusCode


class Malformed:
    """What the lenient deserializer gives for bytes that are not the expected message."""

    def __init__(self, message_type: str, error: str) -> None:
        self.message = (f"the request is not a valid {message_type} message: "
                        f"{error[:200]}")


def lenient(message_class: Any) -> Callable[[bytes], Any]:
    """A request deserializer that returns Malformed instead of raising (grpc would answer
    UNKNOWN); the handlers answer INVALID_ARGUMENT for it."""
    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            return Malformed(message_class.DESCRIPTOR.name, str(exc) or type(exc).__name__)
    return parse


def peer_address(peer: str) -> str:
    """A gRPC peer as the HTTP edge names the same client: its address without scheme and
    port ('ipv4:10.0.0.5:4242' -> '10.0.0.5', 'ipv6:[::1]:4242' -> '::1')."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer


def peer_host(context: grpc.aio.ServicerContext) -> str:
    return peer_address(context.peer() or "")


def metadata_value(text: str, limit: int = 128) -> str:
    """``text`` as a legal gRPC metadata value: printable ASCII (others as ``?``), cut to
    ``limit`` characters (a field name may quote a key of the caller's JSON)."""
    return "".join(c if " " <= c <= "~" else "?" for c in text[:limit])


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The gRPC status for a service exception (mirrors the HTTP handlers)."""
    if isinstance(exc, ValidationError):
        exc = validation_message(exc)
    if isinstance(exc, FieldError):
        return Code.INVALID_ARGUMENT, str(exc), (("field", metadata_value(exc.field)),)
    if isinstance(exc, Overloaded):
        return Code.RESOURCE_EXHAUSTED, str(exc), (
            ("retry-after", str(exc.retry_after_s)),
            ("grpc-retry-pushback-ms", str(exc.retry_after_s * 1000)))
    if isinstance(exc, DeadlineExceeded):
        return Code.DEADLINE_EXCEEDED, str(exc), ()
    if isinstance(exc, Conflict):
        return Code.ALREADY_EXISTS, str(exc), (("field", "batch"),)
    if isinstance(exc, NotFound):
        return Code.NOT_FOUND, str(exc), ()
    if isinstance(exc, WorkerDied):
        return Code.UNAVAILABLE, f"{exc}; retry", ()
    if isinstance(exc, PlanError):
        return Code.INTERNAL, f"the solver produced an invalid plan (a bug): {exc}", ()
    return Code.INTERNAL, f"{type(exc).__name__}: {exc}", ()


def clamp(message: str) -> str:
    return message if len(message) <= MAX_DETAILS else message[:MAX_DETAILS] + "..."


def _timeout(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else max(remaining, 1e-3)


class PlannerServicer:
    """Implements cpplanner.v1.Planner; each method converts types and calls the service."""

    def __init__(self, service: PlannerService, pb2: Any) -> None:
        self.svc = service
        self.pb2 = pb2

    async def _call(self, context: grpc.aio.ServicerContext, endpoint: str, strategy: str,
                    fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``fn``, translate its exception, count the outcome."""
        m = self.svc.metrics
        loop = asyncio.get_running_loop()
        start = loop.time()
        code = Code.OK
        try:
            fallbacks = dict(context.invocation_metadata() or ()).get("x-planner-fallbacks")
            self.svc.report_fallbacks(fallbacks if isinstance(fallbacks, str) else None)
            return await fn()
        except asyncio.CancelledError:
            code = Code.CANCELLED  # the caller cancelled or its deadline passed
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            code, message, trailers = status_of(exc)
            if trailers:
                context.set_trailing_metadata(trailers)
            await context.abort(code, clamp(message))
        finally:
            label = strategy if strategy in STRATEGIES else ("unknown" if strategy else "")
            m.requests.labels("grpc", endpoint, label, HTTP_EQUIVALENT.get(code.name, "500")).inc()
            m.request_seconds.labels("grpc", endpoint).observe(loop.time() - start)

    def _body(self, msg: Any, model: type[BaseModel] = PlanRequestIn, **extra: Any) -> Any:
        if msg.options_json:
            check_json_depth(msg.options_json, self.svc.limits.max_json_depth, "options_json")
        return model.model_validate({**grpc_wire.request_to_dict(msg), **extra})

    async def Plan(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def run() -> Any:
            result = await self.svc.plan(self._body(request), _timeout(context),
                                         peer_host(context))
            return grpc_wire.plan_reply(self.pb2, result)
        return await self._call(context, "Plan", request.strategy or "flashcp", run)

    async def Compare(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def run() -> Any:
            strategies = list(request.strategies) or None
            body = self._body(request.request, CompareRequestIn, strategies=strategies)
            result = await self.svc.compare(body, _timeout(context), peer_host(context))
            return self.pb2.CompareReply(
                plans=[grpc_wire.plan_reply(self.pb2, r) for r in result.results],
                errors=result.errors)
        return await self._call(context, "Compare", "", run)

    async def Schedule(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def run() -> Any:
            check_json_depth(request.request_json, self.svc.limits.max_json_depth,
                             "request_json")  # first: names the nesting
            refuse_sequence_flood(request.request_json, self.svc.limits.max_sequences)
            try:
                data = json.loads(request.request_json or "{}")
            except ValueError as exc:
                raise FieldError("request_json", f"request_json is not JSON: {exc}") from None
            text, ms = await self.svc.schedule(ScheduleRequestIn.model_validate(data),
                                               _timeout(context), peer_host(context))
            return self.pb2.ScheduleReply(result_json=text.encode(), solve_ms=ms)
        return await self._call(context, "Schedule", "", run)

    async def SubmitBatch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def run() -> Any:
            entry, _ = self.svc.submit(request.job, request.batch, self._body(request.request),
                                       client=peer_host(context))
            return self._submitted(entry)
        return await self._call(context, "SubmitBatch", request.request.strategy or "flashcp",
                                run)

    def _submitted(self, entry: Any) -> Any:
        return self.pb2.SubmitBatchReply(job=entry.job, batch=entry.batch, status=entry.status,
                                         request_hash=entry.key, plan_id=entry.plan_id or "")

    async def GetBatch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def run() -> Any:
            entry = await self.svc.fetch(request.job, request.batch, request.wait_ms)
            if entry.status == "pending":
                return self.pb2.GetBatchReply(status="pending")
            return self.pb2.GetBatchReply(
                status="done", plan=grpc_wire.plan_reply(self.pb2, entry.future.result()))
        return await self._call(context, "GetBatch", "", run)

    async def StreamPlans(self, requests: AsyncIterator[Any],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Submit each batch as it arrives; answer in arrival order as each is solved.

        At most PLANNER_MAX_STREAM_PENDING messages of this stream, and
        PLANNER_MAX_STREAMS_PENDING of all streams together, are unanswered at a time:
        beyond that the server stops reading, and HTTP/2 flow control holds the sender.
        """
        m = self.svc.metrics
        limit = self.svc.settings.max_stream_pending
        pending: asyncio.Queue[Any] = asyncio.Queue(maxsize=limit)
        slots = self.svc.stream_slots
        held = 0
        client = peer_host(context)
        loop = asyncio.get_running_loop()
        start = loop.time()
        code = Code.OK

        async def read() -> None:
            nonlocal held
            async for item in requests:
                m.stream_messages.labels("in").inc()
                if slots.locked():
                    m.stream_waits.inc()
                await slots.acquire()
                held += 1
                self.svc.streams_unanswered += 1
                if isinstance(item, Malformed):
                    await pending.put(("malformed", item, None))
                    return
                got: tuple[Any, Any, Exception | None]
                try:
                    entry, _ = self.svc.submit(item.job, item.batch, self._body(item.request),
                                               client=client)
                    got = (item, entry, None)
                except Exception as exc:  # noqa: BLE001 - reported in order, in-band
                    got = (item, None, exc)
                if pending.full():
                    m.stream_waits.inc()
                await pending.put(got)
            await pending.put(None)

        def answered() -> None:
            nonlocal held
            held -= 1
            self.svc.streams_unanswered -= 1
            slots.release()

        reader = asyncio.create_task(read())
        try:
            while (got := await pending.get()) is not None:
                item, entry, exc = got
                if item == "malformed":
                    code = Code.INVALID_ARGUMENT
                    await context.abort(code, entry.message)
                if entry is not None:
                    try:
                        result = await asyncio.shield(entry.future)
                        m.stream_messages.labels("out").inc()
                        yield self.pb2.StreamPlan(job=item.job, batch=item.batch,
                                                  plan=grpc_wire.plan_reply(self.pb2, result))
                        answered()
                        continue
                    except Exception as solve_exc:  # noqa: BLE001
                        exc = solve_exc
                status, message, _ = status_of(exc)
                m.stream_messages.labels("out").inc()
                yield self.pb2.StreamPlan(job=item.job, batch=item.batch,
                                          error_code=status.name, error=clamp(message))
                answered()
            await reader
        except asyncio.CancelledError:
            code = Code.CANCELLED
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. the stream broke
            code, message, _ = status_of(exc)
            await context.abort(code, clamp(message))
        finally:
            reader.cancel()
            for _ in range(held):  # messages read and never answered
                self.svc.streams_unanswered -= 1
                slots.release()
            held = 0
            m.requests.labels("grpc", "StreamPlans", "", HTTP_EQUIVALENT.get(code.name, "500")
                              ).inc()
            m.request_seconds.labels("grpc", "StreamPlans").observe(loop.time() - start)

    async def ListStrategies(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return self.pb2.StrategiesReply(strategies=[
            self.pb2.StrategyInfo(**s) for s in self.svc.strategies()])


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED without ``authorization: Bearer <token>``, except for health."""

    def __init__(self, token: str) -> None:
        self.expected = token.encode()

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        token = bearer_token(given.encode()) if isinstance(given, str) else None
        if token is not None and hmac.compare_digest(token, self.expected):
            return handler
        return _deny(handler)


def _deny(handler: Any) -> Any:
    message = "missing or wrong bearer token (metadata authorization: Bearer <PLANNER_TOKEN>)"

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(Code.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(Code.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    return grpc.stream_stream_rpc_method_handler(streaming, **kwargs)


class GrpcServer:
    """A started grpc.aio server with its health servicer; ``port`` is the bound port."""

    def __init__(self, server: grpc.aio.Server, health_servicer: Any, port: int) -> None:
        self.server = server
        self.health = health_servicer
        self.port = port

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)


def add_service(server: grpc.aio.Server, servicer: Any, pb2: Any, name: str) -> None:
    """Register the methods of service ``name`` like the generated add_*Servicer_to_server,
    but with lenient request deserializers: malformed bytes answer INVALID_ARGUMENT."""
    service = pb2.DESCRIPTOR.services_by_name[name]
    handlers = {}
    for method in service.methods:
        request_class = getattr(pb2, method.input_type.name)
        reply_class = getattr(pb2, method.output_type.name)
        behaviour = getattr(servicer, method.name)
        kwargs = {"request_deserializer": lenient(request_class),
                  "response_serializer": reply_class.SerializeToString}
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(behaviour, **kwargs)
        else:
            assert not method.client_streaming and not method.server_streaming, method.name
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _refuse_malformed(behaviour), **kwargs)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _refuse_malformed(behaviour: Callable[[Any, Any], Awaitable[Any]]
                      ) -> Callable[[Any, Any], Awaitable[Any]]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await context.abort(Code.INVALID_ARGUMENT, request.message)
        return await behaviour(request, context)
    return unary


async def start_grpc(service: PlannerService, host: str, port: int) -> GrpcServer:
    """Build, bind and start the gRPC server; raises RuntimeError if the port is taken."""
    stubs = load()
    settings = service.settings
    token = settings.token_value()
    limit = settings.max_body_bytes
    server = grpc.aio.server(
        interceptors=[TokenInterceptor(token)] if token else [],
        options=[("grpc.max_receive_message_length", limit),
                 ("grpc.max_send_message_length", max(limit, 64 * 2**20)),
                 ("grpc.so_reuseport", 0)])
    add_service(server, PlannerServicer(service, stubs.pb2), stubs.pb2, "Planner")
    add_service(server, global_jobs.GlobalBatchesServicer(service, stubs.pb2, status_of,
                                                          HTTP_EQUIVALENT, peer_host),
                stubs.pb2, "GlobalBatches")
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (stubs.pb2.DESCRIPTOR.services_by_name["Planner"].full_name,
             stubs.pb2.DESCRIPTOR.services_by_name["GlobalBatches"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"gRPC could not bind {host}:{port} (PLANNER_GRPC_PORT)")
    await server.start()
    result = GrpcServer(server, health_servicer, bound)
    await result.set_serving(service.ready)
    return result
