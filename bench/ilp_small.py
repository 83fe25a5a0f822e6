"""How far the ILP gets on small requests within the budget of each time limit.

    python -m bench.ilp_small                                # every instance, N = 2, 4, 8, 16
    python -m bench.ilp_small --instances docs4 --ranks 4 --limits 10,20 --repeat 2

Instances: ``docs4``, 4 documents of 3000, 2000, 1200 and 800 tokens, and seeded draws
from the parametric families (``planner_service.data.families``, seed 40): ``code5``,
``web8``, ``wiki6`` and ``c4-8`` (the family and the document count; 2.5K to 13.5K
tokens). R = 1.05, default options but ``time_limit_s``. Per (instance, N, limit): the
budget in deterministic seconds, the status, value, bound and gap, the deterministic
seconds the search spent (its last ``search.PROGRESS`` record), whether the wall-clock
deadline cut it, the wall time (which depends on the machine's load, printed beside the
table) and, with ``--repeat R``, whether all R plans were the same byte for byte. Prints a
Markdown table and writes it to ``--out`` (bench/results/ilp_small.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from planner_service.core.request import PlanRequest
from planner_service.data.families import get_family
from planner_service.solvers.ilp import TUNING
from planner_service.solvers.registry import prepare, solve

DOCS4 = (3000, 2000, 1200, 800)
FAMILY_DRAWS = {"code5": ("code", 5), "web8": ("web", 8), "wiki6": ("wikipedia", 6),
                "c4-8": ("c4", 8)}
"""Instance name: (family, document count), drawn with seed 40."""


def instance(name: str) -> tuple[int, ...]:
    """The document lengths of a named instance (module docstring)."""
    if name == "docs4":
        return DOCS4
    family, count = FAMILY_DRAWS[name]
    return tuple(int(x) for x in get_family(family).sample(np.random.default_rng(40), count))


class Spent(logging.Handler):
    """Keeps the deterministic seconds of the search's last progress record."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.spent = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.args, tuple) and len(record.args) == 4:
            self.spent = float(record.args[3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", default=",".join(["docs4", *FAMILY_DRAWS]))
    parser.add_argument("--ranks", default="2,4,8,16")
    parser.add_argument("--limits", default="10,20", help="options.time_limit_s values")
    parser.add_argument("--repeat", type=int, default=1, help="solves per case")
    parser.add_argument("--out", type=Path, default=Path("bench/results/ilp_small.md"))
    args = parser.parse_args()
    prepare("ilp")
    spent = Spent()
    search_log = logging.getLogger("planner_service.solvers.ilp.search")
    search_log.setLevel(logging.DEBUG)
    search_log.addHandler(spent)
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    names = args.instances.split(",")
    emit("# ILP on small requests")
    emit("")
    emit(f"Command: `python -m bench.ilp_small {' '.join(sys.argv[1:])}`".rstrip())
    emit("")
    emit(f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), Python "
         f"{platform.python_version()}; load average at start "
         f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} (other jobs share these cores). "
         f"R = 1.05, workers 2 (the default); budget = {TUNING.dtime_per_s:g} deterministic s "
         "per second of the limit. Instances: "
         + "; ".join(f"{name} {', '.join(map(str, instance(name)))}" for name in names) + ".")
    emit("")
    emit("| instance | N | time_limit_s | budget det. s | status | value | bound | gap | "
         "det. s spent | cut | wall s | same plan |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        docs = instance(name)
        for n in (int(x) for x in args.ranks.split(",")):
            for limit in (float(x) for x in args.limits.split(",")):
                request = PlanRequest(doc_lengths=docs, cp_size=n, strategy="ilp",
                                      options={"time_limit_s": limit})
                plans, walls = [], []
                for _ in range(args.repeat):
                    spent.spent = 0.0
                    start = time.perf_counter()
                    plans.append(solve(request, check=False))
                    walls.append(time.perf_counter() - start)
                info = plans[0].info
                same = len({p.to_json() for p in plans}) == 1 if args.repeat > 1 else None
                emit(f"| {name} | {n} | {limit:g} | {TUNING.dtime_per_s * limit:.2f} | "
                     f"{info['status']} | {info['objective_value']} | {info['best_bound']} | "
                     f"{info['gap']:.3f} | {spent.spent:.3f} | "
                     f"{'yes' if not info['deterministic'] else 'no'} | {max(walls):.1f} | "
                     f"{'-' if same is None else 'yes' if same else 'NO'} |")
    emit("")
    emit(f"Load average at end {', '.join(f'{x:.2f}' for x in os.getloadavg())}.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
