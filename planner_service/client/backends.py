"""Ways to reach a planner: HTTP, gRPC (see grpc_backend.py) or in-process (embedded).

Every back end speaks the JSON request shape of ``POST /v1/plan`` and returns the plan's
canonical JSON, so the same request gives the same bytes whichever back end answers.
Connections are made lazily per process id: a back end copied into a forked or spawned
dataloader worker opens its own connection there.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

import httpx

from planner_service.client.base import (
    SCHEDULE_LABEL,
    Backend,
    ServiceComparison,
    ServiceError,
    ServiceResult,
)
from planner_service.core.solved import SolvedPlan

USER_AGENT = "cp-planner-client/1"


class HttpBackend:
    """The HTTP API through one keep-alive httpx client per process."""

    name = "http"

    def __init__(self, url: str, *, token: str | None = None, connect_timeout_s: float = 1.0
                 ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self._client: httpx.Client | None = None
        self._pid = -1
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "token": self.token, "connect_timeout_s": self.connect_timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def _http(self) -> httpx.Client:
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                headers = {"User-Agent": USER_AGENT}
                if self.token:
                    headers["Authorization"] = f"Bearer {self.token}"
                # Never reuse a parent's sockets after fork: make a new client.
                # verify only matters for https; for http it skips loading the CA bundle.
                self._client = httpx.Client(base_url=self.url, headers=headers,
                                            trust_env=False,
                                            verify=self.url.startswith("https://"))
                self._pid = os.getpid()
            return self._client

    def _send(self, method: str, path: str, timeout_s: float, *, body: Any = None,
              headers: dict[str, str] | None = None,
              params: dict[str, Any] | None = None) -> httpx.Response:
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, self.connect_timeout_s))
        try:
            response = self._http().request(
                method, path, content=None if body is None else json.dumps(body),
                headers={"Content-Type": "application/json", **(headers or {})},
                params=params, timeout=timeout)
        except httpx.HTTPError as exc:
            raise ServiceError("unavailable", f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise http_error(response)
        return response

    def warm(self) -> None:
        """Open the connection now (best effort), not on the first plan."""
        try:
            self._http().get("/healthz", timeout=self.connect_timeout_s)
        except httpx.HTTPError:
            pass

    def plan(self, request: dict[str, Any], timeout_s: float, *, fallbacks: int = 0
             ) -> SolvedPlan:
        r = self._send("POST", "/v1/plan", timeout_s, body=request,
                       headers=_deadline_headers(timeout_s, fallbacks))
        return _http_result(r, request)

    def compare(self, request: dict[str, Any], strategies: Sequence[str] | None,
                timeout_s: float) -> ServiceComparison:
        body = {k: v for k, v in request.items() if k != "strategy"}
        if strategies is not None:
            body["strategies"] = list(strategies)
        data = self._send("POST", "/v1/compare", timeout_s, body=body,
                          headers=_deadline_headers(timeout_s, 0)).json()
        from planner_service.core.plan import canonical_json

        results = [(e["strategy"], SolvedPlan(canonical_json(e["plan"]), e["plan"]["plan_id"],
                                              e["strategy"], float(e["solve_ms"]),
                                              bool(e["cached"])))
                   for e in data["results"]]
        return ServiceComparison(results, dict(data["errors"]))

    def submit(self, job: str, batch: str, request: dict[str, Any], timeout_s: float, *,
               fallbacks: int = 0) -> None:
        self._send("PUT", f"/v1/jobs/{job}/batches/{batch}", timeout_s, body=request,
                   headers=_deadline_headers(None, fallbacks))

    def fetch(self, job: str, batch: str, wait_s: float, timeout_s: float
              ) -> SolvedPlan | None:
        r = self._send("GET", f"/v1/jobs/{job}/batches/{batch}", timeout_s + wait_s,
                       params={"wait_ms": int(wait_s * 1e3)})
        return None if r.status_code == 202 else _http_result(r, request=None)

    def submit_global(self, job: str, batch: str, request: dict[str, Any], timeout_s: float
                      ) -> None:
        self._send("PUT", f"/v1/jobs/{job}/global-batches/{batch}", timeout_s, body=request)

    def fetch_global(self, job: str, batch: str, wait_s: float, timeout_s: float
                     ) -> SolvedPlan | None:
        r = self._send("GET", f"/v1/jobs/{job}/global-batches/{batch}", timeout_s + wait_s,
                       params={"wait_ms": int(wait_s * 1e3)})
        if r.status_code == 202:
            return None
        return SolvedPlan(r.text, r.headers.get("x-schedule-id", ""), SCHEDULE_LABEL,
                          _server_timing_ms(r))

    def close(self) -> None:
        with self._lock:
            if self._client is not None and self._pid == os.getpid():
                self._client.close()
            self._client = None


def _deadline_headers(timeout_s: float | None, fallbacks: int) -> dict[str, str]:
    headers = {}
    if timeout_s is not None:
        headers["X-Planner-Deadline-Ms"] = str(max(1, int(timeout_s * 1e3)))
    if fallbacks:
        headers["X-Planner-Fallbacks"] = str(fallbacks)
    return headers


def _http_result(r: httpx.Response, request: dict[str, Any] | None) -> SolvedPlan:
    """A plan answer: the body, X-Plan-Id, Server-Timing and X-Cache (the strategy is the
    request's where known: the answer's headers do not name it)."""
    strategy = str((request or {}).get("strategy", ""))
    return SolvedPlan(r.text, r.headers.get("x-plan-id", ""), strategy, _server_timing_ms(r),
                      r.headers.get("x-cache") == "hit")


def _server_timing_ms(r: httpx.Response) -> float:
    """The solve time of an answer's ``Server-Timing`` header (NaN without one)."""
    timing = r.headers.get("server-timing", "")
    return float(timing.split("dur=")[1]) if "dur=" in timing else float("nan")


def http_error(r: httpx.Response) -> ServiceError:
    """The ServiceError of an HTTP error answer: its status, ``detail``, ``field`` and
    ``Retry-After``."""
    try:
        data = r.json()
        message, field = str(data.get("detail")), data.get("field")
    except ValueError:
        message, field = r.text[:500], None
    retry = r.headers.get("retry-after")
    return ServiceError(str(r.status_code), message, field=field,
                        retry_after_s=float(retry) if retry and retry.isdigit() else None)


class EmbeddedBackend:
    """Plans in this process (no service): the same validation and the same solvers."""

    name = "embedded"

    def __init__(self) -> None:
        self._jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def warm(self) -> None:
        pass

    def plan(self, request: dict[str, Any], timeout_s: float, *, fallbacks: int = 0
             ) -> SolvedPlan:
        from planner_service.client.local import solve_dict  # heavy: solvers, on first use

        return solve_dict(request).wire()

    def compare(self, request: dict[str, Any], strategies: Sequence[str] | None,
                timeout_s: float) -> ServiceComparison:
        from planner_service.core.errors import FieldError
        from planner_service.solvers.registry import compared_options, strategy_names

        names = list(strategies) if strategies is not None else strategy_names()
        options = request.get("options", {})
        try:
            if not isinstance(options, dict):
                raise FieldError("options", f"options must be a JSON object, got {options!r}")
            shares = compared_options(names, options)
        except FieldError as exc:
            raise ServiceError("422", str(exc), field=exc.field) from None
        results, errors = [], {}
        for name, share in shares.items():
            try:
                results.append((name, self.plan({**request, "strategy": name,
                                                 "options": share}, timeout_s)))
            except ServiceError as exc:
                errors[name] = exc.message
        return ServiceComparison(results, errors)

    def submit(self, job: str, batch: str, request: dict[str, Any], timeout_s: float, *,
               fallbacks: int = 0) -> None:
        with self._lock:
            self._jobs[(job, batch)] = request

    def fetch(self, job: str, batch: str, wait_s: float, timeout_s: float
              ) -> SolvedPlan | None:
        return self.plan(self._take(job, batch), timeout_s)

    def submit_global(self, job: str, batch: str, request: dict[str, Any], timeout_s: float
                      ) -> None:
        with self._lock:
            self._jobs[(job, f"global/{batch}")] = request

    def fetch_global(self, job: str, batch: str, wait_s: float, timeout_s: float
                     ) -> SolvedPlan | None:
        from planner_service.client.local import solve_schedule_dict  # heavy: FCP

        return solve_schedule_dict(self._take(job, f"global/{batch}"))

    def _take(self, job: str, key: str) -> dict[str, Any]:
        with self._lock:
            request = self._jobs.pop((job, key), None)
        if request is None:
            raise ServiceError("404", f"batch {key.removeprefix('global/')!r} of job {job!r} "
                               "is unknown")
        return request

    def close(self) -> None:
        with self._lock:
            self._jobs.clear()


__all__ = ["Backend", "EmbeddedBackend", "HttpBackend", "ServiceComparison", "ServiceError",
           "ServiceResult", "make_backend"]


def make_backend(url: str, *, token: str | None = None) -> Backend:
    """``http://host:port``, ``https://...``, ``grpc://host:port`` or ``embedded``.

    ``token`` defaults to $PLANNER_TOKEN. Raises ValueError for another scheme.
    """
    token = token if token is not None else os.environ.get("PLANNER_TOKEN") or None
    if url == "embedded":
        return EmbeddedBackend()
    if url.startswith(("http://", "https://")):
        return HttpBackend(url, token=token)
    if url.startswith("grpc://"):
        from planner_service.client.grpc_backend import GrpcBackend

        return GrpcBackend(url.removeprefix("grpc://"), token=token)
    raise ValueError(f"url must start with http://, https:// or grpc://, or be 'embedded'; "
                     f"got {url!r}")
