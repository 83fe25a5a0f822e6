"""Is the ILP reproducible on a busy machine, and does it end within its time limit?

    python -m bench.ilp_repro                       # 10 requests x 10 solves, limit 10 s
    python -m bench.ilp_repro --requests 3 --solves 4 --limit 1

Each of ``--requests`` small requests (4 to 12 docs of a code-like length mix, 7K to 32K
tokens, N = 4 or 8, seeded) is solved ``--solves`` times in a fresh solver process each
time (no cache, as on a restarted replica); the second half of the solves run with two CPU
hogs (busy processes) beside them. Per request: the distinct plan_ids (1 is the target),
how many solves the wall-clock deadline cut (``deterministic: false``), and the largest
wall time over the limit. Prints a Markdown table and writes it to ``--out``
(bench/results/ilp_repro.md).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import NamedTuple

from planner_service.core.request import PlanRequest


class Outcome(NamedTuple):
    plan_id: str
    wall_s: float
    deterministic: bool
    status: str


def requests(count: int, limit: float) -> list[PlanRequest]:
    """``count`` small seeded requests."""
    rng = random.Random(40)
    out = []
    for _ in range(count):
        docs = rng.randint(4, 12)
        total = rng.randint(7_000, 32_000)
        cuts = sorted(rng.sample(range(1, total), docs - 1))
        lengths = tuple(b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True))
        out.append(PlanRequest(doc_lengths=lengths, cp_size=rng.choice((4, 8)), strategy="ilp",
                               options={"time_limit_s": limit}))
    return out


def warm() -> None:
    """Import the solver before the clock starts (as a warm service worker has it)."""
    from planner_service.solvers.registry import prepare

    prepare("ilp")


def solve_once(request: PlanRequest) -> Outcome:
    """One solve in this (fresh) process, timed from the call."""
    from planner_service.solvers.registry import solve

    start = time.perf_counter()
    plan = solve(request, check=False)
    return Outcome(plan.plan_id, time.perf_counter() - start, bool(plan.info["deterministic"]),
                   str(plan.info["status"]))


def hog(stop: multiprocessing.synchronize.Event, parent: int) -> None:  # type: ignore[name-defined]
    """Spin until told to stop or the benchmark is gone."""
    x = 0
    while not stop.is_set() and os.getppid() == parent:
        for _ in range(100_000):
            x = (x * 31 + 7) % 1_000_003


def run(request: PlanRequest, busy: bool, ctx: multiprocessing.context.SpawnContext) -> Outcome:
    stop = ctx.Event()
    hogs = [ctx.Process(target=hog, args=(stop, os.getpid()), daemon=True) for _ in range(2 if busy else 0)]
    for p in hogs:
        p.start()
    try:
        with ctx.Pool(1, initializer=warm) as pool:
            return pool.apply(solve_once, (request,))
    finally:
        stop.set()
        for p in hogs:
            p.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--solves", type=int, default=10, help="per request; half with hogs")
    parser.add_argument("--limit", type=float, default=10.0, help="options.time_limit_s")
    parser.add_argument("--out", type=Path, default=Path("bench/results/ilp_repro.md"))
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    emit("# ILP reproducibility and wall time under load")
    emit("")
    emit(f"Command: `python -m bench.ilp_repro {' '.join(sys.argv[1:])}`".rstrip())
    emit("")
    emit(f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), Python "
         f"{platform.python_version()}; load average at start "
         f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} (other jobs share these cores). "
         f"time_limit_s {args.limit:g}, workers 2 (the default); {args.solves} solves per "
         f"request, each in a fresh process, the last {args.solves // 2} with 2 CPU hogs "
         "beside them.")
    emit("")
    emit("| request | docs | tokens | N | plan_ids | cut by deadline | statuses | "
         "max wall - limit s | load at start |")
    emit("|---|---|---|---|---|---|---|---|---|")
    total_ids = cut = 0
    worst = -1e9
    for i, request in enumerate(requests(args.requests, args.limit), 1):
        load = os.getloadavg()[0]
        outcomes = [run(request, busy=k >= args.solves - args.solves // 2, ctx=ctx)
                    for k in range(args.solves)]
        ids = {o.plan_id for o in outcomes}
        total_ids += len(ids)
        over = max(o.wall_s for o in outcomes) - args.limit
        worst = max(worst, over)
        statuses = ",".join(sorted({o.status for o in outcomes}))
        cut += sum(not o.deterministic for o in outcomes)
        emit(f"| {i} | {len(request.doc_lengths)} | {sum(request.doc_lengths)} | "
             f"{request.cp_size} | {len(ids)} | {sum(not o.deterministic for o in outcomes)} | "
             f"{statuses} | {over:+.2f} | {load:.1f} |")
    emit("")
    emit(f"{total_ids} distinct plan_ids over {args.requests} requests (target "
         f"{args.requests}); {cut} of {args.requests * args.solves} solves cut by the "
         f"deadline; largest wall time over the limit {worst:+.2f} s (wall time of "
         "the solve call in its process, the plan's build included); load average at end "
         f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
