"""Service latency and throughput, and what a training loop waits for its plans.

    python -m bench.service_load                      # the acceptance run (about 2 min)
    python -m bench.service_load --duration 5 --train-steps 20 --out /tmp/smoke.md

Part 1: ``--clients`` concurrent clients on loopback ask for ``--context`` token FlashCP
plans at N = ``--cp`` for ``--duration`` seconds, over HTTP (keep-alive HTTP/1.1, a raw
asyncio client so that the load generator stays cheap) and over gRPC (grpc.aio, one
channel). Every request is a different packed sequence of the data set and the server's
cache is off (PLANNER_CACHE_SIZE=0): each answer is a real solve.

Part 2: a simulated training loop with ``--step-ms`` steps prefetches the next batch's
plan through PlanClient and measures how long ``get`` waits, over HTTP and gRPC.

Part 3: the same loop while the server is SIGKILLed and restarted on the same ports:
the loop must keep its pace on fallback plans and return to service plans.

Part 4 (``bench.slow_lane``): small flashcp plans while as many slow requests (ILP at the
largest time limit, FCP schedules of 1,024 sequences, ``auto`` at 2M tokens / N = 1,024)
as the slow lane admits stay in flight; ``--only-slow-lane`` runs it alone and replaces
its section of ``--out``, keeping the other parts.

The server is started here (``planner serve`` on 127.0.0.1, port 0) and stopped at the
end; nothing but loopback is contacted and every loop is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from bench.slow_lane import run_slow_lane, section, splice
from planner_service.client import PlanClient
from planner_service.data import make_source, pack_sequences
from planner_service.proto_build import load
from planner_service.service.grpc_wire import dict_to_request
from planner_service.service.testing import ServerProcess


class LoadResult(NamedTuple):
    transport: str
    ok: int
    errors: dict[str, int]
    seconds: float
    latencies_ms: np.ndarray

    @property
    def rate(self) -> float:
        return self.ok / self.seconds

    def pct(self, q: float) -> float:
        lat = self.latencies_ms
        return float(np.percentile(lat, q)) if len(lat) else float("nan")


class LoopResult(NamedTuple):
    name: str
    waits_ms: np.ndarray
    sources: list[str]
    step_overrun_ms: float


def make_bodies(dataset: str, context: int, cp: int, count: int, seed: int) -> list[bytes]:
    seqs = pack_sequences(make_source(dataset), context_length=context, num_sequences=count,
                          seed=seed)
    return [json.dumps({"doc_lengths": s, "cp_size": cp, "strategy": "flashcp",
                        "context_length": context}).encode() for s in seqs]


async def _pace(interval_s: float, k: int, start: float) -> None:
    """Open-loop pacing: the k-th request of a client is due at start + k x interval."""
    if interval_s > 0:
        delay = start + k * interval_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)


async def _http_client(host: str, port: int, bodies: Any, stop_at: float, warm_until: float,
                       lat: list[float], errors: dict[str, int], interval_s: float = 0.0,
                       phase_s: float = 0.0) -> int:
    reader, writer = await asyncio.open_connection(host, port)
    ok = 0
    start = time.perf_counter() + phase_s
    try:
        for k in itertools.count():
            await _pace(interval_s, k, start)
            if (now := time.perf_counter()) >= stop_at:
                break
            body = next(bodies)
            head = (f"POST /v1/plan HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                    f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            writer.write(head + body)
            await writer.drain()
            status = int((await reader.readline()).split()[1])
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            done = time.perf_counter()
            if now < warm_until:
                continue
            if status == 200:
                ok += 1
                lat.append((done - now) * 1e3)
            else:
                errors[str(status)] = errors.get(str(status), 0) + 1
    finally:
        writer.close()
    return ok


async def _grpc_client(stub: Any, messages: Any, stop_at: float, warm_until: float,
                       lat: list[float], errors: dict[str, int], interval_s: float = 0.0,
                       phase_s: float = 0.0) -> int:
    import grpc

    ok = 0
    start = time.perf_counter() + phase_s
    for k in itertools.count():
        await _pace(interval_s, k, start)
        if (now := time.perf_counter()) >= stop_at:
            break
        try:
            await stub.Plan(next(messages), timeout=30)
        except grpc.aio.AioRpcError as exc:
            if now >= warm_until:
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
            continue
        if now >= warm_until:
            ok += 1
            lat.append((time.perf_counter() - now) * 1e3)
    return ok


async def run_load(transport: str, server: ServerProcess, bodies: list[bytes], clients: int,
                   duration_s: float, warmup_s: float, rate: float = 0.0) -> LoadResult:
    """Closed loop (each client sends as soon as it has its answer) or, with ``rate``,
    open loop: each client sends every clients / rate seconds, phases spread evenly."""
    lat: list[float] = []
    errors: dict[str, int] = {}
    start = time.perf_counter()
    warm_until, stop_at = start + warmup_s, start + warmup_s + duration_s
    interval = clients / rate if rate > 0 else 0.0
    phases = [i * interval / clients for i in range(clients)]
    if transport == "http":
        host, port = server.http_url.removeprefix("http://").split(":")
        feed = itertools.cycle(bodies)
        oks = await asyncio.gather(*(_http_client(host, int(port), feed, stop_at, warm_until,
                                                  lat, errors, interval, phases[i])
                                     for i in range(clients)))
    else:
        import grpc

        pb2, pb2_grpc = load()
        messages = itertools.cycle([dict_to_request(pb2, json.loads(b)) for b in bodies])
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            stub = pb2_grpc.PlannerStub(channel)
            oks = await asyncio.gather(*(_grpc_client(stub, messages, stop_at, warm_until,
                                                      lat, errors, interval, phases[i])
                                         for i in range(clients)))
    seconds = time.perf_counter() - warm_until
    mode = f"{transport}, paced {rate:g}/s" if rate > 0 else f"{transport}, closed loop"
    return LoadResult(mode, sum(oks), errors, seconds, np.asarray(lat))


def training_loop(name: str, url: str, sequences: list[list[int]], cp: int, context: int,
                  step_ms: float, timeout_s: float, on_step: Any = None) -> LoopResult:
    """Prefetch batch i+1, get batch i, 'train' for step_ms; returns get() waits."""
    waits, sources = [], []
    step_s = step_ms / 1e3
    overrun = 0.0
    with PlanClient(url, cp_size=cp, request_defaults={"context_length": context},
                    request_timeout_s=1.0) as client:
        client.prefetch(0, sequences[0])
        time.sleep(1.0)  # setup before the first step (model build, first batch load)
        next_step = time.perf_counter()
        for step in range(len(sequences) - 1):
            start = time.perf_counter()
            got = client.get(step, timeout=timeout_s)
            waits.append((time.perf_counter() - start) * 1e3)
            sources.append("fallback" if got.fallback else "service")
            client.prefetch(step + 1, sequences[step + 1])  # one batch ahead
            if on_step is not None:
                on_step(step)
            next_step += step_s
            pause = next_step - time.perf_counter()
            if pause > 0:
                time.sleep(pause)  # the training step
            else:
                overrun = max(overrun, -pause * 1e3)
    return LoopResult(name, np.asarray(waits), sources, overrun)


def _fmt(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def report(args: argparse.Namespace, loads: list[LoadResult], loops: list[LoopResult],
           kill: LoopResult | None, kill_steps: tuple[int, int], load_avg: tuple[float, ...]
           ) -> str:
    lines = [
        f"# Planner service load: {args.clients} clients, {args.duration:g} s, "
        f"{args.context // 1024}K-token flashcp plans at N = {args.cp}",
        "",
        "Generated by `bench/service_load.py`; rerun the command below to reproduce.",
        "",
        f"Command: `python -m bench.service_load {' '.join(sys.argv[1:])}`".rstrip(),
        "",
        f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), Python "
        f"{platform.python_version()}; load average before the run "
        f"{', '.join(f'{x:.2f}' for x in load_avg)} (other jobs share these cores). "
        f"Server: `planner serve`, {args.workers} solver process(es), cache off; the load "
        "generator runs on the same machine. Each request is a different "
        f"{args.dataset} sequence packed to {args.context} tokens (pool of {args.pool}).",
        "",
        "Closed loop: each client sends its next request as soon as it has an answer, so "
        "the rate is the service's capacity and, by Little's law, mean latency = clients / "
        "rate. Paced: each client sends on a fixed schedule (open loop) adding up to the "
        "given rate; latency is what a request sees at that load.",
        "",
        "| transport | plans | plans/s | p50 ms | p90 ms | p99 ms | max ms | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in loads:
        lines.append(f"| {r.transport} | {r.ok} | {r.rate:.0f} | {_fmt(r.pct(50))} | "
                     f"{_fmt(r.pct(90))} | {_fmt(r.pct(99))} | {_fmt(r.pct(100))} | "
                     f"{r.errors or 0} |")
    lines += ["", f"## Training loop: {args.step_ms:g} ms steps, prefetch one batch ahead, "
              f"get() timeout {args.timeout * 1e3:g} ms", "",
              "Each step: get(i), prefetch(i + 1), train (sleep to the step boundary). "
              "Waits are the time spent in get().", "",
              "| back end | steps | wait p50 ms | wait p99 ms | wait max ms | fallbacks |",
              "|---|---:|---:|---:|---:|---:|"]
    for loop in loops:
        w = loop.waits_ms
        lines.append(f"| {loop.name} | {len(w)} | {np.percentile(w, 50):.3f} | "
                     f"{np.percentile(w, 99):.3f} | {w.max():.3f} | "
                     f"{loop.sources.count('fallback')} |")
    if kill is not None:
        k0, k1 = kill_steps
        w = kill.waits_ms
        phases = [("before the kill", 0, k0), ("server down", k0 + 1, k1),
                  ("after the restart", k1 + 1, len(w))]
        lines += ["", f"## Server killed (SIGKILL) at step {k0}, restarted at step {k1} "
                  f"({kill.name})", "",
                  "| phase | steps | service plans | fallback plans | wait p99 ms | "
                  "wait max ms |", "|---|---:|---:|---:|---:|---:|"]
        for label, a, b in phases:
            src = kill.sources[a:b]
            lines.append(f"| {label} | {b - a} | {src.count('service')} | "
                         f"{src.count('fallback')} | {np.percentile(w[a:b], 99):.3f} | "
                         f"{w[a:b].max():.3f} |")
        lines += ["", "The server is restarted beside the loop (a new `planner serve` takes "
                  "a second or two to warm up); the loop never waits for it: plans stay local "
                  "until the service answers again."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--rate", type=float, default=300.0,
                   help="total plans/s of the paced run (0: skip it)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per transport")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--dataset", default="wlbllm")
    p.add_argument("--pool", type=int, default=20000, help="distinct sequences to cycle")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--step-ms", type=float, default=200.0)
    p.add_argument("--timeout", type=float, default=0.2, help="get() timeout, seconds")
    p.add_argument("--train-steps", type=int, default=100)
    p.add_argument("--transports", default="http,grpc")
    p.add_argument("--no-kill", action="store_true", help="skip part 3")
    p.add_argument("--out", type=Path, default=Path("bench/results/service_load.md"))
    p.add_argument("--slow-duration", type=float, default=40.0, help="seconds of part 4")
    p.add_argument("--no-slow-lane", action="store_true", help="skip part 4")
    p.add_argument("--only-slow-lane", action="store_true", help="run part 4 alone")
    args = p.parse_args(argv)
    command = f"python -m bench.service_load {' '.join(sys.argv[1:])}".rstrip()
    if args.only_slow_lane:
        part = section([run_slow_lane(args.slow_duration, fast_workers=k) for k in (1, 0)],
                       command)
        old = args.out.read_text() if args.out.exists() else ""
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(splice(old, part))
        print(part)
        return

    load_avg = os.getloadavg()
    bodies = make_bodies(args.dataset, args.context, args.cp, args.pool, seed=1)
    train = pack_sequences(make_source(args.dataset), context_length=args.context,
                           num_sequences=args.train_steps + 1, seed=2)
    env = {"PLANNER_CACHE_SIZE": "0", "PLANNER_QUEUE_SIZE": str(4 * args.clients)}
    loads, loops = [], []
    kill = None
    kill_steps = (args.train_steps // 3, 2 * args.train_steps // 3)
    with ServerProcess(workers=args.workers, env=env) as server:
        for transport in args.transports.split(","):
            for rate in (0.0, args.rate) if args.rate > 0 else (0.0,):
                result = asyncio.run(run_load(transport, server, bodies, args.clients,
                                              args.duration, args.warmup, rate))
                print(f"{result.transport}: {result.rate:.0f} plans/s, p50 "
                      f"{result.pct(50):.2f} ms, p99 {result.pct(99):.2f} ms, errors "
                      f"{result.errors}", flush=True)
                loads.append(result)
        for transport in args.transports.split(","):
            url = server.http_url if transport == "http" else server.grpc_url
            loop = training_loop(transport, url, train, args.cp, args.context, args.step_ms,
                                 args.timeout)
            print(f"loop {transport}: wait p99 {np.percentile(loop.waits_ms, 99):.3f} ms, "
                  f"fallbacks {loop.sources.count('fallback')}", flush=True)
            loops.append(loop)
        if not args.no_kill:
            def chaos(step: int) -> None:
                if step == kill_steps[0]:
                    server.kill()
                elif step == kill_steps[1]:  # restart beside the loop, as an operator would
                    threading.Thread(target=server.start, daemon=True).start()

            kill = training_loop("http", server.http_url, train, args.cp, args.context,
                                 args.step_ms, args.timeout, on_step=chaos)
            print(f"kill: fallbacks {kill.sources.count('fallback')}, max wait "
                  f"{kill.waits_ms.max():.3f} ms", flush=True)
    text = report(args, loads, loops, kill, kill_steps, load_avg)
    if not args.no_slow_lane:
        text = splice(text, section([run_slow_lane(args.slow_duration, fast_workers=k)
                                     for k in (1, 0)], command))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
