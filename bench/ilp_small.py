"""How far the ILP gets on a small request within the budget of each time limit.

    python -m bench.ilp_small                          # 4 docs, 7K tokens, N = 4 and 8
    python -m bench.ilp_small --ranks 4 --limits 10,40

The request is 4 documents (3000, 2000, 1200, 800 tokens) at R = 1.05; each (N, limit) is
solved once (the plan depends on the limit's deterministic budget, not on the machine).
Per case: the budget in deterministic seconds, the status, value, bound and gap, whether
the wall-clock deadline cut it, and the wall time (which does depend on the machine's
load, printed beside the table). Prints a Markdown table and writes it to ``--out``
(bench/results/ilp_small.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from planner_service.core.request import PlanRequest
from planner_service.solvers.ilp import TUNING
from planner_service.solvers.registry import prepare, solve

DOCS = (3000, 2000, 1200, 800)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="4,8")
    parser.add_argument("--limits", default="10,40", help="options.time_limit_s values")
    parser.add_argument("--out", type=Path, default=Path("bench/results/ilp_small.md"))
    args = parser.parse_args()
    prepare("ilp")
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    emit("# ILP on a small request: 4 documents, 7K tokens")
    emit("")
    emit(f"Command: `python -m bench.ilp_small {' '.join(sys.argv[1:])}`".rstrip())
    emit("")
    emit(f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), Python "
         f"{platform.python_version()}; load average at start "
         f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} (other jobs share these cores). "
         f"Docs {', '.join(map(str, DOCS))}, R = 1.05, workers 2 (the default); budget = "
         f"{TUNING.dtime_per_s:g} deterministic s per second of the limit.")
    emit("")
    emit("| N | time_limit_s | budget det. s | status | value | bound | gap | cut | wall s |")
    emit("|---|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.ranks.split(",")):
        for limit in (float(x) for x in args.limits.split(",")):
            request = PlanRequest(doc_lengths=DOCS, cp_size=n, strategy="ilp",
                                  options={"time_limit_s": limit})
            start = time.perf_counter()
            info = solve(request, check=False).info
            wall = time.perf_counter() - start
            emit(f"| {n} | {limit:g} | {TUNING.dtime_per_s * limit:.2f} | {info['status']} | "
                 f"{info['objective_value']} | {info['best_bound']} | {info['gap']:.3f} | "
                 f"{'yes' if not info['deterministic'] else 'no'} | {wall:.1f} |")
    emit("")
    emit(f"Load average at end {', '.join(f'{x:.2f}' for x in os.getloadavg())}.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
