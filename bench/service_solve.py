"""The solve behind one ``/v1/plan``: the library's checks against the service's, side by side.

    python -m bench.service_solve --batches 8 --repeat 5

The service checks a request's strategy and options at its edge
(``PlannerService.request``: ``checked_strategy``), then its solver process runs
``worker_tasks.solve_in_worker``: the solve with ``admitted=True`` (no second strategy
check; the self-check takes the metrics ``build_plan`` computed), the headline metrics
and the JSON. ``library`` is the same edge check followed by the library's solve
(``timed_solve``: the strategy checked again, the metrics recomputed by the validator),
with the same headline and JSON: what the solver process ran before. Both run on the same
requests, alternated, in one process; per case the table gives the median CPU time
(``time.process_time``) of each and their ratio, and checks that both give the same
plan bytes (the SHA-256 of every plan's JSON is printed at the end, to compare runs).

Requests: packed 128K-token sequences of the WLB-LLM and code samples (seeded), on 4
and 8 ranks, with the fast strategies, causal and under a sliding-window mask (5 layers
of window 4096 to 1 full layer).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

from planner_service.core.mask import parse_layers
from planner_service.core.request import PlanRequest
from planner_service.data import make_source, pack_sequences
from planner_service.service.worker_tasks import solve_in_worker
from planner_service.solvers.registry import checked_strategy, timed_solve

STRATEGIES = ("flashcp", "per_doc", "llama3", "zigzag")
WINDOWED = parse_layers([{"window": 4096, "count": 5}, {"window": None, "count": 1}])


def library_path(request: PlanRequest) -> str:
    """The edge check, then the library's solve, headline metrics and JSON."""
    checked_strategy(request)
    solved = timed_solve(request)
    assert solved.plan is not None
    m = solved.plan.metrics
    _ = {"imbalance": m.imbalance, "comm_tokens": m.comm_tokens,
         "full_comm_tokens": m.full_comm_tokens, "comm_saving": m.comm_saving,
         "est_step_ms": m.est_step_ms, "tokens_per_rank": m.tokens_per_rank}
    return solved.plan_json


def service_path(request: PlanRequest) -> str:
    """The edge check, then what the solver process runs."""
    checked_strategy(request)
    return solve_in_worker(request).plan_json


def requests(batches: int, context: int, seed: int) -> list[tuple[str, PlanRequest]]:
    out = []
    for dataset in ("wlbllm", "code"):
        sequences = pack_sequences(make_source(dataset), context_length=context,
                                   num_sequences=batches, seed=seed)
        for n in (4, 8):
            for strategy in STRATEGIES:
                for masked in (False, True):
                    case = f"{dataset} N={n} {strategy}{' windowed' if masked else ''}"
                    for seq in sequences:
                        request = PlanRequest(doc_lengths=tuple(seq), cp_size=n,
                                              context_length=context, strategy=strategy)
                        out.append((case, replace(request, mask=WINDOWED) if masked
                                    else request))
    return out


def load_average() -> str:
    path = Path("/proc/loadavg")
    return " ".join(path.read_text().split()[:3]) if path.exists() else "?"


def cpu_ms(fn: object, request: PlanRequest) -> tuple[float, str]:
    start = time.process_time()
    text = fn(request)  # type: ignore[operator]
    return (time.process_time() - start) * 1e3, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/service_solve.md")
    args = parser.parse_args()
    load_before = load_average()
    cases: dict[str, tuple[list[float], list[float]]] = {}
    digest = hashlib.sha256()
    for case, request in requests(args.batches, args.context, args.seed):
        library_path(request)  # warm: imports, first-use tables
        old, new = cases.setdefault(case, ([], []))
        for _ in range(args.repeat):
            a, text_a = cpu_ms(library_path, request)
            b, text_b = cpu_ms(service_path, request)
            assert text_a == text_b, f"{case}: the two paths gave different plans"
            old.append(a)
            new.append(b)
        digest.update(hashlib.sha256(text_b.encode()).digest())
    lines = [
        "# The /v1/plan solve: library checks vs the service's",
        "",
        f"Command: `python -m bench.service_solve --batches {args.batches} --repeat "
        f"{args.repeat} --context {args.context} --seed {args.seed}`",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
        f"(shared), Python {platform.python_version()}; load average (1, 5, 15 min) "
        f"{load_before} before, {load_average()} after.",
        "CPU ms per solve (median over sequences x repeats, the two paths alternated); "
        "`library`: edge check + `timed_solve` (second strategy check, validator recomputes "
        "the metrics); `service`: edge check + `solve_in_worker` (`admitted=True`).",
        "",
        "| case | library ms | service ms | service / library |",
        "|---|---|---|---|",
    ]
    all_old, all_new = [], []
    for case, (old, new) in cases.items():
        a, b = statistics.median(old), statistics.median(new)
        all_old += old
        all_new += new
        lines.append(f"| {case} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
    a, b = statistics.median(all_old), statistics.median(all_new)
    lines += [f"| all | {a:.3f} | {b:.3f} | {b / a:.3f} |", "",
              f"Plans: identical from both paths; SHA-256 over every plan's hash: "
              f"`{digest.hexdigest()}`."]
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
