"""flashcp at scale: plan quality per benchmark cell (this part: quality only).

    python -m bench.scale --quality-only --out bench/results/scale_baseline.json

Quality: for every cell (data set or family x context x N), packed sequences (seeded), the
mean imbalance and mean saving of flashcp's plans (all-to-all-v, its default mode) and,
under compact all-gather, the mean saving and imbalance of Algorithm 1 as published.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

from planner_service.core.request import PlanRequest
from planner_service.data import make_source, pack_sequences
from planner_service.solvers.registry import solve

QUALITY_SOURCES = ("wlbllm", "code", "pile", "redpajama", "books")
QUALITY_CONTEXTS = (32768, 131072)
QUALITY_CP = (4, 8)
TARGET = 1.05


def _algorithm1_plan(doc_lengths: list[int], request: PlanRequest):
    """Algorithm 1's plan (strategy ``flashcp_paper``) under compact all-gather."""
    return solve(replace(request, strategy="flashcp_paper", comm_mode="compact_allgather"),
                 check=False)


def quality(sequences_per_cell: int, seed: int) -> list[dict]:
    cells = []
    for source in QUALITY_SOURCES:
        for context in QUALITY_CONTEXTS:
            sequences = pack_sequences(make_source(source), context_length=context,
                                       num_sequences=sequences_per_cell, seed=seed)
            for n in QUALITY_CP:
                imb, sav, ag_sav, ag_imb, p_sav, p_imb, ms = [], [], [], [], [], [], []
                for seq in sequences:
                    request = PlanRequest(doc_lengths=tuple(seq), cp_size=n,
                                          context_length=context, imbalance_target=TARGET)
                    start = time.perf_counter()
                    plan = solve(request, check=False)
                    ms.append((time.perf_counter() - start) * 1e3)
                    imb.append(plan.metrics.imbalance)
                    sav.append(plan.metrics.comm_saving_alltoallv)
                    ag = solve(PlanRequest(doc_lengths=tuple(seq), cp_size=n, context_length=context,
                                           imbalance_target=TARGET, comm_mode="compact_allgather"),
                               check=False)
                    ag_sav.append(ag.metrics.comm_saving_allgather)
                    ag_imb.append(ag.metrics.imbalance)
                    paper = _algorithm1_plan(seq, request)
                    p_sav.append(paper.metrics.comm_saving_allgather)
                    p_imb.append(paper.metrics.imbalance)
                cell = {
                    "source": source, "context": context, "n": n, "sequences": len(sequences),
                    "imbalance_mean": statistics.fmean(imb),
                    "saving_alltoallv_mean": statistics.fmean(sav),
                    "allgather_saving_mean": statistics.fmean(ag_sav),
                    "allgather_imbalance_mean": statistics.fmean(ag_imb),
                    "paper_allgather_saving_mean": statistics.fmean(p_sav),
                    "paper_imbalance_mean": statistics.fmean(p_imb),
                    "solve_ms_median": statistics.median(ms),
                }
                print(json.dumps(cell), flush=True)
                cells.append(cell)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quality-only", action="store_true")
    parser.add_argument("--sequences", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/scale_baseline.json")
    args = parser.parse_args()
    started = time.time()
    cells = quality(args.sequences, args.seed)
    out = {
        "command": f"python -m bench.scale --quality-only --sequences {args.sequences} "
        f"--seed {args.seed} --out {args.out}",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "load_average": os.getloadavg(),
        "wall_s": time.time() - started,
        "imbalance_target": TARGET,
        "cells": cells,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
