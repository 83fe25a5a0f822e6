"""Solvers off the event loop: a process pool behind a bounded queue, deadlines and a cache.

Admission is synchronous (:meth:`Executor.submit`), so a caller learns at once that the
service is full (:class:`Overloaded`, answered 429 / RESOURCE_EXHAUSTED with Retry-After)
instead of the backlog growing. Identical requests (same content hash) share one solve
while it runs and are answered from an LRU cache afterwards. A solve that outlives its
deadline keeps running (a process cannot be interrupted safely) and still fills the cache,
but the caller gets :class:`DeadlineExceeded` on time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import math
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from planner_service.core.request import PlanRequest, debug_request
from planner_service.core.validate import PlanError
from planner_service.service.metrics import ServiceMetrics
from planner_service.service.pool import WorkerPool
from planner_service.service.schemas import FieldError, field_of
from planner_service.service.settings import Settings
from planner_service.solvers.registry import timed_solve

log = logging.getLogger("planner_service.service")

WARM_STRATEGIES = ("flashcp", "llama3", "per_doc", "ring")


class Overloaded(Exception):
    """The bounded queue is full; retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(Exception):
    """The answer was not ready within the request's deadline."""


class SolveResult(NamedTuple):
    plan_json: str
    """Canonical JSON of the plan (Plan.to_json())."""
    plan_id: str
    strategy: str
    solve_ms: float
    """Wall time of the solve that made this plan (also for cache hits)."""
    cached: bool
    headline: dict[str, Any]
    """A few plan metrics (PlanMetrics of the proto) without parsing plan_json."""


# ---- functions that run in the worker processes (module level: they are pickled) -------

def solve_in_worker(request: PlanRequest) -> tuple[str, str, float, dict[str, Any]]:
    """Solve and serialise in the worker, so the event loop only moves a string."""
    solved = timed_solve(request)
    m = solved.plan.metrics
    headline = {"imbalance": m.imbalance, "comm_tokens": m.comm_tokens,
                "full_comm_tokens": m.full_comm_tokens, "comm_saving": m.comm_saving,
                "est_step_ms": m.est_step_ms, "tokens_per_rank": m.tokens_per_rank}
    return solved.plan.to_json(), solved.plan.plan_id, solved.solve_ms, headline


def warm_worker() -> int:
    """Import the solvers and run each fast strategy once, so first requests are fast."""
    for strategy in WARM_STRATEGIES:
        timed_solve(debug_request(strategy=strategy))
    return os.getpid()


def call_in_worker(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """Run ``fn(*args)`` and time it (used for FCP scheduling)."""
    import time

    start = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - start) * 1e3


class Executor:
    """Bounded, deduplicating, caching front of the solver pool. Use from one event loop."""

    def __init__(self, settings: Settings, metrics: ServiceMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.workers = settings.workers
        self.capacity = max(1, settings.workers) + settings.queue_size
        self._pool: WorkerPool | cf.ThreadPoolExecutor | None = None
        self._depth = 0
        self._inflight: dict[str, asyncio.Future[SolveResult]] = {}
        self._cache: OrderedDict[str, SolveResult] = OrderedDict()
        self._ewma_solve_s = 0.005
        metrics.queue_capacity.set(self.capacity)

    # ---- lifecycle --------------------------------------------------------------------

    def _make_pool(self) -> WorkerPool | cf.ThreadPoolExecutor:
        if self.workers == 0:
            return cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="planner-solve")
        pool = WorkerPool(self.workers)
        pool.start()
        return pool

    async def start(self) -> None:
        """Start the workers and run one warm-up task on each (concurrently)."""
        self._pool = self._make_pool()
        pids = await asyncio.gather(*(self._submit(warm_worker)
                                      for _ in range(max(1, self.workers))))
        log.info("solver pool ready: %d worker(s) %s", self.workers, sorted(set(pids)))

    def _submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        assert self._pool is not None
        if isinstance(self._pool, WorkerPool):
            return self._pool.submit(fn, *args)
        return asyncio.wrap_future(self._pool.submit(fn, *args))

    async def close(self) -> None:
        """Wait for running solves (up to PLANNER_SHUTDOWN_GRACE_S), then stop the workers."""
        pool, self._pool = self._pool, None
        if isinstance(pool, WorkerPool):
            await pool.close(self.settings.shutdown_grace_s)
        elif pool is not None:
            await asyncio.get_running_loop().run_in_executor(None, pool.shutdown, True)

    @property
    def depth(self) -> int:
        """Solves admitted and not finished."""
        return self._depth

    @property
    def cache_entries(self) -> int:
        return len(self._cache)

    # ---- admission --------------------------------------------------------------------

    def _admit(self) -> None:
        if self._pool is None:
            raise Overloaded("the solver pool is not running (starting or shutting down)", 1)
        if self._depth >= self.capacity:
            self.metrics.rejected.labels("queue_full").inc()
            per_worker = self._depth / max(1, self.workers)
            retry = max(1, math.ceil(per_worker * self._ewma_solve_s))
            raise Overloaded(f"the solver queue is full ({self._depth} of {self.capacity} "
                             "solves admitted); retry later", retry)

    def _run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Admit and start ``fn(*args)`` on the pool; the returned future is loop-bound."""
        self._admit()
        future = self._submit(fn, *args)
        self._depth += 1
        self.metrics.queue_depth.set(self._depth)

        def release(_: asyncio.Future[Any]) -> None:
            self._depth -= 1
            self.metrics.queue_depth.set(self._depth)

        future.add_done_callback(release)
        return future

    # ---- plans ------------------------------------------------------------------------

    def submit(self, request: PlanRequest, key: str) -> asyncio.Future[SolveResult]:
        """Start (or join, or answer from cache) the solve of ``request``.

        ``key`` is its content hash (schemas.request_key). Raises Overloaded at once when
        the queue is full. The future fails with FieldError for bad input the edge could
        not see (e.g. strategy-specific options) and PlanError for a solver bug.
        """
        loop = asyncio.get_running_loop()
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.metrics.cache_hits.inc()
            done: asyncio.Future[SolveResult] = loop.create_future()
            done.set_result(hit._replace(cached=True))
            return done
        joined = self._inflight.get(key)
        if joined is not None:
            self.metrics.cache_hits.inc()
            return joined
        raw = self._run(solve_in_worker, request)
        self.metrics.cache_misses.inc()
        result: asyncio.Future[SolveResult] = loop.create_future()
        self._inflight[key] = result
        raw.add_done_callback(lambda f: self._finish(key, request.strategy, f, result))
        return result

    def _finish(self, key: str, strategy: str, raw: asyncio.Future[Any],
                result: asyncio.Future[SolveResult]) -> None:
        self._inflight.pop(key, None)
        if raw.cancelled():
            result.cancel()
            return
        exc = raw.exception()
        if exc is not None:
            if isinstance(exc, ValueError) and not isinstance(exc, PlanError):
                exc = FieldError(field_of(str(exc)), str(exc))
            result.set_exception(exc)
            result.exception()  # mark retrieved: nobody may be waiting any more
            return
        plan_json, plan_id, solve_ms, headline = raw.result()
        solved = SolveResult(plan_json, plan_id, strategy, solve_ms, False, headline)
        self._ewma_solve_s = 0.9 * self._ewma_solve_s + 0.1 * solve_ms / 1e3
        self.metrics.solve_seconds.labels(strategy).observe(solve_ms / 1e3)
        if self.settings.cache_size > 0:
            self._cache[key] = solved
            while len(self._cache) > self.settings.cache_size:
                self._cache.popitem(last=False)
            self.metrics.cache_entries.set(len(self._cache))
        result.set_result(solved)

    def timeout_for(self, requested_s: float | None, request: PlanRequest | None = None
                    ) -> float:
        """The deadline of one call: the caller's, capped at PLANNER_REQUEST_TIMEOUT_S
        (raised to 2 x options.time_limit_s + 5 s for a request that sets a limit)."""
        cap = self.settings.request_timeout_s
        limit = request.options.get("time_limit_s") if request is not None else None
        if isinstance(limit, (int, float)) and not isinstance(limit, bool):
            cap = max(cap, 2 * float(limit) + 5)
        return cap if requested_s is None or requested_s <= 0 else min(cap, requested_s)

    async def solve(self, request: PlanRequest, key: str,
                    timeout_s: float | None = None) -> SolveResult:
        """Submit and wait up to the deadline; raises Overloaded, DeadlineExceeded,
        FieldError or PlanError."""
        future = self.submit(request, key)
        return await wait_for(future, self.timeout_for(timeout_s, request))

    async def call(self, fn: Callable[..., Any], *args: Any,
                   timeout_s: float | None = None) -> tuple[Any, float]:
        """Run a picklable ``fn(*args)`` on the pool (no cache); returns (result, ms)."""
        return await wait_for(self._run(call_in_worker, fn, *args), self.timeout_for(timeout_s))

    def start_call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[tuple[Any, float]]:
        """Admit and start a picklable ``fn(*args)`` on the pool now (no cache, no
        deadline); the future gives (result, ms). Raises Overloaded at once when full."""
        return self._run(call_in_worker, fn, *args)


async def wait_for(future: asyncio.Future[Any], timeout_s: float) -> Any:
    """Await a shared future up to ``timeout_s`` without cancelling it for other waiters."""
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)
    except TimeoutError:
        raise DeadlineExceeded(f"no answer within the deadline of {timeout_s:g} s") from None
