"""What a large plan costs after its layout: JSON, structure check, the service's solve.

    python -m bench.plan_build --cells code:100000:16 wlbllm:100000:1024 equal:100000:1024

Per cell (``SOURCE:D:N``: D mixed lengths of a shared data set or family, about 2M tokens
as ``bench.cluster`` builds them, or D equal documents), one flashcp plan is built and
each pair below is timed side by side in one process, alternating, and checked to give the
same answer (CPU ms, ``time.process_time``, the median of ``--repeat``):

- ``to_json``: the plan as ``build_plan`` made it (its shards' JSON kept, ``Plan.made``)
  against the same plan without it (every shard written again);
- the structure check: ``validate.structure_holds`` (numpy) against
  ``validate.structure_problems`` (shard by shard, the reference);
- ``validate_plan(plan, metrics=False)`` (the service's self-check), and the solve the
  service's solver process runs (``timed_solve(admitted=True)``: solve, self-check, JSON)
  beside the bare ``solve(check=False)``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.scale import mixed_lengths
from planner_service.core.request import PlanRequest
from planner_service.core.validate import structure_holds, structure_problems, validate_plan
from planner_service.solvers.registry import solve, timed_solve

TOKENS = 2_000_000
TARGET = 1.05


def cpu_ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.process_time()
    out = fn()
    return (time.process_time() - start) * 1e3, out


def lengths_of(source: str, docs: int) -> list[int]:
    if source == "equal":
        length, extra = divmod(TOKENS, docs)
        return [length + (i < extra) for i in range(docs)]
    return mixed_lengths(source, docs, TOKENS)


def pairs(request: PlanRequest) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    plan = solve(request)
    bare = replace(plan, made=None)
    return {
        "to_json: made / written again": (plan.to_json, bare.to_json),
        "structure: numpy / reference": (lambda: structure_holds(plan),
                                         lambda: not structure_problems(plan)),
        "service solve / bare solve": (lambda: timed_solve(request, admitted=True).plan_json,
                                       lambda: solve(request, check=False).to_json()),
        "validate(metrics=False) / -": (lambda: validate_plan(plan, metrics=False),
                                        lambda: None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", nargs="+",
                        default=["code:100000:16", "wlbllm:100000:1024", "equal:100000:1024"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="bench/results/plan_build.md")
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = []
    for cell in args.cells:
        source, docs, n = cell.rsplit(":", 2)
        request = PlanRequest(doc_lengths=tuple(lengths_of(source, int(docs))), cp_size=int(n),
                              context_length=None, imbalance_target=TARGET)
        for name, (a, b) in pairs(request).items():
            times_a, times_b = [], []
            for _ in range(args.repeat):
                ta, out_a = cpu_ms(a)
                tb, out_b = cpu_ms(b)
                if not name.startswith("validate"):
                    assert out_a == out_b, f"{cell} {name}: the two sides differ"
                times_a.append(ta)
                times_b.append(tb)
            ma, mb = statistics.median(times_a), statistics.median(times_b)
            ratio = f"{ma / mb:.2f}" if mb > 0.05 else "-"
            rows.append(f"| {cell} | {name} | {ma:.1f} | {mb:.1f} | {ratio} |")
            print(rows[-1], flush=True)
    lines = [
        "# A large plan after its layout: JSON, structure check, the service's solve",
        "",
        f"Command: `python -m bench.plan_build --cells {' '.join(args.cells)} --repeat "
        f"{args.repeat}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; load average (1, 5, 15 min) before "
        f"{', '.join(f'{x:.2f}' for x in load_before)}, after "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}.",
        f"CPU ms (`time.process_time`), median of {args.repeat}, the two sides alternated; "
        "every pair but the last checked to give the same answer. Cells: SOURCE:D:N, D "
        f"documents of about {TOKENS:,} tokens, flashcp at R = {TARGET}.",
        "",
        "| cell | pair (a / b) | a ms | b ms | a / b |",
        "|---|---|---|---|---|",
        *rows,
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
