"""How low a KV bound per rank flashcp and fcp can meet, against the lower bound.

    python -m bench.kv_bound --batches 50            # WLB-LLM and code, N = 8, 16, 32

Per packed sequence: the largest ``kv_tokens_peak`` of flashcp's plan without a bound,
the true lower bound ``kv_bound.kv_floor`` (max(longest doc, ceil(S / N)) under
all-to-all-v), and each strategy's figure, the smallest bound it meets (its
``KvBoundError.least`` for a bound of 1), with the candidate and imbalance of its plan at
exactly that bound, and the process CPU time of that refusal (every candidate solved).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections import Counter
from dataclasses import replace

from planner_service.core.request import PlanRequest
from planner_service.data import make_source, pack_sequences
from planner_service.solvers.kv_bound import KvBoundError, kv_floor, plan_peak
from planner_service.solvers.registry import solve


def figure(request: PlanRequest) -> tuple[int, float]:
    """The strategy's figure and the CPU ms of the refusal that names it."""
    start = time.process_time()
    try:
        solve(replace(request, max_kv_tokens_per_rank=1))
    except KvBoundError as exc:
        return exc.least, (time.process_time() - start) * 1e3
    raise AssertionError("a bound of 1 is below every plan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--datasets", default="wlbllm,code")
    parser.add_argument("--cp", default="8,16,32")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategies", default="flashcp,fcp")
    args = parser.parse_args()
    print(f"Command: `python -m bench.kv_bound --batches {args.batches} --datasets "
          f"{args.datasets} --cp {args.cp} --context {args.context} --seed {args.seed} "
          f"--strategies {args.strategies}`")
    print(f"Machine: {platform.machine()}, Python {platform.python_version()}; CPU time of "
          "the refusal of a bound of 1 (all candidates).\n")
    print("| data set | N | strategy | unbounded peak / floor | figure / floor | at floor "
          "| imbalance at figure | candidates chosen at figure | refusal CPU ms p50 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dataset in args.datasets.split(","):
        seqs = pack_sequences(make_source(dataset), context_length=args.context,
                              num_sequences=args.batches, seed=args.seed)
        for n in (int(x) for x in args.cp.split(",")):
            for name in args.strategies.split(","):
                free, least, imb, ms, at = [], [], [], [], 0
                chosen: Counter[str] = Counter()
                for seq in seqs:
                    request = PlanRequest(doc_lengths=tuple(seq), cp_size=n, strategy=name)
                    floor = kv_floor(seq, n, "alltoallv")
                    free.append(plan_peak(solve(request)) / floor)
                    value, cpu_ms = figure(request)
                    plan = solve(replace(request, max_kv_tokens_per_rank=value))
                    least.append(value / floor)
                    at += value == floor
                    imb.append(plan.metrics.imbalance)
                    chosen[str(plan.info["kv_candidate"])] += 1
                    ms.append(cpu_ms)
                top = ", ".join(f"{k} {v}" for k, v in chosen.most_common(3))
                print(f"| {dataset} | {n} | {name} | {statistics.mean(free):.3f} | "
                      f"{statistics.mean(least):.3f} (max {max(least):.3f}) | "
                      f"{at}/{len(seqs)} | {statistics.mean(imb):.2f} (max {max(imb):.2f}) | "
                      f"{top} | {statistics.median(ms):.1f} |")


if __name__ == "__main__":
    main()
