"""``planner serve``: HTTP (uvicorn) and gRPC in one process and one event loop.

SIGTERM/SIGINT: readiness turns false (``/readyz`` 503, gRPC health NOT_SERVING), both
servers stop accepting and in-flight requests and the solver pool share one deadline,
PLANNER_SHUTDOWN_GRACE_S after the signal; solver processes still busy then are killed, so
the process exits 0 within the grace plus about a second whatever its solvers do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from typing import NoReturn

import uvicorn

from planner_service.service.grpc_server import GrpcServer, start_grpc
from planner_service.service.header_deadline import protocol_with_header_timeout
from planner_service.service.http_app import create_app
from planner_service.service.ops import PlannerService
from planner_service.service.settings import Settings

log = logging.getLogger("planner_service.service")
STOP_SLACK_S = 2.0
"""The contract: the process exits within PLANNER_SHUTDOWN_GRACE_S + this of SIGTERM
(deploy manifests give the pod more; tests/test_deploy_manifests.py checks it)."""
BACKSTOP_S = 0.5
"""The HTTP and gRPC servers cancel what is left this long after the shared deadline."""
HEALTH_POLL_S = 0.5
"""How often gRPC health follows readiness (e.g. every solver stuck past a deadline)."""


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: this process handles signals once, for
    both servers (uvicorn would re-raise SIGTERM at exit and turn exit 0 into 143)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bound_port(server: uvicorn.Server) -> int:
    for s in server.servers:
        for sock in s.sockets:
            return int(sock.getsockname()[1])
    raise RuntimeError("uvicorn started without a listening socket")


async def serve(settings: Settings) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code (0 after a graceful stop)."""
    service = PlannerService(settings)
    await service.start()
    service.ready = False  # until both edges have answered once (see _warm_up)
    app = create_app(settings, service)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.http_port, log_level=settings.log_level,
        access_log=False, lifespan="on",
        timeout_graceful_shutdown=settings.shutdown_grace_s + BACKSTOP_S,  # type: ignore[arg-type]
        server_header=False, http=protocol_with_header_timeout(settings.header_timeout_s))
    http = _Uvicorn(config)
    grpc_server: GrpcServer | None = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    http_task = asyncio.create_task(http.serve())
    health: asyncio.Task[None] | None = None
    try:
        while not http.started:
            if http_task.done():  # e.g. the port is taken
                await http_task
                raise RuntimeError(f"HTTP could not start on {settings.host}:"
                                   f"{settings.http_port} (PLANNER_HTTP_PORT)")
            await asyncio.sleep(0.01)
        http_port = _bound_port(http)
        grpc_text = "gRPC disabled"
        if settings.grpc_enabled:
            grpc_server = await start_grpc(service, settings.host, settings.grpc_port)
            grpc_text = f"gRPC on {settings.host}:{grpc_server.port}"
        await _warm_up(settings, http_port, grpc_server.port if grpc_server else None)
        service.ready = True
        if grpc_server is not None:
            await grpc_server.set_serving(True)
        url = f"http://{settings.host}:{http_port}/"
        # One parseable line: tests and `make run` read the ports from it.
        print(f"planner serving: {url} (web page; API docs at {url}docs), {grpc_text}",
              flush=True)
        if grpc_server is not None:
            health = asyncio.create_task(_follow_readiness(service, grpc_server, stop))
        await stop.wait()
    finally:
        deadline = loop.time() + settings.shutdown_grace_s
        log.info("shutting down: readiness false, draining in-flight requests")
        service.ready = False
        http.should_exit = True
        # The solver pool drains to the shared deadline and then kills busy solvers, which
        # fails their requests (503 / UNAVAILABLE): both servers then finish before their
        # own, slightly later, backstops cancel anything.
        stops = [http_task, asyncio.ensure_future(service.close(deadline))]
        if grpc_server is not None:
            stops.append(asyncio.ensure_future(grpc_server.stop(
                settings.shutdown_grace_s + BACKSTOP_S)))
        await asyncio.gather(*stops, return_exceptions=True)
    if health is not None:
        await health
    log.info("stopped")
    return 0


async def _follow_readiness(service: PlannerService, grpc_server: GrpcServer,
                            stop: asyncio.Event) -> None:
    """Keep gRPC health in step with readiness until shutdown starts."""
    serving = True
    while not stop.is_set():
        now = service.is_ready
        if now != serving:
            serving = now
            await grpc_server.set_serving(now)
        try:
            await asyncio.wait_for(stop.wait(), HEALTH_POLL_S)
        except TimeoutError:
            pass


async def _warm_up(settings: Settings, http_port: int, grpc_port: int | None) -> None:
    """Send one plan request through each edge over loopback before reporting ready: the
    first request of a fresh process pays for lazy imports and schema builds (~0.5 s)."""
    import httpx

    from planner_service.core.request import debug_request

    host = "127.0.0.1" if settings.host in ("0.0.0.0", "", "::") else settings.host
    token = settings.token_value()
    body = {"doc_lengths": list(debug_request().doc_lengths), "cp_size": 4}
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with httpx.AsyncClient(base_url=f"http://{host}:{http_port}", headers=headers,
                                     timeout=30, trust_env=False) as client:
            await client.post("/v1/plan", json=body)
            await client.get("/v1/strategies")
        if grpc_port is not None:
            import grpc

            from planner_service.proto_build import load
            from planner_service.service.grpc_wire import dict_to_request

            stubs = load()
            metadata = (("authorization", f"Bearer {token}"),) if token else ()
            async with grpc.aio.insecure_channel(f"{host}:{grpc_port}") as channel:
                await stubs.pb2_grpc.PlannerStub(channel).Plan(
                    dict_to_request(stubs.pb2, body), metadata=metadata, timeout=30)
    except Exception as exc:  # noqa: BLE001 - warming is best effort
        log.warning("warm-up request failed: %s", exc)


def run(settings: Settings) -> NoReturn:
    """Blocking entry point of ``planner serve``; ends the process with the exit code.

    After a graceful stop nothing is left to clean up (sockets closed, solver processes
    gone, logs flushed), so the process ends at once: interpreter finalisation of the
    server's heap (numpy, OR-Tools, grpc) takes seconds of CPU on a busy machine, which
    would overrun the stop budget (PLANNER_SHUTDOWN_GRACE_S + 2 s) after the work is done.
    """
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the warm-up's own requests
    code = asyncio.run(serve(settings))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
