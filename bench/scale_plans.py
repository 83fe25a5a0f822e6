"""Are two source trees' plans byte-identical? A few hundred varied requests solved in each.

    python -m bench.scale_plans --base /path/to/main/checkout          # this tree against it
    python -m bench.scale_plans --base A --new B --only flashcp --quick
    python -m bench.scale_plans --base /path/to/main --cache /tmp/main_plans.json  # base once
    python -m bench.scale_plans --base /path/to/main --out bench/results/scale_plans.md

Each tree solves every request in its own process (``PYTHONPATH`` = the tree) and reports,
per request, the sha256 of the plan's canonical JSON (``Plan.to_json``: every shard, figure
and the plan_id) and the plan's imbalance and comm savings, or the field and message of a
refusal (a FieldError: e.g. a ring too large for the step-time model to price); the
requests whose digests differ are listed with those figures in both trees and their means,
and the exit status is 1. ``--out`` writes the same as markdown.

Requests (``requests``): packed sequences of the two shared data sets and every parametric
family at 32K to 2M tokens over N = 1 .. 1024, every comm_mode and several R; adversarial
inputs (one doc filling the context, thousands of one-token docs, more ranks than tokens,
2M tokens in 10 .. 100,000 equal docs, two lengths, seeded random lengths); strategies
flashcp (all of them) and, as they share the plan build, flashcp_paper, llama3, per_doc
and ring on a subset.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

COMM_MODES = ("alltoallv", "compact_allgather", "full", "p2p_ring")
OTHER_STRATEGIES = ("flashcp_paper", "llama3", "per_doc", "ring")


def requests(quick: bool) -> Iterator[tuple[str, dict]]:
    """(name, PlanRequest fields) of every request, in a fixed order."""
    from planner_service.data import FAMILIES, make_source, pack_sequences

    sources = ("wlbllm", "code", *(f"family:{name}" for name in sorted(FAMILIES)))
    cells = ((32768, (1, 2, 3, 4, 8, 9, 16, 32, 64, 1024)), (131072, (2, 4, 8, 17, 64, 256, 1024)),
             (524288, (8, 128, 1024)), (2097152, (4, 1024)))
    for context, ns in cells[:2] if quick else cells:
        for s, source in enumerate(sources):
            seqs = pack_sequences(make_source(source), context_length=context,
                                  num_sequences=1 if quick or context > 131072 else 2, seed=s)
            for q, seq in enumerate(seqs):
                for i, n in enumerate(ns):
                    mode = COMM_MODES[(s + q + i) % len(COMM_MODES)]
                    target = (1.05, 1.0, 1.02, 1.2)[(s + i) % 4]
                    yield (f"{source} {context} #{q} N={n} {mode} R={target}",
                           dict(doc_lengths=seq, cp_size=n, comm_mode=mode,
                                imbalance_target=target))
                    if q == 0 and i % 3 == 0:
                        strategy = OTHER_STRATEGIES[(s + i) % len(OTHER_STRATEGIES)]
                        yield (f"{source} {context} N={n} {strategy}",
                               dict(doc_lengths=seq, cp_size=n, strategy=strategy))
    rng = random.Random(0)
    adversarial: list[tuple[str, list[int], int]] = []
    for n in (1, 2, 7, 8, 16, 19, 64, 1000, 1024):
        adversarial.append((f"one doc of 131072, N={n}", [131072], n))
    adversarial += [
        ("one doc of 2097152, N=1024", [2097152], 1024),
        ("300 one-token docs, N=1024", [1] * 300, 1024),
        ("100 docs of 7, N=999", [7] * 100, 999),
        ("3000 one-token docs, N=8", [1] * 3000, 8),
        ("3000 one-token docs, N=1024", [1] * 3000, 1024),
        ("10000 one-token docs, N=1024", [1] * 10000, 1024),
        ("6 tokens in 3 docs, N=1024", [3, 2, 1], 1024),
        ("5 tokens, N=1", [5], 1),
        ("docs 4099,37,1023,8191,1,511, N=4", [4099, 37, 1023, 8191, 1, 511], 4),
    ]
    for d in ((10, 1000, 10_000) if quick else (10, 100, 1000, 10_000, 100_000)):
        length, extra = divmod(2097152, d)
        for n in (8, 9, 16, 64, 256, 1024) if d <= 10_000 or not quick else (8,):
            adversarial.append((f"{d} equal docs, N={n}", [length + (i < extra) for i in range(d)], n))
    for n in (4, 8, 16, 256, 1024):
        adversarial.append((f"two lengths, N={n}", [300] * 500 + [17] * 4000 + [5000] * 7, n))
    for k in range(10 if quick else 40):
        n = rng.choice((1, 2, 3, 5, 8, 12, 16, 33, 64, 100, 512, 1024))
        d = rng.choice((1, 3, 10, 50, 200, 1000, 5000))
        top = rng.choice((4, 64, 1000, 30000))
        adversarial.append((f"random #{k}, N={n}", [rng.randint(1, top) for _ in range(d)], n))
    for i, (name, seq, n) in enumerate(adversarial):
        mode = COMM_MODES[i % len(COMM_MODES)] if i % 2 else "alltoallv"
        yield f"{name} {mode}", dict(doc_lengths=seq, cp_size=n, comm_mode=mode,
                                     imbalance_target=1.05)


FIGURES = ("imbalance", "comm_saving_alltoallv", "comm_saving_allgather")
"""Plan metrics reported beside each digest."""


def digests(quick: bool, only: str | None) -> dict[str, dict]:
    """In the tree on ``sys.path``: per request, the sha256 of its plan's JSON and its
    ``FIGURES``."""
    from planner_service.core.errors import FieldError
    from planner_service.core.request import PlanRequest
    from planner_service.solvers.registry import solve

    out = {}
    for name, fields in requests(quick):
        if only and fields.get("strategy", "flashcp") != only:
            continue
        request = PlanRequest(**{**fields, "doc_lengths": tuple(fields["doc_lengths"])})
        try:
            plan = solve(request, check=False)
        except FieldError as exc:  # a documented refusal (e.g. a ring too large to model)
            out[name] = {"digest": f"refused: {exc.field}: {exc}",
                         **{f: float("nan") for f in FIGURES}}
            continue
        out[name] = {"digest": hashlib.sha256(plan.to_json().encode()).hexdigest(),
                     **{f: getattr(plan.metrics, f) for f in FIGURES}}
    return out


def report(base: dict[str, dict], new: dict[str, dict], differ: Sequence[str]) -> list[str]:
    """Markdown lines: the differing requests' figures in both trees, and their means."""
    lines = [f"{len(base) - len(differ)} / {len(base)} plans identical.", ""]
    if not differ:
        return lines
    lines += ["| request | imbalance base | new | saving a2av base | new | saving compact AG base | new |",
              "|---|---|---|---|---|---|---|"]

    def row(name: str, b: dict, n: dict) -> str:
        return (f"| {name} | {b['imbalance']:.4f} | {n['imbalance']:.4f} | "
                f"{b['comm_saving_alltoallv']:.2%} | {n['comm_saving_alltoallv']:.2%} | "
                f"{b['comm_saving_allgather']:.2%} | {n['comm_saving_allgather']:.2%} |")

    for name in differ:
        lines.append(row(name, base[name], new[name]))
    means = [{f: statistics.fmean(tree[name][f] for name in differ) for f in FIGURES}
             for tree in (base, new)]
    lines.append(row(f"mean of the {len(differ)}", *means))
    return lines


def _run(tree: str, args: argparse.Namespace) -> dict[str, dict]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    command += ["--quick"] if args.quick else []
    command += ["--only", args.only] if args.only else []
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": tree, "PYTHONDONTWRITEBYTECODE": "1"},
                          cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="the other source tree (a checkout's root)")
    parser.add_argument("--new", default=str(Path(__file__).resolve().parents[1]),
                        help="default: this tree")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller requests")
    parser.add_argument("--only", default=None, help="only this strategy's requests")
    parser.add_argument("--cache", default=None,
                        help="JSON file of the base tree's digests: read if present, else written")
    parser.add_argument("--out", default=None, help="markdown report (default: print only)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(digests(args.quick, args.only)))
        return
    if not args.base:
        parser.error("--base is required")
    cache = Path(args.cache) if args.cache else None
    if cache is not None and cache.exists():
        base = json.loads(cache.read_text())
    else:
        base = _run(args.base, args)
        if cache is not None:
            cache.write_text(json.dumps(base, indent=0) + "\n")
    new = _run(args.new, args)
    differ = [name for name in base if name in new and base[name]["digest"] != new[name]["digest"]]
    lines = report(base, new, differ)
    print("\n".join(lines))
    if args.out:
        command = " ".join(["python -m bench.scale_plans", *(argv if argv is not None else sys.argv[1:])])
        Path(args.out).write_text(
            "# flashcp plans of two source trees\n\n"
            f"Command: `{command}`. Requests: `bench.scale_plans.requests` (module docstring); "
            "figures of the plans that differ (R as each request sets it).\n\n"
            + "\n".join(lines) + "\n")
    sys.exit(1 if differ or base.keys() != new.keys() else 0)


if __name__ == "__main__":
    main()
