"""The ILP relaxation's two grains side by side, on chosen sequences.

    python -m bench.ilp_relax --dataset code --sequences 25,30,78 --limit 4

Sequences are numbered as in ``bench.ilp_compare``'s log (1-based, same packing and seed).
Each grain's relaxation (``ilp_relax.GRAINS``: the fluid as token positions, or as the
full model's blocks) is built from the same blocks as ``ilp`` builds and minimised alone
with no floor, as one stage of ``ilp._relaxed_bound`` does (an optimisation run, the
question "below its value?", a bisection), within ``--limit`` deterministic seconds,
hinted as in ``ilp``: with the kept docs' blocks of the placement that ``--search``
deterministic seconds of rank-group steps reach from the flashcp plan (4 s: what ``ilp``
spends before its relaxation at a 10 s limit; 0: the flashcp plan itself). The proven
bound and the deterministic time used show which grain's bound is tighter and which
CP-SAT proves in time.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from planner_service.data import make_source, pack_sequences
from planner_service.solvers import ilp
from planner_service.solvers.ilp_blocks import cut_blocks, layout_cuts, place_blocks
from planner_service.solvers.ilp_model import BlockModel, canonical_ranks, placement_values
from planner_service.solvers.ilp_relax import GRAINS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="code")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--sequences", default="25,30,78", help="1-based, as in bench.ilp_compare")
    parser.add_argument("--limit", type=float, default=4.0, help="deterministic seconds per solve")
    parser.add_argument("--search", type=float, default=4.0,
                        help="deterministic seconds of rank-group steps before the hint")
    parser.add_argument("--imbalance-target", type=float, default=1.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    picked = [int(x) for x in args.sequences.split(",")]
    sequences = pack_sequences(make_source(args.dataset), context_length=args.context,
                               num_sequences=max(picked), seed=args.seed)
    n = args.cp
    print(f"{args.dataset}, N = {n}, C = {args.context}, R = {args.imbalance_target}, ILP blocks "
          f"2048, limit {args.limit:g} s (deterministic), 2 workers, hint after {args.search:g} s "
          "of rank-group steps\n")
    print("| sequence | grain | proven bound | deterministic s |")
    print("|---|---|---|---|")
    for k in picked:
        lengths = sequences[k - 1]
        cap = ilp.workload_cap(lengths, n, args.imbalance_target)
        tokens = -(-sum(lengths) // n)
        hint_shards, _ = ilp.flashcp_shards(lengths, n, args.imbalance_target)
        cuts = layout_cuts(hint_shards)
        blocks = cut_blocks(lengths, 2048, cuts,
                            head_docs=ilp.head_docs(lengths, cuts, ilp.HEAD_DOCS_PER_RANK * n))
        hint = canonical_ranks(blocks, place_blocks(blocks, hint_shards), n)
        subs = ilp._subproblems(blocks, lengths, n, tokens, cap, 2)
        if args.search > 0:
            start = ilp._Search(hint, max(placement_values(blocks, hint, n)[2]), 0, 0.0, True)
            hint = subs.group_search(start, args.search, ilp.GROUP_STEP_SHARE * 10.0).ranks
        for grain in GRAINS:
            def model(ranks: list[int] | None, grain: str = grain,
                      build: Callable[..., BlockModel] = subs.relaxation) -> BlockModel:
                return build(ranks, grain, 0)

            bound, spent, _ = ilp._relaxed_stage(model, subs.relaxed_value, args.limit, 10.0, 2,
                                                 subs.relaxed_ranks(hint))
            print(f"| {k} | {grain} | {bound} | {spent:.1f} |", flush=True)


if __name__ == "__main__":
    main()
