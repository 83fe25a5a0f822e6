"""The ILP's bounds side by side on chosen sequences: the relaxation's two grains and the
branch and bound on the longest doc's ends.

    python -m bench.ilp_relax --dataset code --sequences 25,30,78 --limit 4
    python -m bench.ilp_relax --dataset code --sequences 2,13,44 --limit 4 --complete 2

Sequences are numbered as in ``bench.ilp_compare``'s log (1-based, same packing and seed;
``bench.picked``).
Each grain's relaxation (``ilp_relax.GRAINS``: the fluid as token positions, or as the
full model's blocks) is built from the same blocks as ``ilp`` builds and minimised alone
with no floor, as one stage of ``ilp._relaxed_bound`` does (an optimisation run, the
question "below its value?", a bisection), within ``--limit`` deterministic seconds,
hinted as in ``ilp``: with the kept docs' blocks of the placement that ``--search``
deterministic seconds of rank-group steps reach from the flashcp plan (0: the flashcp plan
itself; ``ilp`` spends ``Tuning.group_share`` of its budget on them before its
relaxation, 0.12 deterministic seconds at its default 10 s limit). The proven
bound and the deterministic time used show which grain's bound is tighter and which
CP-SAT proves in time. A last row per sequence gives the bound of ``ilp_ends`` (branching
on where each rank's part of the longest doc ends) within the same ``--limit``, as ``ilp``
counts its time, with no incumbent to stop at.

``--complete S`` asks, after both grains, which side of the ILP's gap a tight bound leaves
open (``completion``): a placement of the kept docs that the blocks relaxation allows at
the larger bound is fixed in the full model, and CP-SAT (2 workers, S deterministic
seconds) looks for a placement of the rest within ``--within`` (1%) of the bound. *found*:
the bound is within 1% of the optimum, and a search that reaches it would close the gap;
*none*: that kept placement cannot be completed (another might); *undecided*: neither in
time.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from bench.picked import add_arguments, picked_sequences
from planner_service.solvers import ilp
from planner_service.solvers.flashcp import flashcp_shards
from planner_service.solvers.ilp.blocks import Blocks, cut_blocks, layout_cuts, place_blocks
from planner_service.solvers.ilp.cpsat import Cp, chosen, run, solve_model
from planner_service.solvers.ilp.model import (
    BlockModel,
    build_model,
    canonical_ranks,
    placement_values,
)
from planner_service.solvers.ilp.relax import GRAINS, must_split
from planner_service.solvers.ilp.search import relaxed_stage
from planner_service.solvers.ilp.strategy import HEAD_DOCS_PER_RANK
from planner_service.solvers.ilp.subproblems import Search, Subproblems

NO_INCUMBENT = 2**62
CP = Cp(workers=2, deadline=math.inf, tuning=ilp.TUNING)
"""2 CP-SAT workers; each stage has its own budget, and no deadline for the whole run."""
"""``ilp_ends`` stops at the incumbent's value; here it has none."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, default_sequences="25,30,78")
    parser.add_argument("--limit", type=float, default=4.0, help="deterministic seconds per solve")
    parser.add_argument("--search", type=float, default=4.0,
                        help="deterministic seconds of rank-group steps before the hint")
    parser.add_argument("--complete", type=float, default=0.0,
                        help="deterministic seconds for the completion question (0: not asked)")
    parser.add_argument("--within", type=float, default=0.01,
                        help="the completion question's tolerance above the bound")
    args = parser.parse_args()

    n = args.cp
    print(f"{args.dataset}, N = {n}, C = {args.context}, R = {args.imbalance_target}, ILP blocks "
          f"2048, limit {args.limit:g} s (deterministic), 2 workers, hint after {args.search:g} s "
          "of rank-group steps\n")
    print("| sequence | grain | proven bound | deterministic s | completion |")
    print("|---|---|---|---|---|")
    for k, lengths in picked_sequences(args):
        cap = ilp.workload_cap(lengths, n, args.imbalance_target)
        tokens = -(-sum(lengths) // n)
        hint_shards, _ = flashcp_shards(lengths, n, args.imbalance_target)
        cuts = layout_cuts(hint_shards)
        blocks = cut_blocks(lengths, 2048, cuts,
                            head_docs=ilp.head_docs(lengths, cuts, HEAD_DOCS_PER_RANK * n))
        hint = canonical_ranks(blocks, place_blocks(blocks, hint_shards), n)
        subs = Subproblems(blocks, lengths, n, tokens, cap, CP)
        if args.search > 0:
            start = Search(hint, max(placement_values(blocks, hint, n)[2]), 0, 0.0, True)
            hint = subs.group_search(start, args.search, ilp.TUNING.group_step_share * 10.0).ranks
        best = 0
        for grain in GRAINS:
            def model(ranks: list[int] | None, grain: str = grain,
                      build: Callable[..., BlockModel] = subs.relaxation) -> BlockModel:
                return build(ranks, grain, 0)

            bound, spent, _ = relaxed_stage(model, subs.relaxed_value, args.limit, 10.0, CP,
                                             subs.relaxed_ranks(hint))
            best = max(best, bound)
            last = grain == GRAINS[-1] and args.complete > 0
            done = completion(subs, blocks, lengths, n, tokens, cap, best, args) if last else "-"
            print(f"| {k} | {grain} | {bound} | {spent:.1f} | {done} |", flush=True)
        # The bound of ilp_ends alone, with the same budget and no incumbent to stop at.
        bound, spent, _ = subs.ends_bound(NO_INCUMBENT, args.limit)
        print(f"| {k} | longest doc's ends | {bound} | {spent:.1f} | - |", flush=True)


def completion(subs: Subproblems, blocks: Blocks, lengths: list[int], n: int, tokens: int,
               cap: int, bound: int, args: argparse.Namespace) -> str:
    """The completion question: take a placement of the kept docs' blocks that the blocks
    relaxation allows at critical-path KV ``bound``, fix it in the full model, and ask
    whether a placement of every block then reaches at most bound x (1 + ``--within``)."""
    relaxed = subs.relaxation(None, GRAINS[-1], 0)
    relaxed.model.Add(relaxed.comm_max <= bound)
    kept_run = run(relaxed, None, args.complete, CP._replace(workers=1))
    if kept_run.ranks is None:
        return f"no kept placement at {bound} ({kept_run.status})"
    target = int(bound * (1 + args.within))
    full = build_model(blocks, n, token_cap=tokens, work_cap=cap, symmetric=False)
    kept = [b for d in must_split(lengths, tokens, cap) for b in blocks.doc_runs[d]]
    for b, rank in zip(kept, kept_run.ranks, strict=True):
        full.model.Add(full.x[b][rank] == 1)
    full.model.Add(full.comm_max <= target)
    solver, status, dtime, _ = solve_model(full.model, args.complete, CP)
    if status in ("OPTIMAL", "FEASIBLE"):
        value = max(placement_values(blocks, chosen(solver, full.x), n)[2])
        return f"found {value} <= {target} in {dtime:.1f} s"
    return f"{'none' if status == 'INFEASIBLE' else 'undecided'} <= {target} ({dtime:.1f} s)"


if __name__ == "__main__":
    main()
