"""Service settings from ``PLANNER_*`` environment variables (pydantic-settings).

Built by :func:`load_settings`, never at import time, so tests and the CLI can override
any field. Every name here is documented in docs/settings.md, whose table is generated from
this class (``python -m planner_service.service.settings_doc``); deploy manifests use them.
"""

from __future__ import annotations

import os

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from planner_service.core.request import MAX_FCP_RANKS, MAX_TOKENS


def _default_workers() -> int:
    """CPUs - 1, at least 1 and at most 8."""
    # One core stays with the event loop (HTTP, gRPC, JSON); the rest solve.
    return max(1, min(8, (os.cpu_count() or 2) - 1))


class Settings(BaseSettings):
    """Everything an operator can set; env prefix ``PLANNER_`` (e.g. ``PLANNER_HTTP_PORT``)."""

    model_config = SettingsConfigDict(env_prefix="PLANNER_", extra="ignore", frozen=True)

    host: str = "127.0.0.1"
    """Address both servers bind to; localhost unless an operator opens it up."""
    http_port: int = Field(8000, ge=0, le=65535)
    """HTTP port (0: any free port)."""
    grpc_port: int = Field(50051, ge=0, le=65535)
    """gRPC port (0: any free port; -1 is not allowed, set grpc_enabled=false instead)."""
    grpc_enabled: bool = True
    """Serve gRPC at all; false: HTTP only."""
    workers: int = Field(default_factory=_default_workers, ge=0, le=256)
    """Solver processes; 0 solves in one thread of the server process (tests, debugging)."""
    queue_size: int = Field(64, ge=0, le=100_000)
    """Solves that may wait beyond one per worker; more answer 429 / RESOURCE_EXHAUSTED."""
    fast_workers: int = Field(1, ge=0, le=64)
    """Solver processes reserved for the fast lane (cheap strategies within
    PLANNER_FAST_LANE_MAX_WORK), on top of ``workers``: a cheap plan never waits behind a
    slow solve. 0: no reservation (every solve shares ``workers``)."""
    fast_lane_max_work: int = Field(65_536, ge=1, le=2**40)
    """Documents x ranks up to which a heuristic strategy (baselines, flashcp, auto) runs
    in the fast lane; larger requests, ilp, fcp and FCP schedules run in the slow lane."""
    slow_queue_size: int = Field(8, ge=0, le=100_000)
    """Slow-lane solves that may wait beyond one per (unreserved) worker; more answer 429."""
    max_slow_per_client: int = Field(4, ge=1, le=100_000)
    """Slow-lane solves one client (peer address) may have admitted at once (a
    /v1/compare of every strategy takes up to 3); more answer 429 for that client only.
    Waiting slow solves start round-robin over clients."""
    ready_max_queue_age_s: float = Field(5.0, gt=0, le=3600)
    """/readyz answers 503 while a fast-lane solve has waited longer than this."""
    request_timeout_s: float = Field(60.0, gt=0, le=3600)
    """Deadline of one solve, queueing included, unless the caller asks for less (and at
    least options.time_limit_s + 5 s for a request that sets one). Heuristics answer
    in milliseconds; the ILP ends within its time_limit_s (default 10 s) plus about 1 s."""
    max_docs: int = Field(65_536, ge=1, le=10_000_000)
    """Documents per request (per sequence for /v1/schedule)."""
    max_cp_size: int = Field(1024, ge=1, le=MAX_FCP_RANKS)
    """Largest ``cp_size`` (never above 1024) and ``num_ranks`` of /v1/schedule and the
    global-batch jobs (never above FCP's rank limit, 16384)."""
    max_tokens: int = Field(16 * 2**20, ge=1, le=MAX_TOKENS)
    """Total tokens of one request."""
    max_sequences: int = Field(1024, ge=1, le=1_000_000)
    """Sequences of one /v1/schedule batch."""
    max_time_limit_s: float = Field(30.0, gt=0, le=3600)
    """Largest ``options.time_limit_s`` a caller may ask of a strategy (e.g. ilp)."""
    max_body_bytes: int = Field(4 * 2**20, ge=1024, le=2**31)
    """HTTP request bodies and gRPC messages above this answer 413 / RESOURCE_EXHAUSTED."""
    body_timeout_s: float = Field(30.0, gt=0, le=3600)
    """An HTTP request body not complete this long after its headers answers 408 and the
    connection is closed (a client trickling its body cannot hold a connection forever)."""
    header_timeout_s: float = Field(10.0, gt=0, le=3600)
    """An HTTP connection whose request line and headers are not complete this long after
    it opened (or after its previous response) is closed (slowloris)."""
    max_wait_ms: int = Field(30_000, ge=0, le=600_000)
    """Longest long-poll of GET /v1/jobs/{job}/batches/{batch}."""
    token: SecretStr | None = None
    """Bearer token required on every endpoint but /healthz, /readyz and the static page."""
    job_ttl_s: float = Field(600.0, gt=0, le=7 * 86400)
    """Finished job batches are dropped this long after they finish."""
    max_jobs: int = Field(1024, ge=1, le=1_000_000)
    """Jobs tracked at once; the least recently used job is evicted beyond it."""
    max_batches_per_job: int = Field(8, ge=1, le=10_000)
    """Batches kept per job; a job's oldest batches are evicted beyond it."""
    job_memory_mb: float = Field(256.0, gt=0, le=1_000_000)
    """Bound on the plan bytes the job store holds; oldest finished batches go first."""
    cache_size: int = Field(4096, ge=0, le=10_000_000)
    """Plans kept in the content-hash cache (0 disables it)."""
    cache_mb: float = Field(256.0, gt=0, le=1_000_000)
    """Bound on the plan bytes the cache holds; a plan larger than this is not cached."""
    max_shards: int = Field(2**22, ge=1, le=2**40)
    """Bound on 2 x documents x cp_size of one request (the most shards any strategy may
    make: per_doc splits every document in 2 x cp_size chunks); refused up front above it."""
    max_plan_bytes: int = Field(64 * 2**20, ge=1024, le=2**34)
    """A plan whose JSON is larger than this is refused (422): before its solve where the
    strategy's plan size follows from the request (per_doc, zigzag, llama3, ring;
    service/cost_gate.py), else after it."""
    max_client_job_mb: float = Field(64.0, gt=0, le=1_000_000)
    """Plan bytes one client's finished batches may hold in a job store (each store:
    single plans and global batches); beyond it that client's oldest batches are evicted,
    never another client's."""
    max_streams_pending: int = Field(256, ge=1, le=10_000_000)
    """Unanswered messages of all StreamPlans calls together; a stream stops being read
    while the total is at this bound."""
    max_jobs_per_client: int = Field(64, ge=1, le=1_000_000)
    """Jobs one client (one peer address) may hold at once; beyond it that client's least
    recently used job is evicted, never another client's."""
    max_stream_pending: int = Field(32, ge=1, le=100_000)
    """Unanswered messages of one StreamPlans call; the server stops reading the stream
    (HTTP/2 back-pressure on the sender) until replies catch up."""
    max_json_depth: int = Field(32, ge=2, le=1000)
    """Deepest nesting of arrays and objects accepted in a JSON body or JSON field."""
    fcp_profiles: tuple[str, ...] = ()
    """Files of fitted FCP profiles (JSON list of paths) the operator offers by name: read
    once at start; requests name them (options.profile) but never send paths."""
    shutdown_grace_s: float = Field(10.0, ge=0, le=3600)
    """On SIGTERM: readiness turns false, then in-flight requests get this long to finish."""
    log_level: str = "info"
    """Log level of the server (debug, info, warning, error)."""
    test_hooks: bool = False
    """Register the test strategy ``test_hang`` (service/test_hooks.py) in the server and
    its solver processes, once at start: for the tests of deadlines and shutdown, which
    run the server as a child process. Never set it in production."""

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.grpc_enabled and self.http_port and self.http_port == self.grpc_port:
            raise ValueError(f"http_port and grpc_port must differ, both are {self.http_port}")
        return self

    def token_value(self) -> str | None:
        return self.token.get_secret_value() if self.token is not None else None


def load_settings(**overrides: object) -> Settings:
    """Read the environment, then apply ``overrides`` (field name -> value).

    Raises pydantic.ValidationError naming the variable for a bad value.
    """
    return Settings(**overrides)  # type: ignore[arg-type]
