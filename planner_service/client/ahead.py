"""One batch ahead, never stalling training: the state machine PlanClient and ScheduleClient share.

``prefetch`` returns at once; a network thread submits the batch to the service's job API
through a :class:`Channel` (single plans or global batches of one Backend) and long-polls
the answer. ``get(timeout)`` returns the service's answer when it is there, and otherwise
a deterministic answer computed locally, marked ``fallback=True``. The first fallback of an
outage is logged once; every fallback is counted (``stats`` and the Prometheus counter
``planner_client_fallbacks_total`` of this process).

While the service is failing the client is *degraded*: it computes each prefetched batch's
fallback right away on a local thread (so ``get`` does not wait) and keeps asking the
service with spare network threads, leaving degraded mode at the first answer to a request
sent after the outage began.

Fallbacks run on daemon threads that can be abandoned; what ``get`` computes itself when
no answer is ready at its deadline is the subclass's (``_at_deadline``: PlanClient's is
linear-time by construction, so ``get`` returns within the timeout plus that plan).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Protocol, Self, TypeVar, cast

from prometheus_client import Counter

from planner_service.client.backends import make_backend
from planner_service.client.base import Backend, ServiceError
from planner_service.core.solved import SolvedPlan

log = logging.getLogger("planner_service.client")

FALLBACKS = Counter("planner_client_fallbacks", "Plans this process computed locally because "
                    "the planner service was late, down or failing", ("reason",))
RETURN_MARGIN_S = 0.002
"""get() stops waiting this long before its deadline, to return within it."""
LATE_CODES = frozenset({"unavailable", "late", "DEADLINE_EXCEEDED", "504"})
"""Service errors that mean no answer came in time: a fallback for 'unavailable'; any
other error gives one for 'error'."""


def in_background(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on a new daemon thread: one that never ends (a solver far slower
    than expected) is abandoned, and neither delays ``get`` nor the process's exit."""
    threading.Thread(target=fn, args=args, name="planner-client-local", daemon=True).start()


class Answer(Protocol):
    """What a client hands out (ClientPlan, GlobalSchedule: NamedTuples, so ``_replace``
    sets the reason): its fallback flag and reason."""

    @property
    def fallback(self) -> bool: ...

    @property
    def reason(self) -> str | None: ...


T = TypeVar("T", bound=Answer)


class Channel(Protocol):
    """The job API of one kind of batch: a Backend's single plans (``submit``/``fetch``)
    or, through :class:`GlobalBatches`, its global batches."""

    name: str

    def warm(self) -> None: ...

    def submit(self, job: str, batch: str, request: dict[str, Any], timeout_s: float, *,
               fallbacks: int = 0) -> None: ...

    def fetch(self, job: str, batch: str, wait_s: float, timeout_s: float
              ) -> SolvedPlan | None: ...

    def close(self) -> None: ...


class GlobalBatches:
    """A Backend's global-batch job API as a Channel (FCP schedules; the service takes no
    fallback report with them, so ``fallbacks`` is not sent)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.name = backend.name

    def warm(self) -> None:
        self.backend.warm()

    def submit(self, job: str, batch: str, request: dict[str, Any], timeout_s: float, *,
               fallbacks: int = 0) -> None:
        self.backend.submit_global(job, batch, request, timeout_s)

    def fetch(self, job: str, batch: str, wait_s: float, timeout_s: float
              ) -> SolvedPlan | None:
        return self.backend.fetch_global(job, batch, wait_s, timeout_s)

    def close(self) -> None:
        self.backend.close()


@dataclass(eq=False)
class Batch(Generic[T]):
    key: str
    request: dict[str, Any]
    created: float
    service: T | None = None
    fallback: T | None = None
    error: Exception | None = None
    network_done: bool = False
    consumed: bool = False
    speculating: bool = False
    failure: str | None = None
    """'unavailable' or 'error' once the service failed for this batch."""


class AheadClient(Generic[T]):
    """The shared state machine; subclasses say how to build a channel, read an answer and
    compute a fallback. Safe to pickle: threads and connections are re-created in each
    process (``KEEP``: the attributes that travel)."""

    NOUN = "plan"
    """What the client hands out, for its messages."""
    SPECULATE = True
    """Start the local fallback as soon as ``get`` finds no answer (so it has the whole
    timeout); False: only once the service failed, or at the deadline."""
    KEEP: tuple[str, ...] = ("spec", "token", "job", "timeout_s", "request_timeout_s",
                             "prefetch_timeout_s", "max_batches", "network_threads")

    def __init__(self, spec: Backend | str, *, job: str, token: str | None, timeout_s: float,
                 request_timeout_s: float, prefetch_timeout_s: float, max_batches: int,
                 network_threads: int) -> None:
        """The arguments both clients take (documented on PlanClient and ScheduleClient);
        ``spec`` is a URL for backends.make_backend or a Backend, ``network_threads`` the
        threads asking the service. Raises ValueError for a timeout <= 0."""
        if timeout_s <= 0 or request_timeout_s <= 0:
            raise ValueError("timeout_s and request_timeout_s must be > 0")
        self.spec = spec
        self.token = token
        self.job = job
        self.timeout_s = timeout_s
        self.request_timeout_s = request_timeout_s
        self.prefetch_timeout_s = prefetch_timeout_s
        self.max_batches = max_batches
        self.network_threads = network_threads
        self._init_runtime()

    # ---- what a subclass says ---------------------------------------------------------

    def _channel(self, backend: Backend) -> Channel:
        """The job API this client submits to."""
        return backend

    def _prepare(self) -> None:
        """Warm what local fallbacks need (called in each process as it starts)."""

    def _answer(self, result: SolvedPlan) -> T:
        """The service's answer as this client hands it out."""
        raise NotImplementedError

    def _fallback(self, request: dict[str, Any], reason: str) -> T:
        """A batch's local answer; raises ServiceError for input no planner accepts."""
        raise NotImplementedError

    def _at_deadline(self, batch: Batch[T]) -> T:
        """What ``get`` computes itself when no answer is ready at its deadline."""
        return self._fallback(batch.request, "late")

    def _outage_warning(self, reason: str, error: str | None) -> str:
        """The one log line of an outage."""
        raise NotImplementedError

    # ---- process-local state ----------------------------------------------------------

    def _init_runtime(self) -> None:
        self._pid = os.getpid()
        spec = self.spec
        self.channel: Channel = self._channel(
            make_backend(spec, token=self.token) if isinstance(spec, str) else spec)
        self._cond = threading.Condition()
        self._batches: OrderedDict[str, Batch[T]] = OrderedDict()
        self._network = ThreadPoolExecutor(self.network_threads, "planner-client-net")
        self._busy_network = 0
        self._degraded = False
        self._degraded_since = 0.0
        self._warned = False
        self._unreported = 0
        self._service_answers = 0
        self._fallbacks: dict[str, int] = {}
        self._last_error: str | None = None
        self._prepare()
        self._network.submit(self._warm_channel)

    def _warm_channel(self) -> None:
        try:
            self.channel.warm()
        except Exception:  # noqa: BLE001 - best effort: failures show up on real calls
            pass

    def _check_process(self) -> None:
        if os.getpid() != self._pid:  # forked into a dataloader worker
            self._init_runtime()

    def __getstate__(self) -> dict[str, Any]:
        return {k: self.__dict__[k] for k in self.KEEP}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def close(self) -> None:
        with self._cond:
            for batch in self._batches.values():
                batch.consumed = True  # ends their long-polls
            self._batches.clear()
        self._network.shutdown(wait=False, cancel_futures=True)
        self.channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the state machine ------------------------------------------------------------

    def _prefetch(self, key: str, request: Callable[[], dict[str, Any]]) -> None:
        """Start a batch (``request()`` builds its body) unless ``key`` is known."""
        self._check_process()
        with self._cond:
            if key in self._batches:
                return
            batch: Batch[T] = Batch(key, request(), time.monotonic())
            self._batches[key] = batch
            while len(self._batches) > self.max_batches:
                self._batches.popitem(last=False)[1].consumed = True
            degraded = self._degraded
            network_free = self._busy_network < self.network_threads
            if network_free or not degraded:
                self._busy_network += 1
                self._network.submit(self._ask_service, batch)
            else:
                batch.network_done = True  # no spare thread: answer locally this time
        if degraded:
            in_background(self._fill_fallback, batch, "unavailable")

    def _get(self, key: str, timeout: float | None) -> T:
        """The answer of the prefetched batch ``key`` within ``timeout`` (default
        ``timeout_s``); raises KeyError if unknown, the ServiceError of bad input."""
        self._check_process()
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        with self._cond:
            batch = self._batches[key]
            if batch.service is None and batch.fallback is None and not batch.speculating \
                    and self.SPECULATE:
                # Not answered yet: start the fallback now on the local thread, so that it
                # has the whole timeout to finish even on a busy machine.
                batch.speculating = True
                in_background(self._fill_fallback, batch, "late")
            while True:
                if batch.service is not None:
                    result: T | None = batch.service
                    break
                if batch.fallback is not None and (self._degraded or batch.network_done):
                    result = batch.fallback
                    break
                if batch.error is not None and batch.network_done:
                    self._batches.pop(key, None)
                    raise batch.error
                remaining = deadline - time.monotonic() - RETURN_MARGIN_S
                if remaining <= 0:  # the fallback, if ready; else _at_deadline below
                    result = batch.fallback
                    break
                self._cond.wait(remaining)
            batch.consumed = True
            self._batches.pop(key, None)
        if result is None:
            result = self._at_deadline(batch)
        if result.fallback and batch.failure is not None:
            # Why the service gave no answer.
            result = cast(T, cast(Any, result)._replace(reason=batch.failure))
        if result.fallback:
            self._count_fallback(result.reason or "late")
        return result

    def wait(self, batch_id: Any, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the service's answer to a prefetched batch
        (its answer or its failure) without consuming the batch; True if its answer is in.
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

    # ---- background work --------------------------------------------------------------

    def _ask_service(self, batch: Batch[T]) -> None:
        """Network thread: submit the batch, long-poll its answer, read it."""
        try:
            with self._cond:
                fallbacks, self._unreported = self._unreported, 0
            try:
                self.channel.submit(self.job, batch.key, batch.request, self.request_timeout_s,
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
                result = self.channel.fetch(self.job, batch.key, wait, self.request_timeout_s)
            if result is None:
                if batch.consumed:  # get() already answered with a fallback: stop quietly
                    return
                raise ServiceError("late", f"no {self.NOUN} before the prefetch timeout")
            answer = self._answer(result)
            with self._cond:
                batch.service = answer
                self._service_answers += 1
                # Only a request sent after the outage began proves the service is back
                # (a late answer to an older one must not end the outage, nor re-arm the log).
                if self._degraded and batch.created >= self._degraded_since:
                    log.info("planner service answers again: using its %ss", self.NOUN)
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

    def _on_error(self, batch: Batch[T], exc: ServiceError) -> None:
        reason = "unavailable" if exc.code in LATE_CODES else "error"
        with self._cond:
            self._last_error = str(exc)
            if not self._degraded:
                self._degraded, self._degraded_since = True, time.monotonic()
            batch.failure = reason
        if batch.fallback is None and not batch.consumed:
            in_background(self._fill_fallback, batch, reason)

    def _fill_fallback(self, batch: Batch[T], reason: str) -> None:
        """Compute a batch's fallback (on whichever background thread calls it)."""
        if batch.fallback is not None or batch.consumed:
            return
        try:
            answer = self._fallback(batch.request, reason)
        except ServiceError as exc:  # invalid input: no planner will accept it
            with self._cond:
                batch.error = exc
                self._cond.notify_all()
            return
        with self._cond:
            if batch.fallback is None:
                batch.fallback = answer
            self._cond.notify_all()

    def _count_fallback(self, reason: str) -> None:
        FALLBACKS.labels(reason).inc()
        with self._cond:
            self._fallbacks[reason] = self._fallbacks.get(reason, 0) + 1
            self._unreported += 1
            warn, self._warned = not self._warned, True
            error = self._last_error
        if warn:  # once per outage; the counter has the rest
            log.warning("%s", self._outage_warning(reason, error))

