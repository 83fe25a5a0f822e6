"""ScheduleClient: FCP-schedule global batch k+1 while batch k trains, never stalling.

``prefetch(batch_id, sequences)`` returns at once; a background thread submits the global
batch to the service's job API (``PUT /v1/jobs/{job}/global-batches/{batch}`` or gRPC
``GlobalBatches``) and long-polls its schedule. ``get(batch_id, timeout)`` returns the
service's schedule when it is there, else the same schedule computed here (FCP is
deterministic and the stored form has no timings, so the bytes and ``schedule_id`` are
those the service would give), marked ``fallback=True``. While the service fails the
client is degraded: each prefetched batch's fallback starts at once on a local thread.

The single-sequence counterpart is PlanClient (prefetch.py): both are ahead.AheadClient
(one state machine: prefetch, degraded mode, fallbacks and their counter) over the same
back ends (backends.py, grpc_backend.py: their global-batch calls).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
from collections.abc import Sequence
from typing import Any, NamedTuple

from planner_service.client.ahead import AheadClient, Channel, GlobalBatches
from planner_service.client.backends import make_backend
from planner_service.client.base import Backend
from planner_service.client.local import solve_schedule_dict
from planner_service.core.plan import Plan
from planner_service.core.solved import SolvedPlan

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


def make_transport(url: str, token: str | None = None) -> GlobalBatches:
    """The global-batch job API of ``embedded``, ``http(s)://host:port`` or
    ``grpc://host:port`` (backends.make_backend; ``token`` defaults to $PLANNER_TOKEN);
    ValueError for another URL."""
    return GlobalBatches(make_backend(url, token=token))


class ScheduleClient(AheadClient[GlobalSchedule]):
    """One-batch-ahead FCP scheduling of global batches, with a deterministic fallback.

    Args:
        url: ``embedded``, ``http(s)://host:port`` or ``grpc://host:port``, or a Backend.
        num_ranks: model replicas N of every request.
        memory_tokens: activation memory per rank E, in tokens.
        request_defaults: merged into every request (``strategy``, ``profile``,
            ``model``, ...).
        job: the job id on the service (default: host, process id and a counter).
        timeout_s: ``get``'s default timeout.
        request_timeout_s: the deadline of one call to the service.
        prefetch_timeout_s: how long a batch's long-poll may go on.
        max_batches: prefetched batches kept; the oldest are dropped beyond it.
        token: the bearer token (default $PLANNER_TOKEN).

    A schedule's fallback is the whole FCP solve, not a cheap plan: it starts when the
    service fails (at once while degraded), else ``get`` computes it at its deadline.
    """

    NOUN = "schedule"
    SPECULATE = False
    KEEP = (*AheadClient.KEEP, "num_ranks", "memory_tokens", "request_defaults")

    def __init__(self, url: Backend | str, *, num_ranks: int, memory_tokens: int,
                 request_defaults: dict[str, Any] | None = None, job: str | None = None,
                 timeout_s: float = 1.0, request_timeout_s: float = 5.0,
                 prefetch_timeout_s: float = 30.0, max_batches: int = 16,
                 token: str | None = None) -> None:
        self.num_ranks = num_ranks
        self.memory_tokens = memory_tokens
        self.request_defaults = dict(request_defaults or {})
        super().__init__(url, job=job or f"{socket.gethostname()}-{os.getpid()}-g{next(_ids)}",
                         token=token, timeout_s=timeout_s, request_timeout_s=request_timeout_s,
                         prefetch_timeout_s=prefetch_timeout_s, max_batches=max_batches,
                         network_threads=2)

    @property
    def transport(self) -> Channel:
        return self.channel

    def request(self, sequences: Sequence[Sequence[int]], **overrides: Any) -> dict[str, Any]:
        """The JSON request (``POST /v1/schedule`` body) this client sends."""
        return {"num_ranks": self.num_ranks, "memory_tokens": self.memory_tokens,
                **self.request_defaults, **overrides,
                "sequences": [[int(x) for x in seq] for seq in sequences]}

    def prefetch(self, batch_id: Any, sequences: Sequence[Sequence[int]], **overrides: Any
                 ) -> None:
        """Start scheduling a global batch in the background; returns at once. A batch id
        already prefetched is ignored."""
        self._prefetch(str(batch_id), lambda: self.request(sequences, **overrides))

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
        return self._get(key, timeout)

    @property
    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {"service_schedules": self._service_answers,
                    "fallbacks": sum(self._fallbacks.values()),
                    "fallbacks_by_reason": dict(self._fallbacks), "degraded": self._degraded}

    # ---- the state machine's hooks ----------------------------------------------------

    def _channel(self, backend: Backend) -> Channel:
        return GlobalBatches(backend)

    def _answer(self, result: SolvedPlan) -> GlobalSchedule:
        return GlobalSchedule(result.plan_json, result.plan_id, self.channel.name, False,
                              None, result.solve_ms)

    def _fallback(self, request: dict[str, Any], reason: str) -> GlobalSchedule:
        done = solve_schedule_dict(request)
        return GlobalSchedule(done.plan_json, done.plan_id, "local", True, reason,
                              done.solve_ms)

    def _outage_warning(self, reason: str, error: str | None) -> str:
        return (f"planner service {'is late' if reason == 'late' else 'failed'}: "
                "scheduling global batches locally until it answers again")
