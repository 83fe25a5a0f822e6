"""One-batch-ahead job store: submit batch i+1 now, fetch its plan later.

A job is a training run; a batch id names one packed sequence of it. Submitting the same
content again is idempotent (same entry, same plan); different content under a batch id
already used is a :class:`Conflict`. Finished plans live ``ttl_s``; memory is bounded by
the number of jobs (least recently used evicted), batches per job (oldest evicted) and the
bytes of stored plans. Each client (peer address) holds at most ``max_jobs_per_client``
jobs and ``max_client_bytes`` plan bytes: beyond either bound that client's least recently
used job (or its oldest finished batch) goes; and when the whole store is full, the job
or batch evicted is one of the client holding the most (jobs or bytes). So one client
flooding job ids or submitting huge batches evicts its own, never another client's.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from planner_service.core.errors import FieldError
from planner_service.core.solved import SolvedPlan
from planner_service.service.executor import DeadlineExceeded, wait_for
from planner_service.service.metrics import ServiceMetrics

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
ENTRY_OVERHEAD_BYTES = 512
"""Bookkeeping charged per batch on top of its plan bytes."""


class Conflict(Exception):
    """A batch id was reused with different content."""


class NotFound(Exception):
    """Unknown job or batch (never submitted, expired or evicted)."""


def check_id(value: str, name: str) -> str:
    """Job and batch ids: 1-128 characters of [A-Za-z0-9_.:-]; raises FieldError."""
    if not isinstance(value, str) or not ID_PATTERN.match(value):
        raise FieldError(name, f"{name} must be 1-128 characters of letters, digits and "
                         f"_.:- starting with a letter or digit, got {value!r}")
    return value


@dataclass(eq=False)
class BatchEntry:
    job: str
    batch: str
    key: str
    """Content hash of the request (schemas.request_key)."""
    future: asyncio.Future[SolvedPlan]
    deadline: float
    """Monotonic time after which a pending batch is reported as failed."""
    finished_at: float | None = None
    size: int = ENTRY_OVERHEAD_BYTES
    evicted: bool = field(default=False)
    client: str = ""
    """The client (peer address) that owns its job."""

    @property
    def status(self) -> str:
        if not self.future.done():
            return "pending"
        if self.future.cancelled() or self.future.exception() is not None:
            return "failed"
        return "done"

    @property
    def plan_id(self) -> str | None:
        return self.future.result().plan_id if self.status == "done" else None


class JobStore:
    """Batches by job, with TTL and memory bounds. Use from one event loop."""

    def __init__(self, *, ttl_s: float, max_jobs: int, max_batches_per_job: int,
                 memory_bytes: int, deadline_s: float, metrics: ServiceMetrics,
                 clock: Callable[[], float] = time.monotonic,
                 max_jobs_per_client: int | None = None,
                 max_client_bytes: int | None = None, store: str = "plans") -> None:
        """A store bounded by the operator's settings.

        Args:
            ttl_s: finished batches are dropped this long after they finish.
            max_jobs: jobs held at once; the least recently used one is evicted beyond it.
            max_batches_per_job: batches kept per job; its oldest are evicted beyond it.
            memory_bytes: bound on the answer bytes held; oldest finished batches go first.
            deadline_s: how long a batch may stay pending.
            metrics: the service's metrics (job gauges and evictions).
            clock: the time source (monotonic seconds; tests move it).
            max_jobs_per_client: jobs one client may hold (None: ``max_jobs``).
            max_client_bytes: answer bytes one client's finished batches may hold (None:
                ``memory_bytes``).
            store: the ``store`` label of the metrics (plans or global).
        """
        self.ttl_s = ttl_s
        self.max_jobs = max_jobs
        self.max_batches_per_job = max_batches_per_job
        self.memory_bytes = memory_bytes
        self.deadline_s = deadline_s
        self.metrics = metrics
        self.clock = clock
        self.max_jobs_per_client = max_jobs_per_client or max_jobs
        self.max_client_bytes = max_client_bytes or memory_bytes
        self.store = store
        """The ``store`` label of this store's metrics (plans or global)."""
        self._client_bytes: dict[str, int] = {}
        """client -> bytes of its finished batches."""
        self._client_finished: dict[str, deque[BatchEntry]] = {}
        """client -> its finished batches in finishing order (its eviction order)."""
        self._jobs: OrderedDict[str, OrderedDict[str, BatchEntry]] = OrderedDict()
        self._owner: dict[str, str] = {}
        """job -> the client that created it."""
        self._by_client: dict[str, OrderedDict[str, None]] = {}
        """client -> its jobs, least recently used first."""
        self._finished: deque[BatchEntry] = deque()
        """Finished entries in finishing order: the TTL and memory eviction order."""
        self._bytes = 0
        self._num_batches = 0

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    @property
    def num_batches(self) -> int:
        return self._num_batches

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def submit(self, job: str, batch: str, key: str,
               start: Callable[[], asyncio.Future[SolvedPlan]], client: str = ""
               ) -> tuple[BatchEntry, bool]:
        """Register a batch and start its solve with ``start()``; returns (entry, created).

        Raises FieldError for bad ids, Conflict if the batch exists with other content,
        and whatever ``start`` raises (Overloaded) without registering anything.
        """
        check_id(job, "job")
        check_id(batch, "batch")
        self.sweep()
        batches = self._jobs.get(job)
        if batches is not None:
            self._touch(job)
            existing = batches.get(batch)
            if existing is not None:
                if existing.key != key:
                    raise Conflict(f"batch {batch!r} of job {job!r} was already submitted with "
                                   "different content; use a new batch id")
                if existing.status != "failed":
                    return existing, False
                self._drop(existing, "resubmitted")  # a failed batch may be retried
                batches = self._jobs.get(job)
        future = start()
        if batches is None:
            batches = self._jobs[job] = OrderedDict()
            self._owner[job] = client
            self._by_client.setdefault(client, OrderedDict())[job] = None
        entry = BatchEntry(job=job, batch=batch, key=key, future=future,
                           deadline=self.clock() + self.deadline_s, client=self._owner[job])
        batches[batch] = entry
        self._num_batches += 1
        future.add_done_callback(lambda _: self._on_done(entry))
        while len(batches) > self.max_batches_per_job:
            self._drop(next(iter(batches.values())), "job_window")
        owner = self._owner[job]
        while len(self._by_client.get(owner, ())) > self.max_jobs_per_client:
            self._drop_job(next(iter(self._by_client[owner])), "client_jobs")
        while len(self._jobs) > self.max_jobs:
            biggest = max(self._by_client.values(), key=len)
            self._drop_job(next(iter(biggest)), "max_jobs")
        self._gauges()
        return entry, True

    def _touch(self, job: str) -> None:
        self._jobs.move_to_end(job)
        self._by_client[self._owner[job]].move_to_end(job)

    def _drop_job(self, job: str, reason: str) -> None:
        for old in list(self._jobs[job].values()):
            self._drop(old, reason)

    def get(self, job: str, batch: str) -> BatchEntry:
        """The entry of a batch; raises FieldError for bad ids and NotFound."""
        check_id(job, "job")
        check_id(batch, "batch")
        self.sweep()
        batches = self._jobs.get(job)
        entry = batches.get(batch) if batches is not None else None
        if entry is None:
            raise NotFound(f"batch {batch!r} of job {job!r} is unknown: never submitted, "
                           "expired or evicted")
        return entry

    async def fetch(self, job: str, batch: str, wait_s: float) -> BatchEntry:
        """Wait up to ``wait_s`` for the batch to finish and return its entry (maybe pending).

        A batch pending past its deadline fails with DeadlineExceeded.
        """
        entry = self.get(job, batch)
        if entry.status == "pending":
            remaining = entry.deadline - self.clock()
            if remaining <= 0:
                raise DeadlineExceeded(f"batch {batch!r} of job {job!r} was not solved within "
                                       f"{self.deadline_s:g} s")
            try:
                await wait_for(entry.future, min(wait_s, remaining))
            except DeadlineExceeded:
                pass
            except Exception:  # noqa: BLE001 - the failure is reported from the entry
                pass
        return entry

    def client_bytes(self, client: str) -> int:
        """Bytes of ``client``'s finished batches."""
        return self._client_bytes.get(client, 0)

    def _evict_oldest_of(self, client: str, reason: str) -> bool:
        """Evict ``client``'s oldest finished batch; False if it has none."""
        queue = self._client_finished.get(client)
        while queue:
            entry = queue.popleft()
            if not entry.evicted:
                self._drop(entry, reason)
                return True
        return False

    def sweep(self) -> None:
        """Drop finished batches past their TTL, then a client's oldest beyond its byte
        bound, then the biggest client's oldest beyond the store's byte bound."""
        now = self.clock()
        while self._finished:
            oldest = self._finished[0]
            finished = oldest.finished_at if oldest.finished_at is not None else now
            if not oldest.evicted and finished + self.ttl_s > now:
                break
            self._finished.popleft()
            if not oldest.evicted:
                self._drop(oldest, "ttl")
        for client in [c for c, b in self._client_bytes.items() if b > self.max_client_bytes]:
            while self.client_bytes(client) > self.max_client_bytes \
                    and self._evict_oldest_of(client, "client_memory"):
                pass
        while self._bytes > self.memory_bytes and self._client_bytes:
            biggest = max(self._client_bytes, key=self._client_bytes.__getitem__)
            if not self._evict_oldest_of(biggest, "memory"):
                break
        self._gauges()

    def _on_done(self, entry: BatchEntry) -> None:
        if entry.evicted:
            return
        entry.finished_at = self.clock()
        if entry.status == "done":
            entry.size += len(entry.future.result().plan_json)
        self._bytes += entry.size
        self._client_bytes[entry.client] = self.client_bytes(entry.client) + entry.size
        self._finished.append(entry)
        self._client_finished.setdefault(entry.client, deque()).append(entry)
        self.sweep()

    def _drop(self, entry: BatchEntry, reason: str) -> None:
        if entry.evicted:
            return
        entry.evicted = True
        batches = self._jobs.get(entry.job)
        if batches is not None and batches.get(entry.batch) is entry:
            del batches[entry.batch]
            self._num_batches -= 1
            if not batches:
                del self._jobs[entry.job]
                owner = self._owner.pop(entry.job)
                jobs = self._by_client[owner]
                del jobs[entry.job]
                if not jobs:
                    del self._by_client[owner]
        if entry.finished_at is not None:
            self._bytes -= entry.size
            left = self._client_bytes.get(entry.client, 0) - entry.size
            if left > 0:
                self._client_bytes[entry.client] = left
            else:
                self._client_bytes.pop(entry.client, None)
                self._client_finished.pop(entry.client, None)
        self.metrics.job_evictions.labels(self.store, reason).inc()

    def _gauges(self) -> None:
        self.metrics.jobs.labels(self.store).set(len(self._jobs))
        self.metrics.job_batches.labels(self.store).set(self._num_batches)
        self.metrics.job_bytes.labels(self.store).set(self._bytes)
