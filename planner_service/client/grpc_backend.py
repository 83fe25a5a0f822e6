"""The gRPC back end of the client (one channel per process, created lazily).

gRPC and ``fork`` do not mix: create the client inside a dataloader worker (or use a
spawn/forkserver worker context, or the HTTP back end) rather than forking a process
that already opened a channel.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from planner_service.client.base import SCHEDULE_LABEL, ServiceComparison, ServiceError
from planner_service.core.errors import FieldError
from planner_service.core.solved import SolvedPlan
from planner_service.proto_build import load
from planner_service.service.grpc_wire import dict_to_request

UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}


class GrpcBackend:
    name = "grpc"

    def __init__(self, target: str, *, token: str | None = None) -> None:
        self.target = target
        self.token = token
        self._stub: Any = None
        self._global_stub: Any = None
        self._channel: grpc.Channel | None = None
        self._pid = -1
        self._lock = threading.Lock()
        self._pb2 = load().pb2

    def __getstate__(self) -> dict[str, Any]:
        return {"target": self.target, "token": self.token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def _get_stub(self) -> Any:
        with self._lock:
            if self._stub is None or self._pid != os.getpid():
                self._channel = grpc.insecure_channel(self.target, options=[
                    ("grpc.max_receive_message_length", 256 * 2**20),
                    ("grpc.enable_retries", 0),
                    # Reconnect soon after a restart (gRPC's default backoff grows to 120 s).
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000)])
                stubs = load().pb2_grpc
                self._stub = stubs.PlannerStub(self._channel)
                self._global_stub = stubs.GlobalBatchesStub(self._channel)
                self._pid = os.getpid()
            return self._stub

    def _get_global_stub(self) -> Any:
        self._get_stub()
        return self._global_stub

    def warm(self) -> None:
        """Connect now (best effort), not on the first plan."""
        self._get_stub()
        assert self._channel is not None
        try:
            grpc.channel_ready_future(self._channel).result(timeout=1.0)
        except grpc.FutureTimeoutError:
            pass

    def _metadata(self, fallbacks: int = 0) -> list[tuple[str, str]]:
        md = []
        if self.token:
            md.append(("authorization", f"Bearer {self.token}"))
        if fallbacks:
            md.append(("x-planner-fallbacks", str(fallbacks)))
        return md

    def _call(self, method: str, message: Any, timeout_s: float, fallbacks: int = 0,
              service: str = "Planner") -> Any:
        """``method`` of the Planner (or GlobalBatches) service; gRPC errors become
        ServiceError (UNAVAILABLE and CANCELLED: ``unavailable``)."""
        stub = self._get_stub() if service == "Planner" else self._get_global_stub()
        try:
            return getattr(stub, method)(message, timeout=timeout_s,
                                         metadata=self._metadata(fallbacks))
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            trailers = dict(exc.trailing_metadata() or ())  # type: ignore[attr-defined]
            retry = trailers.get("retry-after")
            name = "unavailable" if code in UNAVAILABLE else code.name
            raise ServiceError(name, str(exc.details()),  # type: ignore[attr-defined]
                               field=trailers.get("field"),
                               retry_after_s=float(retry) if retry else None) from None

    @staticmethod
    def _result(reply: Any) -> SolvedPlan:
        return SolvedPlan(reply.plan_json.decode(), reply.plan_id, reply.strategy,
                          reply.solve_ms, reply.cached)

    def _request(self, request: dict[str, Any]) -> Any:
        try:
            return dict_to_request(self._pb2, request)
        except (TypeError, ValueError) as exc:
            raise ServiceError("INVALID_ARGUMENT", str(exc),
                               field=exc.field if isinstance(exc, FieldError) else None) from None

    def plan(self, request: dict[str, Any], timeout_s: float, *, fallbacks: int = 0
             ) -> SolvedPlan:
        return self._result(self._call("Plan", self._request(request), timeout_s, fallbacks))

    def compare(self, request: dict[str, Any], strategies: Sequence[str] | None,
                timeout_s: float) -> ServiceComparison:
        message = self._pb2.CompareRequest(request=self._request(request),
                                           strategies=list(strategies or []))
        reply = self._call("Compare", message, timeout_s)
        return ServiceComparison([(p.strategy, self._result(p)) for p in reply.plans],
                          dict(reply.errors))

    def schedule(self, request: dict[str, Any], timeout_s: float) -> str:
        reply = self._call("Schedule", self._pb2.ScheduleRequest(
            request_json=json.dumps(request)), timeout_s)
        return reply.result_json.decode()

    def submit(self, job: str, batch: str, request: dict[str, Any], timeout_s: float, *,
               fallbacks: int = 0) -> None:
        message = self._pb2.SubmitBatchRequest(job=job, batch=batch,
                                               request=self._request(request))
        self._call("SubmitBatch", message, timeout_s, fallbacks)

    def fetch(self, job: str, batch: str, wait_s: float, timeout_s: float
              ) -> SolvedPlan | None:
        message = self._pb2.GetBatchRequest(job=job, batch=batch, wait_ms=int(wait_s * 1e3))
        reply = self._call("GetBatch", message, timeout_s + wait_s)
        return None if reply.status == "pending" else self._result(reply.plan)

    def submit_global(self, job: str, batch: str, request: dict[str, Any], timeout_s: float
                      ) -> None:
        self._call("SubmitGlobalBatch", self._pb2.SubmitGlobalBatchRequest(
            job=job, batch=batch, request_json=json.dumps(request)), timeout_s,
            service="GlobalBatches")

    def fetch_global(self, job: str, batch: str, wait_s: float, timeout_s: float
                     ) -> SolvedPlan | None:
        reply = self._call("GetGlobalBatch", self._pb2.GetGlobalBatchRequest(
            job=job, batch=batch, wait_ms=int(wait_s * 1e3)), timeout_s + wait_s,
            service="GlobalBatches")
        if reply.status == "pending":
            return None
        return SolvedPlan(reply.schedule_json.decode(), reply.schedule_id, SCHEDULE_LABEL,
                          reply.solve_ms)

    def close(self) -> None:
        with self._lock:
            if self._channel is not None and self._pid == os.getpid():
                self._channel.close()
            self._channel = self._stub = self._global_stub = None
