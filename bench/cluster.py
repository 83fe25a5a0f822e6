"""The planner at cluster scale: FCP per stage against (K, N), flashcp on mixed lengths, the
balance contract and what compact all-gather saves.

    python -m bench.cluster            # the full run (under 10 minutes on 2 cores)
    python -m bench.cluster --quick    # a few seconds: every part, tiny sizes

Writes ``--out`` (markdown, default bench/results/cluster.md) and the same figures as JSON
beside it. Every section gives the load average (1, 5, 15 min) at its start and end: the
times are CPU time of this process (``time.process_time``), which other processes on the
cores slow down less than the wall clock, but a busy machine still slows it (shared
caches, frequency).

1. **FCP per stage**: ``plan_global_batch`` on K sequences (WLB-LLM lengths, one document
   each, up to 128K; E = 32K tokens per rank, as bench.fcp_bench) on N ranks, K = N = 256
   .. 16,384 and off the diagonal; CPU ms of the split into micro-batches, stage 1 (the
   candidate groupings), stage 2 (degrees by ``times.window_degrees`` and the spare ranks),
   the paper's DP check (where it runs) and the rest; and ``schedule`` with the flashcp
   plans of every group (build and validation included) up to 4,096 / 4,096, wall and
   CPU time of this process (the group plans may run in worker processes). Fitted growth
   exponents: the slope of log time against log K on the diagonal.
2. **flashcp on mixed lengths**: D documents drawn from each shared data set and family,
   scaled to 2M tokens in all (each length x 2M / their sum, rounded, at least 1), and D
   equal documents, D = 1,000 .. 100,000, at N = 8 .. 1,024 (powers of two and 192 and
   768): CPU ms of ``flashcp_layout`` and of ``solve(check=False)`` (layout, metrics and
   plan id; min of two each), and the imbalance reached; the worst cell over all and per
   N. Growth exponent in D per N (layout).
3. **Balance contract**: packed 32K and 128K sequences of every data set and family at N
   = 4 .. 64 and the mixed-length cells, solved by flashcp and flashcp_paper: how many miss
   R = 1.05, and how many of those do not declare it (must be 0).
4. **Compact all-gather**: share of flashcp plans (128K packed sequences, R = 1.05,
   ``comm_mode=compact_allgather``) whose all-gather saving is 0, per data set and N.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.scale import mixed_lengths
from planner_service.core.request import PlanRequest
from planner_service.data import FAMILIES, make_source, pack_sequences, sample_batch
from planner_service.solvers.balance import TARGET_MET
from planner_service.solvers.flashcp import flashcp_layout
from planner_service.solvers.registry import solve

TARGET = 1.05
MEMORY = 32768
SOURCES = ("wlbllm", "code", *(f"family:{name}" for name in sorted(FAMILIES)))
MIXED_TOKENS = 2_000_000


class Config:
    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.fcp_cells: tuple[tuple[int, int], ...] = (
            ((64, 64), (256, 256), (512, 1024)) if quick else
            ((256, 256), (1024, 1024), (4096, 4096), (16384, 16384), (4096, 1024), (1024, 4096),
             (16384, 4096)))
        self.schedule_cells = ((64, 64), (256, 256)) if quick else (
            (256, 256), (1024, 1024), (4096, 4096))
        self.sources = ("wlbllm", "family:pile") if quick else SOURCES
        self.docs = (100, 1000) if quick else (1000, 3000, 10_000, 30_000, 100_000)
        self.doc_cps = (8, 64) if quick else (8, 16, 32, 64, 128, 192, 256, 512, 768, 1024)
        self.contract_sequences = 1 if quick else 4
        self.contract_cps = (4, 64) if quick else (4, 8, 16, 32, 64)
        self.allgather_sequences = 2 if quick else 20
        self.allgather_cps = (8, 64) if quick else (8, 16, 32, 64)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-6)) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly, strict=True)) / den if den else 0.0


class Stages:
    """Exclusive CPU time per stage of functions wrapped in their callers' modules."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self.stack: list[float] = []
        self.undo: list[tuple[Any, str, Any]] = []

    def wrap(self, module: Any, attr: str, stage: str) -> None:
        fn = getattr(module, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            self.stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.process_time() - start
                inner = self.stack.pop()
                self.ms[stage] += (spent - inner) * 1e3
                if self.stack:
                    self.stack[-1] += spent

        self.undo.append((module, attr, fn))
        setattr(module, attr, timed)

    def restore(self) -> None:
        for module, attr, fn in reversed(self.undo):
            setattr(module, attr, fn)


def staged(fn: Callable[[], object]) -> dict[str, float]:
    """CPU ms of ``fn()`` in all and per FCP stage (the module docstring's section 1)."""
    from planner_service.fcp import grouping, portfolio
    from planner_service.fcp import schedule as fcp_schedule

    stages = Stages()
    stages.wrap(fcp_schedule, "split_micro_batches", "split")
    for name in ("paper_groupings", "static_family"):
        stages.wrap(portfolio, name, "stage 1")
    stages.wrap(grouping, "paper_groupings", "stage 1")
    for name in ("window_degrees", "fill_spare"):
        stages.wrap(grouping, name, "stage 2")
    stages.wrap(grouping, "dp_degrees", "DP check")
    start = time.process_time()
    try:
        fn()
    finally:
        stages.restore()
    total = (time.process_time() - start) * 1e3
    out = {"total": total, **{k: stages.ms.get(k, 0.0) for k in ("split", "stage 1", "stage 2",
                                                                   "DP check")}}
    out["other"] = total - sum(v for k, v in out.items() if k != "total")
    return out


def fcp_section(cfg: Config) -> dict[str, Any]:
    from planner_service.fcp import plan_global_batch
    from planner_service.solvers.fcp_schedule import ScheduleRequest, schedule

    started = load()
    rows: list[dict[str, Any]] = []
    for k, n in cfg.fcp_cells:
        seqs = sample_batch(make_source("wlbllm"), num_sequences=k, max_tokens=131072, seed=0)
        runs = [staged(lambda s=seqs, n=n: plan_global_batch(s, num_ranks=n, memory_tokens=MEMORY))
                for _ in range(1 if k >= 16384 else 2)]
        best = min(runs, key=lambda r: r["total"])
        rows.append({"k": k, "n": n, **best})
        print(f"plan_global_batch K {k} N {n}: {best['total']:.0f} ms "
              f"({', '.join(f'{s} {v:.0f}' for s, v in best.items() if s != 'total')})",
              flush=True)
    sched: list[dict[str, Any]] = []
    for k, n in cfg.schedule_cells:
        seqs = sample_batch(make_source("wlbllm"), num_sequences=k, max_tokens=131072, seed=0)
        request = ScheduleRequest(sequences=seqs, num_ranks=n, memory_tokens=MEMORY)
        wall, cpu, before = time.perf_counter(), time.process_time(), os.times()
        result = schedule(request)
        after = os.times()
        sched.append({"k": k, "n": n, "wall_ms": (time.perf_counter() - wall) * 1e3,
                      "cpu_ms": (time.process_time() - cpu) * 1e3,
                      "workers_cpu_ms": (after.children_user + after.children_system
                                         - before.children_user - before.children_system) * 1e3,
                      "solve_ms": result.solve_ms, "plan_ms": result.plan_ms})
        print(f"schedule K {k} N {n}: wall {sched[-1]['wall_ms']:.0f} ms", flush=True)
    diagonal = [r for r in rows if r["k"] == r["n"]]
    exponents = {stage: slope([r["k"] for r in diagonal], [r[stage] for r in diagonal])
                 for stage in ("total", "split", "stage 1", "stage 2")} if len(diagonal) > 1 else {}
    return {"load_start": started, "load_end": load(), "plan_global_batch": rows,
            "schedule": sched, "exponents": exponents}


def flashcp_section(cfg: Config) -> dict[str, Any]:
    started = load()
    rows: list[dict[str, Any]] = []
    for n in cfg.doc_cps:
        for d in cfg.docs:
            length, extra = divmod(MIXED_TOKENS, d)
            inputs = [("equal", [length + (i < extra) for i in range(d)])]
            inputs += [(source, mixed_lengths(source, d, MIXED_TOKENS)) for source in cfg.sources]
            for name, seq in inputs:
                request = PlanRequest(doc_lengths=tuple(seq), cp_size=n, context_length=None,
                                      imbalance_target=TARGET)
                times = []
                for _ in range(2):
                    start = time.process_time()
                    layout = flashcp_layout(seq, request)
                    times.append((time.process_time() - start) * 1e3)
                solve_times = []
                for _ in range(2):
                    start = time.process_time()
                    plan = solve(request, check=False)
                    solve_times.append((time.process_time() - start) * 1e3)
                rows.append({"source": name, "docs": d, "n": n, "tokens": sum(seq),
                             "layout_ms": min(times), "solve_ms": min(solve_times),
                             "imbalance": plan.metrics.imbalance,
                             "declared": layout.info.get(TARGET_MET) is False})
            worst = max((r for r in rows if r["n"] == n and r["docs"] == d),
                        key=lambda r: r["layout_ms"])
            print(f"flashcp D {d} N {n}: worst {worst['layout_ms']:.0f} ms ({worst['source']})",
                  flush=True)
    exponents = {}
    for n in cfg.doc_cps:
        per_d = [max(r["layout_ms"] for r in rows if r["n"] == n and r["docs"] == d)
                 for d in cfg.docs]
        exponents[str(n)] = slope(list(cfg.docs), per_d)
    return {"load_start": started, "load_end": load(), "rows": rows, "exponents_worst_in_d": exponents}


def contract_section(cfg: Config, mixed: list[dict]) -> dict[str, Any]:
    started = load()
    cells: list[dict[str, Any]] = []
    for strategy in ("flashcp", "flashcp_paper"):
        plans = missed = silent = 0
        for source in SOURCES:
            for context in (32768, 131072):
                for seq in pack_sequences(make_source(source), context_length=context,
                                          num_sequences=cfg.contract_sequences, seed=0):
                    for n in cfg.contract_cps:
                        plan = solve(PlanRequest(doc_lengths=tuple(seq), cp_size=n,
                                                 strategy=strategy, imbalance_target=TARGET),
                                     check=False)
                        plans += 1
                        if plan.metrics.imbalance > TARGET:
                            missed += 1
                            silent += plan.info.get(TARGET_MET) is not False
        cells.append({"strategy": strategy, "plans": plans, "missed": missed, "silent": silent})
    cells.append({"strategy": "flashcp (mixed-length cells)", "plans": len(mixed),
                  "missed": sum(r["imbalance"] > TARGET for r in mixed),
                  "silent": sum(r["imbalance"] > TARGET and not r["declared"] for r in mixed)})
    return {"load_start": started, "load_end": load(), "cells": cells}


def allgather_section(cfg: Config) -> dict[str, Any]:
    started = load()
    rows: list[dict[str, Any]] = []
    for source in ("wlbllm", "code", "family:pile", "family:c4"):
        seqs = pack_sequences(make_source(source), context_length=131072,
                              num_sequences=cfg.allgather_sequences, seed=0)
        for n in cfg.allgather_cps:
            savings = [solve(PlanRequest(doc_lengths=tuple(s), cp_size=n,
                                         comm_mode="compact_allgather", imbalance_target=TARGET),
                             check=False).metrics.comm_saving_allgather for s in seqs]
            rows.append({"source": source, "n": n, "sequences": len(seqs),
                         "zero": sum(x <= 0 for x in savings), "mean": statistics.fmean(savings)})
    return {"load_start": started, "load_end": load(), "rows": rows}


def report(cfg: Config, command: str, wall: float, result: dict[str, Any]) -> list[str]:
    fcp, flash, contract, ag = (result[k] for k in ("fcp", "flashcp", "contract", "allgather"))

    def loads(part: dict[str, Any]) -> str:
        return (f"load average at start {', '.join(map(str, part['load_start']))}, at end "
                f"{', '.join(map(str, part['load_end']))}")

    lines = [
        "# The planner at cluster scale",
        "",
        f"Command: `{command}` ({wall:.0f} s). Machine: {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}. Times are CPU ms of this "
        "process (`time.process_time`) unless named wall. R = 1.05.",
        "",
        f"## 1. FCP per stage (WLB-LLM lengths, E = {MEMORY:,}; {loads(fcp)})",
        "",
        "| K sequences | N ranks | total | split | stage 1 | stage 2 | DP check | other |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in fcp["plan_global_batch"]:
        lines.append(f"| {r['k']:,} | {r['n']:,} | {r['total']:.1f} | {r['split']:.1f} | "
                     f"{r['stage 1']:.1f} | {r['stage 2']:.1f} | {r['DP check']:.1f} | "
                     f"{r['other']:.1f} |")
    if fcp["exponents"]:
        lines += ["", "Growth exponent in K = N (slope of log CPU time against log K on the "
                  "diagonal): " + ", ".join(f"{k} {v:.2f}" for k, v in fcp["exponents"].items())
                  + "."]
    lines += ["", "`schedule` with the flashcp plan of every group (build and validation "
              "included; the group plans in worker processes where there are cores, their CPU "
              "time apart; solve and plans: wall ms of `FcpResult.solve_ms` and `plan_ms`):", "",
              "| K | N | wall ms | CPU ms (this process) | CPU ms (workers) | solve ms | plans ms |",
              "|---|---|---|---|---|---|---|"]
    for r in fcp["schedule"]:
        lines.append(f"| {r['k']:,} | {r['n']:,} | {r['wall_ms']:.0f} | {r['cpu_ms']:.0f} | "
                     f"{r.get('workers_cpu_ms', 0.0):.0f} | {r['solve_ms']:.0f} | "
                     f"{r['plan_ms']:.0f} |")
    lines += ["", f"## 2. flashcp on mixed lengths (~{MIXED_TOKENS:,} tokens; {loads(flash)})", "",
              "Layout CPU ms (min of two) per source; `equal` is D equal documents.", ""]
    names = list(dict.fromkeys(r["source"] for r in flash["rows"]))
    lines += ["| D | N | " + " | ".join(names) + " | worst |", "|---|---|" + "---|" * (len(names) + 1)]
    for n in cfg.doc_cps:
        for d in cfg.docs:
            cell = {r["source"]: r for r in flash["rows"] if r["n"] == n and r["docs"] == d}
            worst = max(r["layout_ms"] for r in cell.values())
            lines.append(f"| {d:,} | {n} | " + " | ".join(
                f"{cell[s]['layout_ms']:.0f}" + ("*" if cell[s]["imbalance"] > TARGET else "")
                for s in names) + f" | {worst:.0f} |")
    for key, what in (("layout_ms", "layout"), ("solve_ms", "solve (`solve(check=False)`: "
                                                   "layout, metrics and plan id)")):
        worst = max(flash["rows"], key=lambda r: r[key])
        per_n = {n: max(r[key] for r in flash["rows"] if r["n"] == n) for n in cfg.doc_cps}
        lines += ["", f"Worst {what} of the {len(flash['rows'])} cells: {worst[key]:.0f} ms "
                  f"({worst['source']}, D = {worst['docs']:,}, N = {worst['n']}); per N: "
                  + ", ".join(f"{n}: {v:.0f}" for n, v in per_n.items()) + "."]
    lines += ["", "`*`: the plan misses R (and declares it). Growth exponent in D of the worst "
              "time: " + ", ".join(f"N = {k}: {v:.2f}" for k, v in
                                   flash["exponents_worst_in_d"].items()) + "."]
    lines += ["", f"## 3. Balance contract ({loads(contract)})", "",
              f"Packed 32K and 128K sequences ({cfg.contract_sequences} per data set or family "
              f"and context) at N = {', '.join(map(str, cfg.contract_cps))}, and the cells of "
              "section 2.", "", "| strategy | plans | over R | over R without the declaration |",
              "|---|---|---|---|"]
    for c in contract["cells"]:
        lines.append(f"| {c['strategy']} | {c['plans']} | {c['missed']} | {c['silent']} |")
    lines += ["", f"## 4. Compact all-gather saving of flashcp plans ({loads(ag)})", "",
              f"Packed 128K sequences ({cfg.allgather_sequences} per source).", "",
              "| source | N | plans with saving 0 | mean saving |", "|---|---|---|---|"]
    for r in ag["rows"]:
        lines.append(f"| {r['source']} | {r['n']} | {r['zero']} / {r['sequences']} | "
                     f"{r['mean']:.1%} |")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--out", default=None,
                        help="default bench/results/cluster.md (quick: cluster_quick.md)")
    args = parser.parse_args(argv)
    cfg = Config(args.quick)
    command = "python -m bench.cluster" + " ".join(["", *(argv if argv is not None else sys.argv[1:])])
    started = time.time()
    result: dict[str, Any] = {"command": command, "machine": platform.machine(),
                              "cores": os.cpu_count(), "python": platform.python_version()}
    result["fcp"] = fcp_section(cfg)
    result["flashcp"] = flashcp_section(cfg)
    result["contract"] = contract_section(cfg, result["flashcp"]["rows"])
    result["allgather"] = allgather_section(cfg)
    wall = time.time() - started
    result["wall_s"] = wall
    out = Path(args.out or ("bench/results/cluster_quick.md" if args.quick
                            else "bench/results/cluster.md"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.write_text("\n".join(report(cfg, command, wall, result)) + "\n")
    print(f"written to {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
