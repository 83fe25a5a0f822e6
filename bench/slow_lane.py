"""Part 4 of ``bench.service_load``: cheap plans while the slow lane is full.

    python -m bench.service_load --only-slow-lane     # this part alone (about 1 min)

A ``planner serve`` with one solver process plus the fast lane's reserved one (the 2-core
setting), cache off. As many slow requests as the slow lane admits stay in flight (each
sender resubmits as soon as it is answered): ILP at the largest allowed time limit, FCP
schedules of 1,024 sequences and ``auto`` on 2M tokens at N = 1,024, in turn. Beside them
a paced client asks for small flashcp plans (a different sequence each time); their
latency percentiles are the result (target: p99 <= 100 ms).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from typing import NamedTuple

import numpy as np

from planner_service.data import make_source, pack_sequences
from planner_service.service.testing import ServerProcess

SECTION = "## Cheap plans beside a full slow lane"


class SlowLaneResult(NamedTuple):
    fast_workers: int
    cheap_ms: np.ndarray
    cheap_errors: dict[str, int]
    slow_answers: dict[str, dict[str, int]]
    """Slow kind -> status -> count."""
    slow_in_flight: int
    seconds: float
    load_avg: tuple[float, ...]


async def post(host: str, port: int, path: str, body: bytes, timeout_s: float) -> int:
    """One request on its own connection; its HTTP status (0 on a timeout)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (TimeoutError, OSError):
        return 0
    try:
        writer.write((f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                      f"application/json\r\nContent-Length: {len(body)}\r\nConnection: "
                      f"close\r\n\r\n").encode() + body)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout_s)
        await asyncio.wait_for(reader.read(), timeout_s)
        return int(line.split()[1])
    except (TimeoutError, OSError, IndexError, ValueError):
        return 0
    finally:
        writer.close()


def slow_bodies(max_time_limit_s: float) -> dict[str, tuple[str, bytes]]:
    """The slow kinds: (path, body)."""
    ilp = pack_sequences(make_source("wlbllm"), context_length=32768, num_sequences=1,
                         seed=7)[0]
    big = pack_sequences(make_source("wlbllm"), context_length=2 * 2**20, num_sequences=1,
                         seed=7)[0]
    seqs = pack_sequences(make_source("wlbllm"), context_length=8192, num_sequences=1024,
                          seed=7)
    return {
        "ilp": ("/v1/plan", json.dumps({"doc_lengths": ilp, "cp_size": 8, "strategy": "ilp",
                                        "options": {"time_limit_s": max_time_limit_s}}).encode()),
        "fcp": ("/v1/schedule", json.dumps({"sequences": seqs, "num_ranks": 64,
                                            "memory_tokens": 8192}).encode()),
        "auto": ("/v1/plan", json.dumps({"doc_lengths": big, "cp_size": 1024,
                                         "strategy": "auto"}).encode()),
    }


async def _scenario(server: ServerProcess, in_flight: int, duration_s: float, rate: float,
                    max_time_limit_s: float) -> tuple[list[float], dict[str, int],
                                                      dict[str, dict[str, int]]]:
    host, port_text = server.http_url.removeprefix("http://").split(":")
    port = int(port_text)
    kinds = slow_bodies(max_time_limit_s)
    answers: dict[str, dict[str, int]] = {k: {} for k in kinds}
    stop_at = time.perf_counter() + duration_s

    async def slow_sender(kind: str) -> None:
        path, body = kinds[kind]
        while time.perf_counter() < stop_at:
            status = await post(host, port, path, body, 120.0)
            answers[kind][str(status)] = answers[kind].get(str(status), 0) + 1
            if status == 429:
                await asyncio.sleep(0.2)

    cheap = pack_sequences(make_source("wlbllm"), context_length=32768, num_sequences=4000,
                           seed=8)
    feed = itertools.cycle(json.dumps({"doc_lengths": s, "cp_size": 8,
                                       "strategy": "flashcp"}).encode() for s in cheap)
    latencies: list[float] = []
    errors: dict[str, int] = {}

    async def cheap_sender() -> None:
        await asyncio.sleep(3.0)  # the slow requests are admitted first
        start = time.perf_counter()
        for k in itertools.count():
            due = start + k / rate
            if due >= stop_at:
                return
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            sent = time.perf_counter()
            status = await post(host, port, "/v1/plan", next(feed), 30.0)
            if status == 200:
                latencies.append((time.perf_counter() - sent) * 1e3)
            else:
                errors[str(status)] = errors.get(str(status), 0) + 1

    order = itertools.cycle(kinds)
    senders = [slow_sender(next(order)) for _ in range(in_flight)]
    cheap_tasks = [cheap_sender()]
    await asyncio.gather(*senders, *cheap_tasks)
    return latencies, errors, answers


def run_slow_lane(duration_s: float = 40.0, rate: float = 10.0, fast_workers: int = 1
                  ) -> SlowLaneResult:
    """Start the server (``fast_workers`` reserved fast-lane processes), run the
    scenario, stop it."""
    load_avg = os.getloadavg()
    slow_queue, max_limit = 4, 30.0
    in_flight = 1 + slow_queue  # the slow lane's worker plus its queue
    env = {"PLANNER_CACHE_SIZE": "0", "PLANNER_SLOW_QUEUE_SIZE": str(slow_queue),
           "PLANNER_MAX_SLOW_PER_CLIENT": str(in_flight), "PLANNER_REQUEST_TIMEOUT_S": "120",
           "PLANNER_MAX_TIME_LIMIT_S": str(max_limit), "PLANNER_FAST_WORKERS": str(fast_workers)}
    with ServerProcess(workers=1, env=env) as server:
        started = time.perf_counter()
        lat, errors, answers = asyncio.run(_scenario(server, in_flight, duration_s, rate,
                                                     max_limit))
        seconds = time.perf_counter() - started
    return SlowLaneResult(fast_workers, np.asarray(lat), errors, answers, in_flight, seconds,
                          load_avg)


def section(results: list[SlowLaneResult], command: str) -> str:
    """The Markdown section of part 4: one row per server configuration."""
    first = results[0]
    lines = [
        SECTION, "",
        f"Command: `{command}`. {os.cpu_count()} CPUs shared with other jobs. Server: 1 "
        "solver process plus PLANNER_FAST_WORKERS reserved for the fast lane (0: no "
        f"reservation, every solve first come first served), cache off; {first.slow_in_flight} "
        "slow requests in flight throughout (the slow lane's worker and queue: ILP at "
        "time_limit_s 30, FCP schedules of 1,024 sequences, auto on 2M tokens at N = 1,024, "
        "each resubmitted as soon as answered) while small flashcp plans (32K tokens, N = 8) "
        "are asked for at 10/s.", "",
        "| fast workers | load average before | cheap plans | p50 ms | p90 ms | p99 ms | "
        "max ms | errors | slow answers by status |",
        "|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for r in results:
        lat = r.cheap_ms

        def pct(q: float, lat: np.ndarray = lat) -> str:
            return f"{np.percentile(lat, q):.1f}" if len(lat) else "-"

        slow = "; ".join(f"{kind} {dict(sorted(s.items()))}"
                         for kind, s in r.slow_answers.items())
        lines.append(f"| {r.fast_workers} | {', '.join(f'{x:.2f}' for x in r.load_avg)} | "
                     f"{len(lat)} | {pct(50)} | {pct(90)} | {pct(99)} | {pct(100)} | "
                     f"{r.cheap_errors or 0} | {slow} |")
    lines += ["", "Status 0: no answer within the sender's timeout (30 s for a cheap plan, "
              "120 s for a slow request). With 0 fast workers a cheap plan still goes ahead "
              "of waiting slow solves but waits for the running one.", ""]
    return "\n".join(lines)


def splice(text: str, new_section: str) -> str:
    """``text`` with its part-4 section replaced by ``new_section`` (or appended)."""
    head, found, rest = text.partition(SECTION)
    if not found:
        return text.rstrip("\n") + "\n\n" + new_section
    tail = rest.find("\n## ")
    return head + new_section + (rest[tail + 1:] if tail >= 0 else "")
