"""Pure ASGI middleware: bearer token, content type, body-size and body-time limits, client
disconnects, per-request metrics.

Pure ASGI (not BaseHTTPMiddleware) because it runs on every request of a latency-bound
service: it adds a few microseconds, and long-polls keep seeing client disconnects.

A request with a body is answered by a task that is cancelled when the client disconnects
before the answer (status 499 in the metrics): its solve then stops (executor.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import TYPE_CHECKING, Any

from planner_service.solvers.registry import STRATEGIES

if TYPE_CHECKING:
    from planner_service.service.ops import PlannerService

Scope = dict[str, Any]
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/", "/favicon.ico"})
"""No token needed: health, and the static page (a browser cannot send a bearer header
when it navigates; the page holds no data and asks for the token before calling the API)."""
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
JSON_TYPE = b"application/json"
CLIENT_CLOSED = 499
"""The status recorded for a request whose client went away before the answer (nginx's)."""
CLOSED_KEY = "planner.client_closed"
"""Scope key the middleware sets when it cancelled a request for that reason."""


def bearer_token(header: bytes) -> bytes | None:
    """The credentials of an ``Authorization: Bearer <token>`` header; the scheme is
    case-insensitive (RFC 7235). None for another scheme or a malformed header."""
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return None
    return token.strip()


def is_json(content_type: bytes | None) -> bool:
    """Whether a Content-Type header is application/json (parameters such as charset allowed)."""
    if content_type is None:
        return False
    return content_type.split(b";", 1)[0].strip().lower() == JSON_TYPE


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith("/static/")


async def _reply(send: Any, status: int, detail: str, field: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"detail": detail, "field": field}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class AuthAndLimits:
    """401 without the bearer token (if one is set), 415 for a body that is not
    application/json (a web page cannot send one without a CORS preflight), 413 above
    PLANNER_MAX_BODY_BYTES, 408 when the body takes longer than PLANNER_BODY_TIMEOUT_S to
    arrive, cancellation on disconnect, and request counts and latency for every answer."""

    def __init__(self, app: Any, service: PlannerService) -> None:
        self.app = app
        self.service = service
        token = service.settings.token_value()
        self.expected = token.encode() if token else None
        self.max_body = service.settings.max_body_bytes
        self.body_timeout_s = service.settings.body_timeout_s

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_status(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, send_status)
        finally:
            if scope.get(CLOSED_KEY):
                status[0] = CLIENT_CLOSED
            self._record(scope, status[0], time.perf_counter() - start)

    async def _handle(self, scope: Scope, receive: Any, send: Any) -> None:
        headers = dict(scope["headers"])
        if self.expected is not None and not is_public(scope["path"]):
            given = bearer_token(headers.get(b"authorization", b"")) or b""
            if not hmac.compare_digest(given, self.expected):
                await _reply(send, 401, "missing or wrong bearer token (Authorization: Bearer "
                             "<PLANNER_TOKEN>)", "authorization",
                             [(b"www-authenticate", b"Bearer")])
                return
        if scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
            await self._too_large(send)
            return
        if not is_json(headers.get(b"content-type")):
            await _reply(send, 415, "request bodies must be Content-Type: application/json",
                         "content-type")
            return
        # Read the body here, bounded in size and time, so chunked uploads cannot exceed
        # the limit either and a trickling client cannot hold the connection.
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read_body(receive)
        except TimeoutError:
            await _reply(send, 408, f"request body not complete within {self.body_timeout_s:g} "
                         "s (PLANNER_BODY_TIMEOUT_S)", "body", [(b"connection", b"close")])
            return
        if body is None:
            return  # client went away
        if len(body) > self.max_body:
            await self._too_large(send)
            return
        await self._answer(scope, receive, send, body)

    async def _answer(self, scope: Scope, receive: Any, send: Any, body: bytes) -> None:
        """Run the app on the read body; cancel it if the client disconnects first."""
        gone = asyncio.Event()
        answered = False
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal answered
            if message["type"] == "http.response.body" and not message.get("more_body"):
                answered = True
            await send(message)

        async def watch() -> None:
            # After the body, the server's receive() returns only when the client went
            # away (or the response is complete).
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        app_task = asyncio.ensure_future(self.app(scope, replay, tracked_send))
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({app_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not app_task.done() and not answered:
                app_task.cancel()  # the client is gone: stop its work
            try:
                await app_task
            except asyncio.CancelledError:
                if not gone.is_set() or not app_task.cancelled():
                    raise
                scope[CLOSED_KEY] = True  # nobody to answer: end quietly
        finally:
            watcher.cancel()
            if not app_task.done():
                app_task.cancel()

    async def _read_body(self, receive: Any) -> bytes | None:
        """The whole body (None if the client went away), read no further than one chunk
        past ``max_body`` bytes."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            chunks.append(chunk)
            if size > self.max_body or not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send: Any) -> None:
        await _reply(send, 413, f"request body is larger than {self.max_body} bytes "
                     "(PLANNER_MAX_BODY_BYTES)", "body")

    def _record(self, scope: Scope, status: int, seconds: float) -> None:
        route = scope.get("route")
        endpoint = getattr(route, "path", None) or (
            "/static" if scope["path"].startswith("/static/") else "unmatched")
        state = scope.get("state") or {}
        strategy = str(state.get("strategy", ""))[:32] if isinstance(state, dict) else ""
        if strategy and strategy not in STRATEGIES:
            strategy = "unknown"  # bounded label cardinality
        m = self.service.metrics
        m.requests.labels("http", endpoint, strategy, str(status)).inc()
        m.request_seconds.labels("http", endpoint).observe(seconds)
