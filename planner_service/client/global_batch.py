"""ScheduleClient: FCP-schedule global batch k+1 while batch k trains, never stalling.

``prefetch(batch_id, sequences)`` returns at once; a background thread submits the global
batch to the service's job API (``PUT /v1/jobs/{job}/global-batches/{batch}`` or gRPC
``GlobalBatches``) and long-polls its schedule. ``get(batch_id, timeout)`` returns the
service's schedule when it is there, else the same schedule computed here (FCP is
deterministic and the stored form has no timings, so the bytes and ``schedule_id`` are
those the service would give), marked ``fallback=True``. While the service fails the
client is degraded: each prefetched batch's fallback starts at once on a local thread.

The single-sequence counterpart is PlanClient (prefetch.py); this module shares its
back-end URLs, token and error type, and the fallback counter.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from typing import Any, NamedTuple, Protocol

import httpx

from planner_service.client.backends import USER_AGENT, ServiceError, http_error
from planner_service.client.prefetch import FALLBACKS
from planner_service.core.errors import FieldError
from planner_service.core.plan import Plan

log = logging.getLogger("planner_service.client")
_ids = itertools.count()


class GlobalSchedule(NamedTuple):
    schedule_json: str
    """Canonical, timing-free JSON (service/schedule_wire.py); identical from any source."""
    schedule_id: str
    source: str
    """'http', 'grpc', 'embedded' or 'local' (a fallback)."""
    fallback: bool
    reason: str | None
    """Why a fallback was used: 'late', 'unavailable' or 'error' (None otherwise)."""
    solve_ms: float

    @property
    def schedule(self) -> dict[str, Any]:
        return json.loads(self.schedule_json)  # type: ignore[no-any-return]

    def plans(self) -> list[Plan]:
        """One plan per micro-batch (over all ranks, one group per CP group), in order."""
        return [Plan.from_dict(mb["plan"]) for mb in self.schedule["micro_batches"]
                if mb["plan"] is not None]


class Transport(Protocol):
    name: str

    def submit(self, job: str, batch: str, request: dict[str, Any], timeout_s: float) -> None: ...

    def fetch(self, job: str, batch: str, wait_s: float, timeout_s: float
              ) -> tuple[str, str, float] | None: ...

    def close(self) -> None: ...


def solve_local(request: dict[str, Any]) -> tuple[str, str, float]:
    """(schedule JSON, schedule_id, ms) computed here; ServiceError '422' for bad input."""
    from pydantic import ValidationError

    from planner_service.service.schedule_wire import schedule_payload
    from planner_service.service.schemas import ScheduleRequestIn, validation_message

    try:
        payload = ScheduleRequestIn.model_validate(request).model_dump()
        start = time.perf_counter()
        done = schedule_payload(payload)
    except ValidationError as exc:
        err = validation_message(exc)
        raise ServiceError("422", str(err), field=err.field) from None
    except ValueError as exc:  # as the service answers it (executor.solver_error)
        field = exc.field if isinstance(exc, FieldError) else "body"
        raise ServiceError("422", str(exc), field=field) from None
    return done.schedule_json, done.schedule_id, (time.perf_counter() - start) * 1e3


class EmbeddedTransport:
    """Schedules in this process (no service)."""

    name = "embedded"

    def __init__(self) -> None:
        self._jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def submit(self, job: str, batch: str, request: dict[str, Any], timeout_s: float) -> None:
        with self._lock:
            self._jobs[(job, batch)] = request

    def fetch(self, job: str, batch: str, wait_s: float, timeout_s: float
              ) -> tuple[str, str, float] | None:
        with self._lock:
            request = self._jobs.pop((job, batch), None)
        if request is None:
            raise ServiceError("404", f"batch {batch!r} of job {job!r} is unknown")
        return solve_local(request)

    def close(self) -> None:
        pass


class HttpTransport:
    name = "http"

    def __init__(self, url: str, token: str | None) -> None:
        headers = {"User-Agent": USER_AGENT, "Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._client = httpx.Client(base_url=url.rstrip("/"), headers=headers, trust_env=False,
                                    verify=url.startswith("https://"))

    def _send(self, method: str, path: str, timeout_s: float, **kw: Any) -> httpx.Response:
        try:
            r = self._client.request(method, path, timeout=httpx.Timeout(
                timeout_s, connect=min(timeout_s, 1.0)), **kw)
        except httpx.HTTPError as exc:
            raise ServiceError("unavailable", f"{type(exc).__name__}: {exc}") from exc
        if r.status_code >= 400:
            raise http_error(r)
        return r

    def submit(self, job: str, batch: str, request: dict[str, Any], timeout_s: float) -> None:
        self._send("PUT", f"/v1/jobs/{job}/global-batches/{batch}", timeout_s,
                   content=json.dumps(request))

    def fetch(self, job: str, batch: str, wait_s: float, timeout_s: float
              ) -> tuple[str, str, float] | None:
        r = self._send("GET", f"/v1/jobs/{job}/global-batches/{batch}", timeout_s + wait_s,
                       params={"wait_ms": int(wait_s * 1e3)})
        if r.status_code == 202:
            return None
        timing = r.headers.get("server-timing", "")
        ms = float(timing.split("dur=")[1]) if "dur=" in timing else float("nan")
        return r.text, r.headers.get("x-schedule-id", ""), ms

    def close(self) -> None:
        self._client.close()


class GrpcTransport:
    name = "grpc"

    def __init__(self, target: str, token: str | None) -> None:
        import grpc

        from planner_service.proto_build import load

        stubs = load()
        self._grpc = grpc
        self._pb2 = stubs.pb2
        self._channel = grpc.insecure_channel(target, options=[
            ("grpc.enable_retries", 0), ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)])
        self._stub = stubs.pb2_grpc.GlobalBatchesStub(self._channel)
        self._metadata = [("authorization", f"Bearer {token}")] if token else []

    def _call(self, method: str, message: Any, timeout_s: float) -> Any:
        grpc = self._grpc
        try:
            return getattr(self._stub, method)(message, timeout=timeout_s,
                                               metadata=self._metadata)
        except grpc.RpcError as exc:
            code = exc.code()
            down = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            trailers = dict(exc.trailing_metadata() or ())
            raise ServiceError("unavailable" if down else code.name, str(exc.details()),
                               field=trailers.get("field")) from None

    def submit(self, job: str, batch: str, request: dict[str, Any], timeout_s: float) -> None:
        self._call("SubmitGlobalBatch", self._pb2.SubmitGlobalBatchRequest(
            job=job, batch=batch, request_json=json.dumps(request)), timeout_s)

    def fetch(self, job: str, batch: str, wait_s: float, timeout_s: float
              ) -> tuple[str, str, float] | None:
        reply = self._call("GetGlobalBatch", self._pb2.GetGlobalBatchRequest(
            job=job, batch=batch, wait_ms=int(wait_s * 1e3)), timeout_s + wait_s)
        if reply.status == "pending":
            return None
        return reply.schedule_json.decode(), reply.schedule_id, reply.solve_ms

    def close(self) -> None:
        self._channel.close()


def make_transport(url: str, token: str | None = None) -> Transport:
    """``embedded``, ``http(s)://host:port`` or ``grpc://host:port``; ValueError otherwise."""
    token = token if token is not None else os.environ.get("PLANNER_TOKEN") or None
    if url == "embedded":
        return EmbeddedTransport()
    if url.startswith(("http://", "https://")):
        return HttpTransport(url, token)
    if url.startswith("grpc://"):
        return GrpcTransport(url.removeprefix("grpc://"), token)
    raise ValueError(f"url must start with http://, https:// or grpc://, or be 'embedded'; "
                     f"got {url!r}")


class _Batch:
    def __init__(self, key: str, request: dict[str, Any]) -> None:
        self.key = key
        self.request = request
        self.created = time.monotonic()
        self.service: Future[GlobalSchedule] | None = None
        self.fallback: Future[GlobalSchedule] | None = None
        self.consumed = False


class ScheduleClient:
    """One-batch-ahead FCP scheduling of global batches, with a deterministic fallback.

    ``request_defaults`` are merged into every request (``strategy``, ``profile``,
    ``model``, ...). Use one client per process (threads and connections are its own).
    """

    def __init__(self, url: str, *, num_ranks: int, memory_tokens: int,
                 request_defaults: dict[str, Any] | None = None, job: str | None = None,
                 timeout_s: float = 1.0, request_timeout_s: float = 5.0,
                 prefetch_timeout_s: float = 30.0, max_batches: int = 16,
                 token: str | None = None) -> None:
        if timeout_s <= 0 or request_timeout_s <= 0:
            raise ValueError("timeout_s and request_timeout_s must be > 0")
        self.url = url
        self.token = token
        self.num_ranks = num_ranks
        self.memory_tokens = memory_tokens
        self.request_defaults = dict(request_defaults or {})
        self.job = job or f"{socket.gethostname()}-{os.getpid()}-g{next(_ids)}"
        self.timeout_s = timeout_s
        self.request_timeout_s = request_timeout_s
        self.prefetch_timeout_s = prefetch_timeout_s
        self.max_batches = max_batches
        self.transport = make_transport(url, token)  # connects lazily, on the first call
        self._lock = threading.Lock()
        self._batches: OrderedDict[str, _Batch] = OrderedDict()
        self._network = ThreadPoolExecutor(2, "schedule-client-net")
        self._local = ThreadPoolExecutor(1, "schedule-client-local")
        self._degraded = False
        self._degraded_since = 0.0
        self._warned = False
        self._service_schedules = 0
        self._fallbacks: dict[str, int] = {}

    def request(self, sequences: Sequence[Sequence[int]], **overrides: Any) -> dict[str, Any]:
        """The JSON request (``POST /v1/schedule`` body) this client sends."""
        return {"num_ranks": self.num_ranks, "memory_tokens": self.memory_tokens,
                **self.request_defaults, **overrides,
                "sequences": [[int(x) for x in seq] for seq in sequences]}

    def prefetch(self, batch_id: Any, sequences: Sequence[Sequence[int]], **overrides: Any
                 ) -> None:
        """Start scheduling a global batch in the background; returns at once. A batch id
        already prefetched is ignored."""
        key = str(batch_id)
        with self._lock:
            if key in self._batches:
                return
            batch = self._batches[key] = _Batch(key, self.request(sequences, **overrides))
            while len(self._batches) > self.max_batches:
                self._batches.popitem(last=False)[1].consumed = True
            degraded = self._degraded
        batch.service = self._network.submit(self._ask_service, batch)
        if degraded:  # the service is failing: have the fallback ready when get() asks
            batch.fallback = self._local.submit(self._solve_fallback, batch, "unavailable")

    def get(self, batch_id: Any, timeout: float | None = None,
            sequences: Sequence[Sequence[int]] | None = None) -> GlobalSchedule:
        """The schedule of a prefetched batch: the service's within ``timeout`` seconds
        (default ``timeout_s``), else computed here. Raises KeyError for a batch neither
        prefetched nor given, ServiceError (code '422') for input FCP rejects."""
        key = str(batch_id)
        if key not in self._batches:
            if sequences is None:
                raise KeyError(f"global batch {key!r} was not prefetched; pass sequences")
            self.prefetch(key, sequences)
        with self._lock:
            batch = self._batches.pop(key)
        try:
            return self._answer(batch, self.timeout_s if timeout is None else timeout)
        finally:
            batch.consumed = True  # ends its long-poll

    def _answer(self, batch: _Batch, timeout: float) -> GlobalSchedule:
        assert batch.service is not None
        if batch.fallback is not None and not batch.service.done():
            return self._use_fallback(batch, "unavailable")  # degraded: do not wait
        try:
            result = batch.service.result(timeout=timeout)
        except FutureTimeout:
            return self._use_fallback(batch, "late")
        except ServiceError as exc:
            if exc.invalid_input:
                raise
            return self._use_fallback(batch, "unavailable" if exc.code in (
                "unavailable", "late", "DEADLINE_EXCEEDED", "504") else "error")
        with self._lock:
            self._service_schedules += 1
            if self._degraded and batch.created >= self._degraded_since:
                log.info("planner service answers again: using its schedules")
                self._degraded = self._warned = False
        return result

    def wait(self, batch_id: Any, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the service's answer to a prefetched batch
        (schedule or failure) without consuming it; True if its schedule is in."""
        batch = self._batches.get(str(batch_id))
        if batch is None or batch.service is None:
            return False
        done, _ = wait_futures([batch.service], timeout)
        return bool(done) and batch.service.exception() is None

    @property
    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"service_schedules": self._service_schedules,
                    "fallbacks": sum(self._fallbacks.values()),
                    "fallbacks_by_reason": dict(self._fallbacks), "degraded": self._degraded}

    def close(self) -> None:
        with self._lock:
            for batch in self._batches.values():
                batch.consumed = True
            self._batches.clear()
        self._network.shutdown(wait=False, cancel_futures=True)
        self._local.shutdown(wait=False, cancel_futures=True)
        self.transport.close()

    def __enter__(self) -> ScheduleClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- background work --------------------------------------------------------------

    def _ask_service(self, batch: _Batch) -> GlobalSchedule:
        try:
            self.transport.submit(self.job, batch.key, batch.request, self.request_timeout_s)
            expires = batch.created + self.prefetch_timeout_s
            while not batch.consumed and time.monotonic() < expires:
                wait = min(1.0, max(0.0, expires - time.monotonic()))
                got = self.transport.fetch(self.job, batch.key, wait, self.request_timeout_s)
                if got is not None:
                    return GlobalSchedule(got[0], got[1], self.transport.name, False, None, got[2])
            raise ServiceError("late", "no schedule before the prefetch timeout")
        except ServiceError as exc:
            if not exc.invalid_input:
                with self._lock:
                    if not self._degraded:
                        self._degraded, self._degraded_since = True, time.monotonic()
            raise

    def _solve_fallback(self, batch: _Batch, reason: str) -> GlobalSchedule:
        text, schedule_id, ms = solve_local(batch.request)
        return GlobalSchedule(text, schedule_id, "local", True, reason, ms)

    def _use_fallback(self, batch: _Batch, reason: str) -> GlobalSchedule:
        if batch.fallback is not None:
            result = batch.fallback.result()._replace(reason=reason)
        else:
            result = self._solve_fallback(batch, reason)
        FALLBACKS.labels(reason).inc()
        with self._lock:
            self._fallbacks[reason] = self._fallbacks.get(reason, 0) + 1
            warn, self._warned = not self._warned, True
        if warn:
            log.warning("planner service %s: scheduling global batches locally until it "
                        "answers again", "is late" if reason == "late" else "failed")
        return result
