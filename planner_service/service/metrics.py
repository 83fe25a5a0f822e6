"""Prometheus metrics of one service instance (its own registry, so tests can make many)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Solves take ~1 ms (heuristics) to the ILP time limit (seconds).
SOLVE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                 10, 30, 60)
REQUEST_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ServiceMetrics:
    """The counters, gauges and histograms listed in docs/operations.md (Metrics), on a private registry."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "planner_requests", "Requests by transport, endpoint, strategy and outcome",
            ("transport", "endpoint", "strategy", "status"), registry=r)
        self.request_seconds = Histogram(
            "planner_request_seconds", "Request latency as the server sees it",
            ("transport", "endpoint"), buckets=REQUEST_BUCKETS, registry=r)
        self.solve_seconds = Histogram(
            "planner_solve_seconds", "Solver wall time of every solve that started (cache "
            "misses), by strategy and outcome (ok, refused, error, timeout, abandoned, died)",
            ("strategy", "outcome"), buckets=SOLVE_BUCKETS, registry=r)
        self.lane_depth = Gauge(
            "planner_lane_depth", "Solves admitted and not finished, per lane (fast, slow)",
            ("lane",), registry=r)
        self.lane_waiting = Gauge(
            "planner_lane_waiting", "Solves waiting for a solver process, per lane",
            ("lane",), registry=r)
        self.lane_age = Gauge(
            "planner_lane_oldest_wait_seconds", "How long the oldest waiting solve of each "
            "lane has waited", ("lane",), registry=r)
        self.queue_depth = Gauge(
            "planner_queue_depth", "Solves admitted and not finished (running + waiting)",
            registry=r)
        self.queue_capacity = Gauge(
            "planner_queue_capacity", "Admission bound: workers + PLANNER_QUEUE_SIZE", registry=r)
        self.rejected = Counter(
            "planner_rejected", "Requests refused before solving: queue_full, client_slow "
            "(PLANNER_MAX_SLOW_PER_CLIENT), cost (a plan bound above PLANNER_MAX_PLAN_BYTES "
            "or PLANNER_MAX_SHARDS)", ("reason",), registry=r)
        self.cache_hits = Counter("planner_cache_hits", "Plans served from the cache", registry=r)
        self.cache_misses = Counter("planner_cache_misses", "Plans that needed a solve",
                                    registry=r)
        self.cache_entries = Gauge("planner_cache_entries", "Plans in the cache", registry=r)
        self.cache_bytes = Gauge("planner_cache_bytes", "Plan bytes in the cache", registry=r)
        self.fallbacks = Counter(
            "planner_fallbacks",
            "Local fallback plans that clients reported (X-Planner-Fallbacks header / "
            "metadata; reason client_reported, at most 1 per request: not a measurement)",
            ("reason",), registry=r)
        self.solver_kills = Gauge(
            "planner_solver_kills", "Solver processes stopped (and replaced) because their "
            "solve passed its deadline or every caller went away", registry=r)
        self.stream_messages = Counter(
            "planner_stream_messages", "StreamPlans messages by direction (in, out)",
            ("direction",), registry=r)
        self.stream_waits = Counter(
            "planner_stream_backpressure", "Times a StreamPlans call stopped reading because "
            "PLANNER_MAX_STREAM_PENDING messages were unanswered", registry=r)
        self.ready = Gauge("planner_ready", "1 while /readyz answers 200 (pool warm, not "
                           "draining), else 0", registry=r)
        self.jobs = Gauge("planner_jobs", "Jobs in a job store (store: plans, global)",
                          ("store",), registry=r)
        self.job_batches = Gauge("planner_job_batches", "Batches in a job store", ("store",),
                                 registry=r)
        self.job_bytes = Gauge("planner_job_bytes", "Plan bytes of finished batches in a job "
                               "store", ("store",), registry=r)
        self.job_evictions = Counter("planner_job_evictions", "Job batches evicted, by store "
                                     "and reason", ("store", "reason"), registry=r)
        self.streams_pending = Gauge(
            "planner_streams_pending", "Unanswered StreamPlans messages of all streams",
            registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
