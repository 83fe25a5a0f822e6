"""PlanClient: plan batch i+1 while step i trains, and never stall training.

``prefetch(batch_id, doc_lengths)`` returns at once; a background thread asks the
service (job API: submit, then long-poll). ``get(batch_id, timeout)`` returns the
service's plan when it is there, and otherwise a deterministic plan computed locally,
within ``timeout``, marked ``fallback=True``. The first fallback of an outage is logged
once; every fallback is counted (``stats``, the Prometheus counter
``planner_client_fallbacks_total`` of this process, and reported to the service with
the next request it answers).

While the service is failing the client is *degraded*: it computes each prefetched
batch's fallback right away on a local thread (so ``get`` does not wait) and keeps
asking the service with spare network threads, leaving degraded mode at its first answer.

``get(timeout)`` returns within the timeout plus the cost of a linear-time plan, always:
fallbacks run on daemon threads that can be abandoned, and a batch with no plan at the
deadline gets ``llama3`` (linear in documents + ranks by construction) computed there.
Which strategy a fallback uses depends on the request only (local.fallback_request), so
ranks that fall back on the same batch plan alike.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

from prometheus_client import Counter

from planner_service.client.backends import Backend, ServiceError, make_backend
from planner_service.client.local import (
    bounded_request,
    fallback_request,
    prepare,
    solve_dict,
)
from planner_service.core.plan import Plan
from planner_service.core.request import debug_request
from planner_service.core.solved import SolvedPlan

log = logging.getLogger("planner_service.client")

FALLBACKS = Counter("planner_client_fallbacks", "Plans this process computed locally because "
                    "the planner service was late, down or failing", ("reason",))
_job_ids = itertools.count()
RETURN_MARGIN_S = 0.002
"""get() stops waiting this long before its deadline, to return within it."""


def _in_background(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on a new daemon thread: one that never ends (a solver far slower
    than expected) is abandoned, and neither delays ``get`` nor the process's exit."""
    threading.Thread(target=fn, args=args, name="planner-client-local", daemon=True).start()


def _warm_solvers() -> None:
    solve_dict({"doc_lengths": list(debug_request().doc_lengths), "cp_size": 4})


class ClientPlan(NamedTuple):
    """A plan the client hands out: the solve's result and where it came from."""

    solved: SolvedPlan
    """The plan (parsed), its canonical JSON (byte-identical to the service's answer for
    the same request) and its solve time."""
    source: str
    """'http', 'grpc', 'embedded' or 'local' (a fallback)."""
    fallback: bool
    reason: str | None
    """Why a fallback was used: 'late', 'unavailable' or 'error' (None otherwise)."""

    @property
    def plan(self) -> Plan:
        return self.solved.parsed()

    @property
    def plan_json(self) -> str:
        return self.solved.plan_json

    @property
    def plan_id(self) -> str:
        return self.solved.plan_id

    @property
    def solve_ms(self) -> float:
        return self.solved.solve_ms


class ClientStats(NamedTuple):
    service_plans: int
    fallbacks: int
    fallbacks_by_reason: dict[str, int]
    degraded: bool
    last_error: str | None


@dataclass(eq=False)
class _Batch:
    key: str
    request: dict[str, Any]
    created: float
    service: ClientPlan | None = None
    fallback: ClientPlan | None = None
    error: Exception | None = None
    network_done: bool = False
    consumed: bool = False
    speculating: bool = False
    failure: str | None = None
    """'unavailable' or 'error' once the service failed for this batch."""


class PlanClient:
    """One-batch-ahead planning over HTTP, gRPC or in-process, with local fallback.

    ``backend``: a URL (``http://127.0.0.1:8000``, ``grpc://127.0.0.1:50051``,
    ``embedded``) or a Backend. ``request_defaults`` are merged into every request
    (e.g. ``context_length``, ``model``). Safe to pickle into dataloader workers: threads
    and connections are re-created in each process.
    """

    def __init__(self, backend: Backend | str, *, cp_size: int, strategy: str = "flashcp",
                 request_defaults: dict[str, Any] | None = None, job: str | None = None,
                 timeout_s: float = 1.0, request_timeout_s: float = 5.0,
                 prefetch_timeout_s: float = 30.0, fallback_strategy: str = "flashcp",
                 max_batches: int = 64, network_threads: int = 2,
                 token: str | None = None) -> None:
        if timeout_s <= 0 or request_timeout_s <= 0:
            raise ValueError("timeout_s and request_timeout_s must be > 0")
        self._backend_spec = backend
        self.token = token
        self.cp_size = cp_size
        self.strategy = strategy
        self.request_defaults = dict(request_defaults or {})
        self.job = job or f"{socket.gethostname()}-{os.getpid()}-{next(_job_ids)}"
        self.timeout_s = timeout_s
        self.request_timeout_s = request_timeout_s
        self.prefetch_timeout_s = prefetch_timeout_s
        self.fallback_strategy = fallback_strategy
        self.max_batches = max_batches
        self.network_threads = network_threads
        self._init_runtime()

    # ---- process-local state ------------------------------------------------------------

    def _init_runtime(self) -> None:
        self._pid = os.getpid()
        spec = self._backend_spec
        self.backend: Backend = make_backend(spec, token=self.token) if isinstance(spec, str) \
            else spec
        self._cond = threading.Condition()
        self._batches: OrderedDict[str, _Batch] = OrderedDict()
        self._network = ThreadPoolExecutor(self.network_threads, "planner-client-net")
        self._busy_network = 0
        self._degraded = False
        self._degraded_since = 0.0
        self._warned = False
        self._unreported = 0
        self._service_plans = 0
        self._fallbacks: dict[str, int] = {}
        self._last_error: str | None = None
        # Connect, import and warm the solvers now: the first batch then costs what later
        # ones do (a cold process spends ~0.3 s on imports, TLS setup, first solve). The
        # bounded plan is ready before the constructor returns: get() may need it.
        prepare()
        _in_background(_warm_solvers)
        self._network.submit(self._warm_backend)

    def _warm_backend(self) -> None:
        warm = getattr(self.backend, "warm", None)
        if warm is not None:
            try:
                warm()
            except Exception:  # noqa: BLE001 - best effort: failures show up on real calls
                pass

    def _check_process(self) -> None:
        if os.getpid() != self._pid:  # forked into a dataloader worker
            self._init_runtime()

    def __getstate__(self) -> dict[str, Any]:
        keep = ("_backend_spec", "token", "cp_size", "strategy", "request_defaults", "job",
                "timeout_s", "request_timeout_s", "prefetch_timeout_s", "fallback_strategy",
                "max_batches", "network_threads")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def close(self) -> None:
        with self._cond:
            for batch in self._batches.values():
                batch.consumed = True  # ends their long-polls
            self._batches.clear()
        self._network.shutdown(wait=False, cancel_futures=True)
        self.backend.close()

    def __enter__(self) -> PlanClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- public API -------------------------------------------------------------------

    def request(self, doc_lengths: Sequence[int], **overrides: Any) -> dict[str, Any]:
        """The JSON request this client sends for ``doc_lengths``."""
        return {"cp_size": self.cp_size, "strategy": self.strategy, **self.request_defaults,
                **overrides, "doc_lengths": [int(x) for x in doc_lengths]}

    def prefetch(self, batch_id: Any, doc_lengths: Sequence[int], **overrides: Any) -> None:
        """Start planning a batch in the background; returns at once. A batch id already
        prefetched is ignored (keep ids unique per job, e.g. the step number)."""
        self._check_process()
        key = str(batch_id)
        with self._cond:
            if key in self._batches:
                return
            batch = _Batch(key, self.request(doc_lengths, **overrides), time.monotonic())
            self._batches[key] = batch
            while len(self._batches) > self.max_batches:
                self._batches.popitem(last=False)[1].consumed = True
            degraded = self._degraded
            network_free = self._busy_network < self.network_threads
            if network_free or not degraded:
                self._busy_network += 1
                self._network.submit(self._ask_service, batch)
            else:
                batch.network_done = True  # no spare thread: plan locally this time
        if degraded:
            _in_background(self._fill_fallback, batch, "unavailable")

    def get(self, batch_id: Any, timeout: float | None = None,
            doc_lengths: Sequence[int] | None = None) -> ClientPlan:
        """The plan of a prefetched batch within ``timeout`` seconds (default: the
        client's ``timeout_s``); a local fallback if the service has not answered.

        Pass ``doc_lengths`` to plan a batch that was not prefetched. Raises KeyError for
        an unknown batch, ServiceError (code '422') for input no planner accepts.
        """
        self._check_process()
        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        key = str(batch_id)
        if key not in self._batches:
            if doc_lengths is None:
                raise KeyError(f"batch {key!r} was not prefetched; pass doc_lengths")
            self.prefetch(key, doc_lengths)
        with self._cond:
            batch = self._batches[key]
            if batch.service is None and batch.fallback is None and not batch.speculating:
                # Not answered yet: start the fallback now on the local thread, so that it
                # has the whole timeout to finish even on a busy machine.
                batch.speculating = True
                _in_background(self._fill_fallback, batch, "late")
            while True:
                if batch.service is not None:
                    result: ClientPlan | None = batch.service
                    break
                if batch.fallback is not None and (self._degraded or batch.network_done):
                    result = batch.fallback
                    break
                if batch.error is not None and batch.network_done:
                    self._batches.pop(key, None)
                    raise batch.error
                remaining = deadline - time.monotonic() - RETURN_MARGIN_S
                if remaining <= 0:  # the fallback, if ready; else the bounded plan below
                    result = batch.fallback
                    break
                self._cond.wait(remaining)
            batch.consumed = True
            self._batches.pop(key, None)
        if result is None:  # no plan at the deadline: the linear-time one, computed here
            result = self._solve_local(bounded_request(batch.request), "late", direct=True)
        if result.fallback and batch.failure is not None:
            result = result._replace(reason=batch.failure)  # why the service gave no plan
        if result.fallback:
            self._count_fallback(result.reason or "late")
        return result

    def wait(self, batch_id: Any, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the service's answer to a prefetched batch
        (its plan or its failure) without consuming the batch; True if its plan is in.
        Lets a caller that will ``get`` early give the service the whole budget first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            batch = self._batches.get(str(batch_id))
            while batch is not None and batch.service is None and not batch.network_done:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return batch is not None and batch.service is not None

    def plan(self, doc_lengths: Sequence[int], timeout: float | None = None,
             **overrides: Any) -> ClientPlan:
        """Plan one sequence now (prefetch + get)."""
        key = f"now-{next(_job_ids)}"
        self.prefetch(key, doc_lengths, **overrides)
        return self.get(key, timeout)

    @property
    def stats(self) -> ClientStats:
        with self._cond:
            return ClientStats(self._service_plans, sum(self._fallbacks.values()),
                               dict(self._fallbacks), self._degraded, self._last_error)

    # ---- background work --------------------------------------------------------------

    def _ask_service(self, batch: _Batch) -> None:
        """Network thread: submit the batch, long-poll its plan, parse it."""
        try:
            with self._cond:
                fallbacks, self._unreported = self._unreported, 0
            try:
                self.backend.submit(self.job, batch.key, batch.request, self.request_timeout_s,
                                    fallbacks=fallbacks)
            except BaseException:
                with self._cond:
                    self._unreported += fallbacks
                raise
            expires = batch.created + self.prefetch_timeout_s
            result = None
            while result is None and not batch.consumed and time.monotonic() < expires:
                # Short polls: a closed client's threads finish within a second.
                wait = min(1.0, max(0.0, expires - time.monotonic()))
                result = self.backend.fetch(self.job, batch.key, wait, self.request_timeout_s)
            if result is None:
                if batch.consumed:  # get() already answered with a fallback: stop quietly
                    return
                raise ServiceError("late", "no plan before the prefetch timeout")
            solved = result._replace(plan=Plan.from_json(result.plan_json))
            answer = ClientPlan(solved, self.backend.name, False, None)
            with self._cond:
                batch.service = answer
                self._service_plans += 1
                # Only a request sent after the outage began proves the service is back
                # (a late answer to an older one must not end the outage, nor re-arm the log).
                if self._degraded and batch.created >= self._degraded_since:
                    log.info("planner service answers again: using its plans")
                    self._degraded = self._warned = False
        except ServiceError as exc:
            self._on_error(batch, exc)
        except Exception as exc:  # noqa: BLE001 - a bad answer must not stall training
            self._on_error(batch, ServiceError("error", f"{type(exc).__name__}: {exc}"))
        finally:
            with self._cond:
                self._busy_network -= 1
                batch.network_done = True
                self._cond.notify_all()

    def _on_error(self, batch: _Batch, exc: ServiceError) -> None:
        late = exc.code in ("unavailable", "late", "DEADLINE_EXCEEDED", "504")
        reason = "unavailable" if late else "error"
        with self._cond:
            self._last_error = str(exc)
            if not self._degraded:
                self._degraded, self._degraded_since = True, time.monotonic()
            batch.failure = reason
        if batch.fallback is None and not batch.consumed:
            _in_background(self._fill_fallback, batch, reason)

    def _fill_fallback(self, batch: _Batch, reason: str) -> None:
        """Compute a batch's fallback plan (on whichever background thread calls it)."""
        if batch.fallback is not None or batch.consumed:
            return
        try:
            plan = self._solve_local(batch.request, reason)
        except ServiceError as exc:  # invalid input: no planner will accept it
            with self._cond:
                batch.error = exc
                self._cond.notify_all()
            return
        with self._cond:
            if batch.fallback is None:
                batch.fallback = plan
            self._cond.notify_all()

    def _solve_local(self, request: dict[str, Any], reason: str, direct: bool = False
                     ) -> ClientPlan:
        """Plan locally: ``request`` itself if ``direct``, else its fallback request."""
        solved = solve_dict(request if direct else
                            fallback_request(request, self.fallback_strategy))
        return ClientPlan(solved, "local", True, reason)

    def _count_fallback(self, reason: str) -> None:
        FALLBACKS.labels(reason).inc()
        with self._cond:
            self._fallbacks[reason] = self._fallbacks.get(reason, 0) + 1
            self._unreported += 1
            warn, self._warned = not self._warned, True
            error = self._last_error
        if warn:  # once per outage; the counter has the rest
            log.warning("planner service %s (%s): using local %s plans until it answers "
                        "again", "is late" if reason == "late" else "failed", error or reason,
                        self.fallback_strategy)
