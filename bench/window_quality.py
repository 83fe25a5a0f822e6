"""Plan quality under sliding-window and hybrid masks: layer-weighted balance and exchange.

    python -m bench.window_quality --batches 20            # wlbllm and family:pile, 128K and 512K

Samples ``--batches`` packed sequences per data set and context (seeded), plans each with
``--strategies`` for each mask (the request's ``mask``: flashcp chooses by the
layer-weighted objective, solvers/flashcp_masked.py; the baselines keep their layouts),
and also with today's causal flashcp (row ``flashcp causal plan``: the plan a request
without a mask gets), and prices every plan under the mask with core/window_work.py: per
strategy the mean and worst layer-weighted imbalance, the mean imbalance of its causal
layers' work, and the mean layer-weighted all-to-all-v exchange (``MaskFigures.comm_tokens``
per layer: each layer's critical path, averaged over the layers). Every strategy is priced
under ``alltoallv`` (the exact exchange: under a window, the halos), whatever its own
default. Exact counts from the plans; no timing.

The issue's targets for flashcp, checked per cell as PASS/FAIL: worst weighted imbalance
<= 1.05, mean weighted exchange at most contiguous_halo's and per_doc's. Beside them, per
sequence: on the sequences where a baseline's own weighted imbalance is within R, how many
of flashcp's plans exchange at most as much as it (``paired_exchange``).

    python -m bench.window_quality --timing            # solve time under a mask

``--timing`` instead times flashcp's ``solve(check=False)`` with each mask against the
same request without it (CPU time of this process, ``time.process_time``; the two solves
alternate, ``TIMING_REPEATS`` times per sequence, medians) on cells of bench/scale.py's N
sweep (``TIMING_SOURCES``, ``TIMING_CONTEXTS``, ``TIMING_CP``; ``TIMING_SEQUENCES``
packed sequences each), and writes ``--timing-out``: per cell the median causal and
masked solve, their ratio and the worst sequence's ratio; target <= 1.5.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.mask import AttentionMask, parse_layers_text
from planner_service.core.plan import Plan
from planner_service.core.request import PlanRequest
from planner_service.data import make_source, pack_sequences
from planner_service.solvers.registry import solve

MASKS = {"gemma3-like": "5x1024,1xfull", "gpt-oss-like": "1x128,1xfull"}
STRATEGIES = "flashcp,per_doc,contiguous_halo,llama3"
IMBALANCE_TARGET = 1.05
TIMING_SOURCES = ("wlbllm", "code", "family:pile")
TIMING_CONTEXTS = (32768, 131072, 524288)
TIMING_CP = (2, 8, 32, 128, 1024)
TIMING_SEQUENCES = 3
TIMING_REPEATS = 5
TIMING_TARGET = 1.5
CAUSAL_PLAN = "flashcp causal plan"
"""The row of today's causal flashcp plan (a request without a mask) under the mask."""


class Priced(NamedTuple):
    weighted_imbalance: float
    causal_imbalance: float
    comm_per_layer: float
    tokens_ratio: float
    """Tokens per rank with padding over the mean real tokens per rank (1.0: no padding)."""


def price(plan: Plan, mask: AttentionMask) -> Priced:
    """The plan's layer-weighted figures under ``mask`` (all groups' ranks balanced
    together, the exchange of the worst group)."""
    workloads: list[int] = []
    causal: list[int] = []
    comm = 0
    for group in plan.groups:
        arrays = cost.shard_arrays(group.shards)
        assert arrays is not None
        figures = ww.mask_figures_of(arrays, mask, comm_mode="alltoallv",
                                     tokens_per_rank=group.metrics.tokens_per_rank)
        workloads += figures.workload
        causal += cost.rank_workloads_of(arrays)
        comm = max(comm, figures.comm_tokens)
    mean_tokens = sum(plan.doc_lengths) / plan.cp_size
    return Priced(cost.imbalance(workloads), cost.imbalance(causal), comm / mask.num_layers,
                  plan.metrics.tokens_per_rank / mean_tokens if mean_tokens else 1.0)


def paired_exchange(flashcp: list[Priced], other: list[Priced], name: str) -> str:
    """Sequence by sequence, on the sequences where ``other``'s weighted imbalance is
    within R: how many of flashcp's plans exchange at most as much (a plan that misses R
    buys its exchange with balance, so the means compare unlike plans)."""
    within = [(f, o) for f, o in zip(flashcp, other, strict=True)
              if o.weighted_imbalance <= IMBALANCE_TARGET]
    fewer = sum(f.comm_per_layer <= o.comm_per_layer for f, o in within)
    return f"flashcp's exchange <= {name}'s on {fewer} / {len(within)}"


def solve_ms(request: PlanRequest) -> float:
    started = time.process_time()
    solve(request, check=False)
    return (time.process_time() - started) * 1e3


def timing(out: str) -> None:
    """The ``--timing`` table (module docstring)."""
    masks = {name: parse_layers_text(text) for name, text in MASKS.items()}
    lines = [
        "# flashcp solve time under sliding-window and hybrid masks",
        "",
        "Command: `python -m bench.window_quality --timing`",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f} at start.",
        f"CPU ms of `solve(check=False)` (`time.process_time`), flashcp at R = 1.05; per "
        f"sequence the causal and the masked solve alternate {TIMING_REPEATS} times and "
        f"their medians are compared; {TIMING_SEQUENCES} packed sequences (seed 0) per "
        f"source and context, sources {', '.join(TIMING_SOURCES)}. Ratio: median masked over "
        f"median causal over the cell's sequences; worst: the largest per-sequence ratio. "
        f"Target: ratio <= {TIMING_TARGET}.",
        "",
        "| tokens | N | mask | causal ms | masked ms | ratio | worst sequence |",
        "|---|---|---|---|---|---|---|",
    ]
    started = time.time()
    for context in TIMING_CONTEXTS:
        sequences = [lengths for source in TIMING_SOURCES
                     for lengths in pack_sequences(make_source(source), context_length=context,
                                                   num_sequences=TIMING_SEQUENCES, seed=0)]
        for n in TIMING_CP:
            for name, mask in masks.items():
                causal, masked, ratios = [], [], []
                for lengths in sequences:
                    request = PlanRequest(doc_lengths=tuple(lengths), cp_size=n,
                                          context_length=context)
                    windowed = replace(request, mask=mask)
                    pairs = [(solve_ms(request), solve_ms(windowed))
                             for _ in range(TIMING_REPEATS)]
                    c = float(np.median([a for a, _ in pairs]))
                    m = float(np.median([b for _, b in pairs]))
                    causal.append(c)
                    masked.append(m)
                    ratios.append(m / c)
                c, m = float(np.median(causal)), float(np.median(masked))
                lines.append(f"| {context // 1024}K | {n} | {name} | {c:.2f} | {m:.2f} | "
                             f"{m / c:.2f} | {max(ratios):.2f} |")
                print(lines[-1], flush=True)
    lines += ["", f"Load average at end {os.getloadavg()[0]:.1f}; wall time "
              f"{time.time() - started:.0f} s."]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("\n".join(lines) + "\n")
    print(f"written to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--datasets", default="wlbllm,family:pile")
    parser.add_argument("--contexts", default="131072,524288")
    parser.add_argument("--cp", default="4,8,32")
    parser.add_argument("--strategies", default=STRATEGIES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/window_quality.md")
    parser.add_argument("--timing", action="store_true",
                        help="time flashcp under each mask against the causal solve instead")
    parser.add_argument("--timing-out", default="bench/results/window_solve_time.md")
    args = parser.parse_args()
    if args.timing:
        timing(args.timing_out)
        return
    strategies = args.strategies.split(",")
    masks = {name: parse_layers_text(text) for name, text in MASKS.items()}
    lines = [
        "# Plan quality under sliding-window and hybrid masks",
        "",
        f"Command: `python -m bench.window_quality --batches {args.batches} --datasets "
        f"{args.datasets} --contexts {args.contexts} --cp {args.cp} --strategies "
        f"{args.strategies} --seed {args.seed}`",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f} at start.",
        "Masks: " + "; ".join(f"{name} `{text}`" for name, text in MASKS.items()) + ". "
        "Exchange: all-to-all-v KV tokens on the critical path, per layer (layer-weighted "
        "mean). Tokens per rank: the plan's padded rank buffer over the mean real tokens "
        "per rank. Exact counts from the plans, no timing; every strategy plans with the "
        f"mask, and `{CAUSAL_PLAN}` is the plan of the same request without it.",
        "",
    ]
    started = time.time()
    for dataset in args.datasets.split(","):
        for context in (int(c) for c in args.contexts.split(",")):
            sequences = pack_sequences(make_source(dataset), context_length=context,
                                       num_sequences=args.batches, seed=args.seed)
            for n in (int(x) for x in args.cp.split(",")):
                priced: dict[tuple[str, str], list[Priced]] = {}
                for lengths in sequences:
                    request = PlanRequest(doc_lengths=tuple(lengths), cp_size=n,
                                          context_length=context)
                    causal_plan = solve(request.with_strategy("flashcp"), check=False)
                    for name, mask in masks.items():
                        priced.setdefault((name, CAUSAL_PLAN), []).append(
                            price(causal_plan, mask))
                        for strategy in strategies:
                            plan = solve(replace(request, strategy=strategy, mask=mask),
                                         check=False)
                            priced.setdefault((name, strategy), []).append(price(plan, mask))
                for name in masks:
                    start = len(lines)
                    lines += [f"## {dataset}, {context} tokens, N = {n}, {name}, "
                              f"{len(sequences)} sequences", "",
                              "| strategy | weighted imbalance mean | weighted imbalance max "
                              "| causal-layer imbalance mean | exchange per layer (mean) "
                              "| tokens per rank / mean (mean, max) |",
                              "|---|---|---|---|---|---|"]
                    mean_comm = {}
                    shown = [*strategies, CAUSAL_PLAN] if "flashcp" in strategies else strategies
                    for strategy in shown:
                        rows = priced[(name, strategy)]
                        w = np.array([r.weighted_imbalance for r in rows])
                        mean_comm[strategy] = float(np.mean([r.comm_per_layer for r in rows]))
                        lines.append(
                            f"| {strategy} | {w.mean():.4f} | {w.max():.4f} | "
                            f"{np.mean([r.causal_imbalance for r in rows]):.4f} | "
                            f"{mean_comm[strategy]:,.0f} | "
                            f"{np.mean([r.tokens_ratio for r in rows]):.2f}, "
                            f"{max(r.tokens_ratio for r in rows):.2f} |")
                    if "flashcp" in strategies:
                        worst = max(r.weighted_imbalance for r in priced[(name, "flashcp")])
                        checks = [f"weighted imbalance max {worst:.4f} <= {IMBALANCE_TARGET}: "
                                  f"{'PASS' if worst <= IMBALANCE_TARGET else 'FAIL'}"]
                        paired = []
                        for other in ("contiguous_halo", "per_doc"):
                            if other in strategies:
                                ok = mean_comm["flashcp"] <= mean_comm[other]
                                checks.append(f"exchange <= {other}'s: "
                                              f"{'PASS' if ok else 'FAIL'}")
                                paired.append(paired_exchange(priced[(name, "flashcp")],
                                                              priced[(name, other)], other))
                        lines += ["", "flashcp targets: " + "; ".join(checks)]
                        if paired:
                            lines += ["", "Per sequence, where the baseline meets R: "
                                      + "; ".join(paired)]
                    lines.append("")
                    print("\n".join(lines[start:]), flush=True)
    lines.append(f"Total wall time {time.time() - started:.0f} s; load average "
                 f"{os.getloadavg()[0]:.1f} at end.")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
