"""Solvers off the event loop: a process pool behind a bounded queue, deadlines and a cache.

Admission is synchronous (:meth:`Executor.submit`), so a caller learns at once that the
service is full (:class:`Overloaded`, answered 429 / RESOURCE_EXHAUSTED with Retry-After)
instead of the backlog growing. Admission is per lane (service/cost_gate.py): the fast
lane (cheap strategies) has PLANNER_FAST_WORKERS solver processes of its own and a queue
bound of PLANNER_QUEUE_SIZE; the slow lane (ilp, fcp, FCP schedules, large requests)
admits PLANNER_SLOW_QUEUE_SIZE beyond its workers and at most PLANNER_MAX_SLOW_PER_CLIENT
solves of one client. Identical requests (same content hash) share one solve
while it runs and are answered from an LRU cache (bounded in entries and bytes) afterwards.

Every solve runs under the latest deadline of the callers waiting for it: when that passes,
or when every caller went away (connection dropped, gRPC cancelled), the solver process is
killed and replaced (pool.py), so no request holds a worker past its deadline. With
``PLANNER_WORKERS=0`` (one thread, tests and debugging) a late solve cannot be stopped: it
finishes and fills the cache, and only the caller's answer is on time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from planner_service.core.errors import FieldError
from planner_service.core.request import PlanRequest
from planner_service.core.solved import SolvedPlan
from planner_service.core.validate import PlanError
from planner_service.service import test_hooks
from planner_service.service.cost_gate import FAST, LANES, SLOW, request_cost
from planner_service.service.metrics import ServiceMetrics
from planner_service.service.pool import TaskExpired, WorkerDied, WorkerPool
from planner_service.service.settings import Settings
from planner_service.service.worker_tasks import (
    WARM_TIMEOUT_S,
    call_in_worker,
    solve_in_worker,
    warm_worker,
)

log = logging.getLogger("planner_service.service")

class Overloaded(Exception):
    """The bounded queue is full; retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(Exception):
    """The answer was not ready within the request's deadline."""


def solver_error(exc: BaseException) -> BaseException:
    """A solver's exception as callers see it: an expired task is DeadlineExceeded; a
    ValueError the core raised without a field (every request check raises FieldError) is
    a FieldError about the request as a whole (``body``); the rest (PlanError: a bug)
    as raised."""
    if isinstance(exc, TaskExpired):
        return DeadlineExceeded(str(exc))
    if isinstance(exc, ValueError) and not isinstance(exc, (FieldError, PlanError)):
        return FieldError("body", str(exc))
    return exc


@dataclass(eq=False)
class _Solve:
    """One running solve and the callers waiting for it."""

    raw: asyncio.Future[Any]
    """The pool's future (its cancellation stops the solver process)."""
    result: asyncio.Future[SolvedPlan]
    waiters: int = 0
    started: float = 0.0
    """Loop time of its admission (times the thread mode's failed solves)."""


class Executor:
    """Bounded, deduplicating, caching front of the solver pool. Use from one event loop."""

    def __init__(self, settings: Settings, metrics: ServiceMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.workers = settings.workers
        self.fast_workers = settings.fast_workers if settings.workers > 0 else 0
        self.lane_capacity = {
            FAST: max(1, settings.workers) + self.fast_workers + settings.queue_size,
            SLOW: max(1, settings.workers) + settings.slow_queue_size}
        self.capacity = sum(self.lane_capacity.values())
        self.cache_bytes_limit = int(settings.cache_mb * 2**20)
        self._pool: WorkerPool | cf.ThreadPoolExecutor | None = None
        self._depth = 0
        self._lane_depth = dict.fromkeys(LANES, 0)
        self._client_slow: dict[str, int] = {}
        """client -> its slow-lane solves admitted and not finished."""
        self._inflight: dict[str, _Solve] = {}
        self._cache: OrderedDict[str, SolvedPlan] = OrderedDict()
        self._cache_bytes = 0
        self._ewma_solve_s = 0.005
        metrics.queue_capacity.set(self.capacity)

    # ---- lifecycle --------------------------------------------------------------------

    def _make_pool(self) -> WorkerPool | cf.ThreadPoolExecutor:
        if self.workers == 0:
            return cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="planner-solve")
        pool = WorkerPool(self.workers, reserved=self.fast_workers, observer=self._observe,
                          setup=test_hooks.install if self.settings.test_hooks else None)
        pool.start()
        return pool

    def _observe(self, label: str, seconds: float, outcome: str) -> None:
        """Every solve's run time, whatever its outcome (planner_solve_seconds)."""
        if label:
            self.metrics.solve_seconds.labels(label, outcome).observe(seconds)

    async def start(self) -> None:
        """Start the workers and run one warm-up task on each (concurrently)."""
        if self.settings.test_hooks:
            test_hooks.install()
        self._pool = self._make_pool()
        size = max(1, self.workers) + self.fast_workers
        pids = await asyncio.gather(*(self._submit(warm_worker, timeout_s=WARM_TIMEOUT_S,
                                                   lane=FAST) for _ in range(size)))
        log.info("solver pool ready: %d worker(s) + %d fast-lane %s", self.workers,
                 self.fast_workers, sorted(set(pids)))

    def _submit(self, fn: Callable[..., Any], *args: Any, timeout_s: float,
                lane: str = SLOW, client: str = "", label: str = "") -> asyncio.Future[Any]:
        assert self._pool is not None
        if isinstance(self._pool, WorkerPool):
            return self._pool.submit(fn, *args, timeout_s=timeout_s, lane=lane,
                                     client=client, label=label)
        return asyncio.wrap_future(self._pool.submit(fn, *args))

    async def close(self, deadline: float | None = None) -> None:
        """Wait for running solves until loop time ``deadline`` (default: now plus
        PLANNER_SHUTDOWN_GRACE_S), then stop the workers, killing busy ones."""
        pool = self._pool
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.settings.shutdown_grace_s
        if isinstance(pool, WorkerPool):
            await pool.close(deadline)  # admission stays open while it drains
        elif pool is not None:
            self._pool = None
            await loop.run_in_executor(None, pool.shutdown, True)
        self._pool = None

    @property
    def depth(self) -> int:
        """Solves admitted and not finished."""
        return self._depth

    def lane_depth(self, lane: str) -> int:
        """Solves of ``lane`` admitted and not finished (running + waiting)."""
        return self._lane_depth[lane]

    def lane_waiting(self, lane: str) -> int:
        """Solves of ``lane`` waiting for a worker (process pool only)."""
        return self._pool.waiting(lane) if isinstance(self._pool, WorkerPool) else 0

    def lane_age_s(self, lane: str) -> float:
        """How long the oldest waiting solve of ``lane`` has waited."""
        return self._pool.oldest_wait_s(lane) if isinstance(self._pool, WorkerPool) else 0.0

    @property
    def cache_entries(self) -> int:
        return len(self._cache)

    @property
    def cache_bytes(self) -> int:
        return self._cache_bytes

    @property
    def healthy(self) -> bool:
        """False while every solver process is stuck past a deadline (readiness)."""
        pool = self._pool
        return pool is not None and (not isinstance(pool, WorkerPool) or pool.healthy())

    @property
    def kills(self) -> int:
        """Solver processes stopped because their solve expired or was abandoned."""
        return self._pool.kills if isinstance(self._pool, WorkerPool) else 0

    # ---- admission --------------------------------------------------------------------

    def _admit(self, lane: str, client: str) -> None:
        if self._pool is None:
            raise Overloaded("the solver pool is not running (starting or shutting down)", 1)
        if isinstance(self._pool, WorkerPool) and self._pool.closing:
            raise WorkerDied("the service is stopping")
        depth, capacity = self._lane_depth[lane], self.lane_capacity[lane]
        if depth >= capacity:
            self.metrics.rejected.labels("queue_full").inc()
            per_worker = depth / max(1, self.workers)
            retry = max(1, math.ceil(per_worker * self._ewma_solve_s))
            raise Overloaded(f"the {lane}-lane solver queue is full ({depth} of {capacity} "
                             "solves admitted); retry later", retry)
        if lane == SLOW and self._client_slow.get(client, 0) >= self.settings.max_slow_per_client:
            self.metrics.rejected.labels("client_slow").inc()
            raise Overloaded(f"this client has {self.settings.max_slow_per_client} slow solves "
                             "(ilp, fcp, schedules, large requests) admitted, the limit "
                             "(PLANNER_MAX_SLOW_PER_CLIENT); retry when one finishes", 1)

    def _run(self, fn: Callable[..., Any], *args: Any, timeout_s: float, lane: str = SLOW,
             client: str = "", label: str = "") -> asyncio.Future[Any]:
        """Admit and start ``fn(*args)`` on the pool; the returned future is loop-bound."""
        self._admit(lane, client)
        future = self._submit(fn, *args, timeout_s=timeout_s, lane=lane, client=client,
                              label=label)
        self._depth += 1
        self._lane_depth[lane] += 1
        if lane == SLOW:
            self._client_slow[client] = self._client_slow.get(client, 0) + 1
        self.metrics.queue_depth.set(self._depth)

        def release(_: asyncio.Future[Any]) -> None:
            self._depth -= 1
            self._lane_depth[lane] -= 1
            if lane == SLOW:
                left = self._client_slow[client] - 1
                if left:
                    self._client_slow[client] = left
                else:
                    del self._client_slow[client]
            self.metrics.queue_depth.set(self._depth)

        future.add_done_callback(release)
        return future

    def lane_of(self, request: PlanRequest) -> str:
        """The lane of a plan request (service/cost_gate.py). O(documents)."""
        return request_cost(request.strategy, request.doc_lengths, request.cp_size,
                            self.settings.fast_lane_max_work).lane

    # ---- plans ------------------------------------------------------------------------

    def submit(self, request: PlanRequest, key: str, timeout_s: float | None = None,
               client: str = "") -> asyncio.Future[SolvedPlan]:
        """Start (or join, or answer from cache) the solve of ``request``, to run at most
        ``timeout_s`` (default: :meth:`timeout_for`) from now.

        ``request`` has passed ``registry.checked_strategy`` (PlannerService.request; a
        comparison's ``compared_options``): the solver process does not check it again.
        ``key`` is its content hash (schemas.request_key). Every call counts one waiter;
        call :meth:`release` when no longer waiting (the solve stops when the last waiter
        leaves). A caller that never releases (the job store) keeps it to its deadline.
        Raises Overloaded at once when the queue is full. The future fails with FieldError
        for bad input the edge could not see, DeadlineExceeded, and PlanError for a bug.
        """
        loop = asyncio.get_running_loop()
        timeout = self.timeout_for(timeout_s, request)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.metrics.cache_hits.inc()
            done: asyncio.Future[SolvedPlan] = loop.create_future()
            done.set_result(hit._replace(cached=True))
            return done
        joined = self._inflight.get(key)
        if joined is not None:
            self.metrics.cache_hits.inc()
            joined.waiters += 1
            if isinstance(self._pool, WorkerPool):
                self._pool.extend(joined.raw, timeout)
            return joined.result
        raw = self._run(solve_in_worker, request, self.settings.max_plan_bytes,
                        timeout_s=timeout, lane=self.lane_of(request), client=client,
                        label=request.strategy)
        self.metrics.cache_misses.inc()
        entry = _Solve(raw, loop.create_future(), waiters=1, started=loop.time())
        self._inflight[key] = entry
        raw.add_done_callback(lambda f: self._finish(key, request.strategy, entry))
        return entry.result

    def release(self, key: str, future: asyncio.Future[SolvedPlan]) -> None:
        """One waiter of ``future`` (from :meth:`submit`) stopped waiting; the last one
        leaving an unfinished solve stops it (process pool only: a thread cannot be)."""
        entry = self._inflight.get(key)
        if entry is None or entry.result is not future:
            return
        entry.waiters -= 1
        if entry.waiters <= 0 and not entry.raw.done() and isinstance(self._pool, WorkerPool):
            entry.raw.cancel()

    def _finish(self, key: str, strategy: str, entry: _Solve) -> None:
        if self._inflight.get(key) is entry:
            del self._inflight[key]
        raw, result = entry.raw, entry.result
        if result.done():
            return
        if raw.cancelled():
            result.cancel()
            return
        exc = raw.exception()
        threaded = not isinstance(self._pool, WorkerPool)  # the pool observes its own
        if exc is not None:
            if threaded:
                outcome = "refused" if isinstance(exc, FieldError) else "error"
                self._observe(strategy, asyncio.get_running_loop().time() - entry.started,
                              outcome)
            result.set_exception(solver_error(exc))
            result.exception()  # mark retrieved: nobody may be waiting any more
            return
        solved: SolvedPlan = raw.result()
        self._ewma_solve_s = 0.9 * self._ewma_solve_s + 0.1 * solved.solve_ms / 1e3
        if threaded:
            self._observe(strategy, solved.solve_ms / 1e3, "ok")
        self._remember(key, solved)
        result.set_result(solved)

    def _remember(self, key: str, solved: SolvedPlan) -> None:
        """Cache a plan, evicting least recently used ones beyond PLANNER_CACHE_SIZE
        entries or PLANNER_CACHE_MB bytes; a plan larger than the byte bound is not kept."""
        size = len(solved.plan_json)
        if self.settings.cache_size <= 0 or size > self.cache_bytes_limit or key in self._cache:
            return
        self._cache[key] = solved
        self._cache_bytes += size
        while len(self._cache) > self.settings.cache_size \
                or self._cache_bytes > self.cache_bytes_limit:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= len(old.plan_json)
        self.metrics.cache_entries.set(len(self._cache))
        self.metrics.cache_bytes.set(self._cache_bytes)

    def timeout_for(self, requested_s: float | None, request: PlanRequest | None = None
                    ) -> float:
        """The deadline of one call: the caller's, capped at PLANNER_REQUEST_TIMEOUT_S
        (raised to options.time_limit_s + 5 s for a request that sets a limit, itself at
        most PLANNER_MAX_TIME_LIMIT_S: the ILP ends within its limit plus about 1 s)."""
        cap = self.settings.request_timeout_s
        limit = request.options.get("time_limit_s") if request is not None else None
        if isinstance(limit, (int, float)) and not isinstance(limit, bool):
            cap = max(cap, min(float(limit), self.settings.max_time_limit_s) + 5)
        return cap if requested_s is None or requested_s <= 0 else min(cap, requested_s)

    async def solve(self, request: PlanRequest, key: str,
                    timeout_s: float | None = None, client: str = "") -> SolvedPlan:
        """Submit and wait up to the deadline; raises Overloaded, DeadlineExceeded,
        FieldError or PlanError. Cancelling the caller stops the solve if nobody else
        waits for it."""
        timeout = self.timeout_for(timeout_s, request)
        future = self.submit(request, key, timeout, client)
        try:
            return await wait_for(future, timeout)
        finally:
            self.release(key, future)

    async def call(self, fn: Callable[..., Any], *args: Any,
                   timeout_s: float | None = None, client: str = "",
                   label: str = "schedule") -> tuple[Any, float]:
        """Run a picklable ``fn(*args)`` on the pool's slow lane (no cache) within the
        deadline; returns (result, ms). The solve is stopped when the deadline passes or
        the caller is cancelled."""
        timeout = self.timeout_for(timeout_s)
        raw = self._run(call_in_worker, fn, *args, timeout_s=timeout, client=client,
                        label=label)
        try:
            return await wait_for(raw, timeout)
        except Exception as exc:  # noqa: BLE001 - translated, then raised
            translated = solver_error(exc)
            if translated is exc:
                raise
            raise translated from None
        finally:
            if not raw.done() and isinstance(self._pool, WorkerPool):
                raw.cancel()

    def start_call(self, fn: Callable[..., Any], *args: Any, client: str = "",
                   label: str = "schedule") -> asyncio.Future[tuple[Any, float]]:
        """Admit and start a picklable ``fn(*args)`` on the slow lane now (no cache),
        stopped at the deadline PLANNER_REQUEST_TIMEOUT_S (the future then fails with
        TaskExpired); the future gives (result, ms). Raises Overloaded at once when full."""
        return self._run(call_in_worker, fn, *args, timeout_s=self.timeout_for(None),
                         client=client, label=label)


async def wait_for(future: asyncio.Future[Any], timeout_s: float) -> Any:
    """Await a shared future up to ``timeout_s`` without cancelling it for other waiters."""
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)
    except (TimeoutError, TaskExpired):
        raise DeadlineExceeded(f"no answer within the deadline of {timeout_s:g} s") from None
