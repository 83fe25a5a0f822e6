"""Load test of the planner's HTTP API: concurrent clients mixing plan, compare and job calls.

    python -m bench.load_test --spawn                      # 64 clients, 60 s, own server
    python -m bench.load_test --spawn --overload           # 1 worker, tiny queue: 429s expected
    python -m bench.load_test --url http://127.0.0.1:8000 --server-pid PID

Each client loops until the deadline: it picks a call by the mix weights and sends a
packed sequence drawn from a data set (``planner_service.data``): ``POST /v1/plan``,
``POST /v1/compare`` (cheap strategies only), or a job round trip (``PUT`` a batch, then
long-poll ``GET`` it). It reports p50/p90/p99/max latency per call, answers by status,
and the server's RSS (server plus its solver processes, from /proc) over time.

An error is any transport failure or non-2xx answer, except 429 in ``--overload`` mode
(deliberate overload, where shedding is the contract). Exit status 1 if there were errors.
Traffic goes only to the given URL, meant to be loopback; the run stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import numpy as np

from planner_service.data import make_source, pack_sequences

CALLS = ("plan", "compare", "job")
PLAN_STRATEGIES = ("flashcp", "flashcp", "flashcp", "llama3", "per_doc")
COMPARE_STRATEGIES = ["llama3", "per_doc", "zigzag", "flashcp"]
PATHS = {"plan": "/v1/plan", "compare": "/v1/compare",
         "job": "/v1/jobs/{job}/batches/{batch}"}
OVERLOAD_ENV = {"PLANNER_WORKERS": "1", "PLANNER_QUEUE_SIZE": "2"}


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    """One load-test run; every field is a command-line flag."""

    url: str
    clients: int = 64
    duration_s: float = 60.0
    mix: dict[str, float] = field(default_factory=lambda: {"plan": 0.6, "compare": 0.1,
                                                           "job": 0.3})
    dataset: str = "wlbllm"
    context_length: int = 65536
    cp_size: int = 8
    pool: int = 2048
    """Packed sequences drawn from the data set."""
    repeat_fraction: float = 0.25
    """Calls that resend a pooled body verbatim (cache hits, as ranks of one group asking for
    the same batch); the others shuffle its doc order, a new batch for the solver."""
    seed: int = 0
    overload: bool = False
    token: str | None = None
    timeout_s: float = 30.0
    job_wait_ms: int = 5000

    def __post_init__(self) -> None:
        if self.clients < 1 or self.duration_s <= 0 or self.pool < 1:
            raise ValueError("clients, duration_s and pool must be positive")
        if not 0 <= self.repeat_fraction <= 1:
            raise ValueError(f"repeat_fraction must be in [0, 1], got {self.repeat_fraction}")
        if set(self.mix) - set(CALLS) or sum(self.mix.values()) <= 0:
            raise ValueError(f"mix must weight calls among {CALLS}, got {self.mix}")


class Sample(NamedTuple):
    call: str
    """plan, compare, job_put, job_get or job (the whole round trip)."""
    status: str
    """HTTP status code, or the exception's class name for a transport failure."""
    seconds: float
    at: float
    """Seconds since the start of the run."""


class CallStats(NamedTuple):
    call: str
    num_calls: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    statuses: dict[str, int]


def make_bodies(config: LoadConfig) -> list[dict[str, Any]]:
    """``config.pool`` plan bodies from packed sequences of the data set."""
    source = make_source(config.dataset)
    sequences = pack_sequences(source, context_length=config.context_length,
                               num_sequences=config.pool, seed=config.seed)
    rng = random.Random(config.seed)
    return [{"doc_lengths": [int(x) for x in seq], "cp_size": config.cp_size,
             "strategy": rng.choice(PLAN_STRATEGIES), "context_length": config.context_length}
            for seq in sequences]


def is_error(status: str, overload: bool) -> bool:
    return not (status.startswith("2") or (overload and status == "429"))


def summarize(samples: Sequence[Sample]) -> list[CallStats]:
    """Latency percentiles and status counts per call, in a fixed call order."""
    by_call: dict[str, list[Sample]] = defaultdict(list)
    for sample in samples:
        by_call[sample.call].append(sample)
    out = []
    for call in ("plan", "compare", "job_put", "job_get", "job"):
        rows = by_call.get(call)
        if not rows:
            continue
        ms = np.array([s.seconds * 1e3 for s in rows])
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        out.append(CallStats(call, len(rows), float(p50), float(p90), float(p99),
                             float(ms.max()), dict(Counter(s.status for s in rows))))
    return out


# ---- server memory ------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def tree_rss_mb(pid: int) -> float:
    """RSS of ``pid`` and all its descendants in MiB (Linux /proc); 0 if it is gone."""
    total_kb, stack, seen = 0, [pid], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
        except OSError:
            continue
        stack += _children(current)
    return total_kb / 1024


async def sample_rss(pid: int, start: float, stop: asyncio.Event,
                     out: list[tuple[float, float]], period_s: float = 1.0) -> None:
    while not stop.is_set():
        out.append((time.monotonic() - start, tree_rss_mb(pid)))
        try:
            await asyncio.wait_for(stop.wait(), period_s)
        except TimeoutError:
            pass


# ---- clients ------------------------------------------------------------------------------

async def timed(client: httpx.AsyncClient, call: str, method: str, url: str, start: float,
                samples: list[Sample], **kwargs: Any) -> httpx.Response | None:
    began = time.monotonic()
    try:
        response = await client.request(method, url, **kwargs)
        status = str(response.status_code)
    except httpx.HTTPError as exc:
        response, status = None, type(exc).__name__
    samples.append(Sample(call, status, time.monotonic() - began, began - start))
    return response


async def job_round_trip(client: httpx.AsyncClient, config: LoadConfig, body: dict[str, Any],
                         job: str, batch: str, start: float, samples: list[Sample]) -> None:
    """PUT a batch, then long-poll GET until its plan (200), an error or the deadline."""
    began = time.monotonic()
    url = PATHS["job"].format(job=job, batch=batch)
    response = await timed(client, "job_put", "PUT", url, start, samples, json=body)
    status = _status(response)
    if status in ("200", "202"):  # accepted (202) or already planned (200)
        while True:
            response = await timed(client, "job_get", "GET", url, start, samples,
                                   params={"wait_ms": config.job_wait_ms})
            status = _status(response)
            if status != "202" or time.monotonic() - began > config.timeout_s:
                break
        if status == "202":
            status = "pending_at_deadline"
    samples.append(Sample("job", status, time.monotonic() - began, began - start))


def _status(response: httpx.Response | None) -> str:
    return "no_answer" if response is None else str(response.status_code)


async def client_loop(index: int, client: httpx.AsyncClient, config: LoadConfig,
                      bodies: list[dict[str, Any]], start: float, samples: list[Sample]) -> None:
    rng = random.Random(config.seed * 7919 + index)
    calls, weights = zip(*config.mix.items(), strict=True)
    batch = 0
    while time.monotonic() - start < config.duration_s:
        body = bodies[rng.randrange(len(bodies))]
        if rng.random() >= config.repeat_fraction:
            lengths = list(body["doc_lengths"])
            rng.shuffle(lengths)
            body = {**body, "doc_lengths": lengths}
        call = rng.choices(calls, weights)[0]
        if call == "plan":
            await timed(client, "plan", "POST", PATHS["plan"], start, samples, json=body)
        elif call == "compare":
            await timed(client, "compare", "POST", PATHS["compare"], start, samples,
                        json={**body, "strategies": COMPARE_STRATEGIES})
        else:
            batch += 1
            await job_round_trip(client, config, body, f"load-{config.seed}-{index}",
                                 f"b{batch}", start, samples)


async def check_paths(client: httpx.AsyncClient) -> None:
    """Fail early, naming the paths, if the server's OpenAPI spec lacks the ones we call."""
    spec = (await client.get("/openapi.json")).raise_for_status().json()
    missing = [p for p in PATHS.values() if p not in spec.get("paths", {})]
    if missing:
        raise SystemExit(f"server lacks {missing}; it has {sorted(spec.get('paths', {}))}")


async def run_load(config: LoadConfig, server_pid: int | None
                   ) -> tuple[list[Sample], list[tuple[float, float]], float]:
    """Run the clients; returns the samples, the RSS series and the wall time."""
    bodies = make_bodies(config)
    headers = {"Authorization": f"Bearer {config.token}"} if config.token else {}
    limits = httpx.Limits(max_connections=config.clients, max_keepalive_connections=config.clients)
    samples: list[Sample] = []
    rss: list[tuple[float, float]] = []
    async with httpx.AsyncClient(base_url=config.url, headers=headers, limits=limits,
                                 timeout=config.timeout_s) as client:
        await check_paths(client)
        start = time.monotonic()
        stop = asyncio.Event()
        sampler = (asyncio.create_task(sample_rss(server_pid, start, stop, rss))
                   if server_pid else None)
        await asyncio.gather(*(client_loop(i, client, config, bodies, start, samples)
                               for i in range(config.clients)))
        wall = time.monotonic() - start
        stop.set()
        if sampler:
            await sampler
    return samples, rss, wall


# ---- report -------------------------------------------------------------------------------

def report(config: LoadConfig, samples: Sequence[Sample], rss: Sequence[tuple[float, float]],
           wall_s: float, command: str) -> str:
    """The run as markdown: setup, latency table, errors, memory."""
    stats = summarize(samples)
    errors = Counter(f"{s.call} {s.status}" for s in samples if is_error(s.status, config.overload))
    lines = [
        f"# Load test: {config.clients} clients, {wall_s:.0f} s"
        f"{' (deliberate overload)' if config.overload else ''}", "",
        f"Command: `{command}`", "",
        f"Mix {config.mix}; {config.dataset} sequences of {config.context_length} tokens, "
        f"cp_size {config.cp_size}, pool {config.pool}, {config.repeat_fraction:.0%} verbatim "
        f"repeats; client and server on one machine with {os.cpu_count()} CPUs.", "",
        "| call | count | rps | p50 ms | p90 ms | p99 ms | max ms | answers |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in stats:
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(s.statuses.items()))
        lines.append(f"| {s.call} | {s.num_calls} | {s.num_calls / wall_s:.1f} | {s.p50_ms:.1f} | "
                     f"{s.p90_ms:.1f} | {s.p99_ms:.1f} | {s.max_ms:.1f} | {answers} |")
    lines += ["", f"Errors: {sum(errors.values())}"
              + (f" ({dict(errors)})" if errors else "")
              + (" (429s are expected in overload mode and not counted)" if config.overload
                 else "")]
    if rss:
        values = [mb for _, mb in rss]
        early = float(np.median(values[: max(1, len(values) // 6)]))
        late = float(np.median(values[-max(1, len(values) // 6):]))
        lines += ["", f"Server RSS (server + solver processes): start {values[0]:.0f} MiB, "
                  f"first-sixth median {early:.0f} MiB, last-sixth median {late:.0f} MiB, "
                  f"max {max(values):.0f} MiB ({len(values)} samples, 1 s apart)."]
    return "\n".join(lines) + "\n"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_env(config: LoadConfig) -> dict[str, str]:
    """Settings of a spawned server: overload sheds; otherwise the queue admits every client.

    Each client has at most one call in flight, and a compare fans out to one solve per
    strategy, so a queue of ``clients x len(COMPARE_STRATEGIES)`` never refuses this load.
    """
    if config.overload:
        return dict(OVERLOAD_ENV)
    return {"PLANNER_QUEUE_SIZE": str(config.clients * len(COMPARE_STRATEGIES))}


def spawn_server(settings: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """``planner serve`` on free loopback ports; returns it once /readyz answers 200."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANNER_")}
    env |= {"PLANNER_HOST": "127.0.0.1", "PLANNER_HTTP_PORT": str(port),
            "PLANNER_GRPC_PORT": str(free_port())} | settings
    process = subprocess.Popen(
        [sys.executable, "-c", "from planner_service.cli import main; main()", "serve"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"planner serve did not become ready (exit code {process.poll()})")


def parse_args(argv: Sequence[str] | None) -> tuple[LoadConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--spawn", action="store_true", help="start `planner serve` here")
    parser.add_argument("--server-pid", type=int, help="sample this process tree's RSS")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds")
    parser.add_argument("--mix", default="plan=0.6,compare=0.1,job=0.3")
    parser.add_argument("--dataset", default="wlbllm")
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--pool", type=int, default=2048)
    parser.add_argument("--repeat-fraction", type=float, default=0.25,
                        help="calls that resend a pooled body verbatim (cache hits)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overload", action="store_true",
                        help="429s are expected (with --spawn: 1 worker, queue of 2; without "
                        "it --spawn sizes the queue to admit every client)")
    parser.add_argument("--token", default=os.environ.get("PLANNER_TOKEN"))
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    args = parser.parse_args(argv)
    mix = {k: float(v) for k, v in (item.split("=") for item in args.mix.split(","))}
    config = LoadConfig(url=args.url or "", clients=args.clients, duration_s=args.duration,
                        mix=mix, dataset=args.dataset, context_length=args.context,
                        cp_size=args.cp, pool=args.pool, seed=args.seed,
                        repeat_fraction=args.repeat_fraction,
                        overload=args.overload, token=args.token)
    return config, args


def main(argv: Sequence[str] | None = None) -> int:
    config, args = parse_args(argv)
    command = "python -m bench.load_test " + " ".join(sys.argv[1:] if argv is None else argv)
    server, pid = None, args.server_pid
    if args.spawn:
        settings = server_env(config)
        server, url = spawn_server(settings)
        config, pid = replace(config, url=url), server.pid
    try:
        samples, rss, wall = asyncio.run(run_load(config, pid))
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
    text = report(config, samples, rss, wall, command)
    if server is not None:
        text += (f"\nSpawned server: `planner serve` with {settings} (other settings default), "
                 f"exit code after SIGTERM: {server.returncode}.\n")
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 1 if any(is_error(s.status, config.overload) for s in samples) else 0


if __name__ == "__main__":
    sys.exit(main())
