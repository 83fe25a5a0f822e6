"""Pure ASGI middleware: bearer token, body-size and body-time limits, per-request metrics.

Pure ASGI (not BaseHTTPMiddleware) because it runs on every request of a latency-bound
service: it adds a few microseconds, and long-polls keep seeing client disconnects.
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
    """401 without the bearer token (if one is set), 413 above PLANNER_MAX_BODY_BYTES, 408
    when the body takes longer than PLANNER_BODY_TIMEOUT_S to arrive, and request counts
    and latency for every answer."""

    def __init__(self, app: Any, service: PlannerService) -> None:
        self.app = app
        self.service = service
        token = service.settings.token_value()
        self.expected = f"Bearer {token}".encode() if token else None
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
            self._record(scope, status[0], time.perf_counter() - start)

    async def _handle(self, scope: Scope, receive: Any, send: Any) -> None:
        headers = dict(scope["headers"])
        if self.expected is not None and not is_public(scope["path"]):
            given = headers.get(b"authorization", b"")
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
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

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
