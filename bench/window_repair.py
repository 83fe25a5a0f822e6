"""What the repaired candidate and the bounded per_doc fallback of flashcp under a mask
change, measured side by side in one process.

    python -m bench.window_repair                 # writes bench/results/window_repair.md

Three tables:

1. Plan by plan: flashcp's plan of every sequence of bench/window_quality.py's cells
   (``--sequences`` per cell: wlbllm and family:pile, 128K and 512K, N = 4, 8, 32, both
   masks) with and without the ``flashcp repaired`` candidate (``repaired_layout``
   patched to decline): how many plans move less, the same and more layer-weighted KV,
   and how many miss R.
2. The repair's cost: on the timing cells of ``bench.window_quality --timing``, the CPU
   time of the repair and of pricing its layout (where flashcp's causal plan misses R),
   over the CPU time of the causal solve of the same sequence (medians of
   ``REPEATS``); per cell the median and the largest over its sequences.
3. Large requests: masked solves of lognormal documents (seeded) where no candidate may
   meet R, with the per_doc fallback bounded (``PER_DOC_CHUNKS``) and unbounded, beside
   the causal solve.

CPU time is ``time.process_time``; the machine and load are in the file's header.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np

from bench.window_quality import MASKS, TIMING_CONTEXTS, TIMING_CP, TIMING_SOURCES
from planner_service.core.mask import AttentionMask, parse_layers_text
from planner_service.core.request import PlanRequest
from planner_service.data import make_source, pack_sequences
from planner_service.solvers import flashcp_masked
from planner_service.solvers.contiguous_halo import WeightedPrefix
from planner_service.solvers.flashcp_bounded import causal_flashcp_layout
from planner_service.solvers.kv_bound import listed
from planner_service.solvers.registry import solve
from planner_service.solvers.weighted_repair import repaired_layout

REPEATS = 5
LARGE = ((8192, 256), (16384, 128), (4096, 512))
"""(documents, ranks) of table 3, each within the service's PLANNER_MAX_SHARDS."""


@contextmanager
def patched(name: str, value: object):
    old = getattr(flashcp_masked, name)
    setattr(flashcp_masked, name, value)
    try:
        yield
    finally:
        setattr(flashcp_masked, name, old)


def cpu_ms(f: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.process_time()
        f()
        times.append((time.process_time() - start) * 1e3)
    return float(np.median(times))


def plan_by_plan(sequences: int) -> list[str]:
    lines = ["## 1. Plan by plan, with and without `flashcp repaired`", "",
             f"{sequences} sequences a cell (seed 0), 24 cells; KV: the plan's layer-weighted "
             "`comm_tokens` (all-to-all-v).", "",
             "| mask | plans | less KV | same | more KV | miss R with | miss R without |",
             "|---|---|---|---|---|---|---|"]
    for name, text in MASKS.items():
        mask = parse_layers_text(text)
        counts = [0, 0, 0, 0, 0, 0]
        for source in ("wlbllm", "family:pile"):
            for context in (131072, 524288):
                for lengths in pack_sequences(make_source(source), context_length=context,
                                              num_sequences=sequences, seed=0):
                    for n in (4, 8, 32):
                        request = PlanRequest(doc_lengths=tuple(lengths), cp_size=n,
                                              context_length=context, mask=mask)
                        new = solve(request, check=False).metrics
                        with patched("repaired_layout", lambda *args: None):
                            old = solve(request, check=False).metrics
                        counts[0] += 1
                        counts[1 + (new.comm_tokens >= old.comm_tokens)
                               + (new.comm_tokens > old.comm_tokens)] += 1
                        counts[4] += new.imbalance > request.imbalance_target
                        counts[5] += old.imbalance > request.imbalance_target
        lines.append(f"| {name} | " + " | ".join(f"{c:,}" for c in counts) + " |")
    return lines


def repair_share(lengths: list[int], n: int, context: int | None, mask: AttentionMask
                 ) -> float:
    """The repair's and its pricing's CPU time over the causal solve's (0 where flashcp's
    causal plan meets R under ``mask``)."""
    causal = PlanRequest(doc_lengths=tuple(lengths), cp_size=n, context_length=context)
    request = replace(causal, mask=mask)
    target = request.imbalance_target
    base = listed(causal_flashcp_layout(request.doc_lengths, request))
    priced = flashcp_masked.price("flashcp", base, request, "alltoallv")
    if priced.imbalance <= target:
        return 0.0
    prefix = WeightedPrefix(request.doc_lengths, mask)
    most = max(math.floor(target * -(-prefix.offsets[-1] // n)), priced.tokens)

    def repair() -> None:
        out = repaired_layout(base, priced.work, prefix, mask, target, most)
        if out is not None:
            flashcp_masked.price("flashcp repaired", listed(out), request, "alltoallv")

    return cpu_ms(repair) / cpu_ms(partial(solve, causal, check=False))


def repair_cost() -> list[str]:
    lines = ["", "## 2. The repair's cost over the causal solve", "",
             "Where flashcp's causal plan misses R under the mask: the repair and the pricing "
             "of its layout, over the causal solve of the same sequence (0 where it meets R); "
             "3 packed sequences (seed 0) per source.", "",
             "| tokens | N | mask | median | largest |", "|---|---|---|---|---|"]
    for context in TIMING_CONTEXTS:
        seqs = [lengths for source in TIMING_SOURCES
                for lengths in pack_sequences(make_source(source), context_length=context,
                                              num_sequences=3, seed=0)]
        for n in TIMING_CP:
            for name, text in MASKS.items():
                mask = parse_layers_text(text)
                shares = [repair_share(lengths, n, context, mask) for lengths in seqs]
                lines.append(f"| {context // 1024}K | {n} | {name} | {np.median(shares):.2f} | "
                             f"{max(shares):.2f} |")
                print(lines[-1], flush=True)
    return lines


def large_requests() -> list[str]:
    lines = ["", "## 3. Large requests: the per_doc fallback bounded and not", "",
             "Lognormal(3, 1.5) document lengths (seed 2), clipped to [1, 50,000]; CPU ms of "
             "one `solve(check=False)`.", "",
             "| mask | docs | N | causal ms | masked ms | masked ms, per_doc unbounded | chosen |",
             "|---|---|---|---|---|---|---|"]
    rng = np.random.default_rng(2)
    for name, text in MASKS.items():
        mask = parse_layers_text(text)
        for docs, n in LARGE:
            lengths = tuple(int(x) for x in rng.lognormal(3, 1.5, docs).clip(1, 50000))
            causal = PlanRequest(doc_lengths=lengths, cp_size=n)
            request = replace(causal, mask=mask)
            c = cpu_ms(partial(solve, causal, check=False))
            start = time.process_time()
            plan = solve(request, check=False)
            m = (time.process_time() - start) * 1e3
            with patched("PER_DOC_CHUNKS", 1 << 62):
                start = time.process_time()
                solve(request, check=False)
                u = (time.process_time() - start) * 1e3
            lines.append(f"| {name} | {docs:,} | {n} | {c:.0f} | {m:.0f} | {u:.0f} | "
                         f"{plan.info['mask_candidate']} |")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=40)
    parser.add_argument("--out", default="bench/results/window_repair.md")
    args = parser.parse_args()
    started = time.time()
    lines = ["# flashcp under a mask: the repaired candidate and the bounded per_doc fallback",
             "", f"Command: `python -m bench.window_repair --sequences {args.sequences}`",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f} at "
             "start.", ""]
    lines += plan_by_plan(args.sequences) + repair_cost() + large_requests()
    lines += ["", f"Load average at end {os.getloadavg()[0]:.1f}; wall time "
              f"{time.time() - started:.0f} s."]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
