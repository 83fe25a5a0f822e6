"""How the ILP's value and proven bound move with its time limit, on chosen sequences.

    python -m bench.ilp_limit --dataset code --sequences 3,15,50 --limits 10,60

Sequences are numbered as in ``bench.ilp_compare``'s log (1-based, same packing and
seed; ``bench.picked``), so the ones with the largest gaps there can be looked at with a
longer limit: if the value falls, the search is the weaker side; if the bound rises, the
bound is. A limit is ``options.time_limit_s``: the wall-clock limit of the whole solve
(capped at 60 s), whose deterministic budget is ``Tuning.dtime_per_s`` deterministic
seconds per second of it, printed beside each row; ``deterministic`` is False where the
wall clock, not the budget, ended the search.

``--repeat R`` solves every (sequence, limit) R times and reports whether all R plans were
the same byte for byte (the determinism the ILP promises):

    python -m bench.ilp_limit --dataset code --sequences 50 --limits 60 --repeat 3
"""

from __future__ import annotations

import argparse

from bench.picked import add_arguments, picked_sequences
from planner_service.core.request import PlanRequest
from planner_service.solvers.ilp import TUNING
from planner_service.solvers.registry import timed_solve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, default_sequences="3,15,50")
    parser.add_argument("--limits", default="10,60",
                        help="options.time_limit_s values, wall seconds (capped at 60)")
    parser.add_argument("--repeat", type=int, default=1, help="solves per (sequence, limit)")
    args = parser.parse_args()

    picked = picked_sequences(args)
    print(f"{args.dataset}, N = {args.cp}, C = {args.context}, R = {args.imbalance_target}, "
          f"ILP blocks 2048, 2 workers, budget {TUNING.dtime_per_s:g} deterministic s per second "
          "of the limit\n")
    print("| sequence | limit s | budget det. s | value | bound | gap | status | deterministic | "
          "wall s | same plan |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k, lengths in picked:
        for limit in (float(x) for x in args.limits.split(",")):
            request = PlanRequest(doc_lengths=tuple(lengths), cp_size=args.cp,
                                  context_length=args.context,
                                  imbalance_target=args.imbalance_target, strategy="ilp",
                                  options={"time_limit_s": limit, "granularity": 2048, "workers": 2})
            solves = [timed_solve(request, check=False) for _ in range(args.repeat)]
            plan, ms = solves[0].parsed(), solves[0].solve_ms
            same = len({s.plan_json for s in solves}) == 1
            info = plan.info
            budget = TUNING.dtime_per_s * info["time_limit_s"]
            print(f"| {k} | {info['time_limit_s']:g} | {budget:.2f} | {info['objective_value']} | "
                  f"{info['best_bound']} | "
                  f"{info['gap']:.3f} | {info['status']} | {info['deterministic']} | {ms / 1e3:.1f} | "
                  f"{f'{same} ({args.repeat} solves)' if args.repeat > 1 else '-'} |", flush=True)


if __name__ == "__main__":
    main()
