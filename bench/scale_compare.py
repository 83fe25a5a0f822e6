"""flashcp solve time of two source trees side by side, on slices of ``bench.scale``'s cases.

    python -m bench.scale_compare --base /path/to/main/checkout --cells 131072:1024 \
        --docs 100000:8 --mixed 100000:1024 --out bench/results/scale_compare.md

Each tree runs in its own process (``PYTHONPATH`` = the tree), rounds alternating between
the trees, so both see the same machine load; per case the minimum over the rounds is kept
(CPU time, ``time.process_time``). Per cell: median and max over its sequences of the layout
(``flashcp_layout``) and of ``solve(check=False)``, the layout's wall time, and how many
plans are byte-identical (same ``plan_id``) between the trees; then every plan that differs,
with its imbalance, KV received and R met in both.

Cases, as ``bench.scale`` builds them: ``--cells TOKENS:N`` are the packed sequences of the
N sweep (the two shared data sets and every family, seed 0; 6 sequences per source at 32K
and 128K, 3 at 512K, 2 at 2M); ``--docs D:N`` is 2M tokens in D equal docs; ``--mixed D:N``
is D mixed lengths from each shared data set and family, about 2M tokens in all, as
``bench.cluster``'s section 2 builds them (``bench.scale.mixed_lengths``); ``--mode`` sets
the request's comm_mode.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

SEQUENCES = {32768: 6, 131072: 6, 524288: 3, 2097152: 2}
DOC_TOKENS = 2097152
MIXED_TOKENS = 2_000_000


def _worker(cells: Sequence[str], docs: Sequence[str], mixed: Sequence[str],
            mode: str | None) -> dict[str, list]:
    """In the tree on ``sys.path``: per case (layout ms, solve ms, plan_id, layout wall ms,
    imbalance, KV tokens received, R met or not declared missed)."""
    from dataclasses import replace

    from bench.scale import mixed_lengths
    from planner_service.core.request import PlanRequest
    from planner_service.data import FAMILIES, make_source, pack_sequences
    from planner_service.solvers.flashcp import flashcp_layout
    from planner_service.solvers.registry import solve

    sources = ("wlbllm", "code", *(f"family:{name}" for name in sorted(FAMILIES)))
    extra = {"comm_mode": mode} if mode else {}

    def request(seq: Sequence[int], n: int) -> PlanRequest:
        return replace(PlanRequest(doc_lengths=tuple(seq), cp_size=n, context_length=None,
                                   imbalance_target=1.05), **extra)

    cases: dict[str, list[PlanRequest]] = {}
    for cell in cells:
        tokens, n = map(int, cell.split(":"))
        cases[f"{tokens // 1024}K N={n}"] = [
            request(seq, n) for source in sources
            for seq in pack_sequences(make_source(source), context_length=tokens,
                                      num_sequences=SEQUENCES.get(tokens, 2), seed=0)]
    for cell in docs:
        d, n = map(int, cell.split(":"))
        length, rest = divmod(DOC_TOKENS, d)
        cases[f"{d} docs N={n}"] = [request([length + (i < rest) for i in range(d)], n)]
    for cell in mixed:
        d, n = map(int, cell.split(":"))
        cases[f"{d} mixed N={n}"] = [request(mixed_lengths(source, d, MIXED_TOKENS), n)
                                     for source in sources]
    out = {}
    for name, requests in cases.items():
        rows = []
        for r in requests:
            start, wall = time.process_time(), time.perf_counter()
            flashcp_layout(r.doc_lengths, r)
            layout = (time.process_time() - start) * 1e3
            layout_wall = (time.perf_counter() - wall) * 1e3
            start = time.process_time()
            plan = solve(r, check=False)
            rows.append((layout, (time.process_time() - start) * 1e3, plan.plan_id, layout_wall,
                         plan.metrics.imbalance, plan.metrics.comm_tokens,
                         plan.info.get("imbalance_target_met") is not False))
        out[name] = rows
    return out


def _run(tree: str, args: argparse.Namespace) -> dict[str, list]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--cells", *args.cells,
               "--docs", *args.docs, "--mixed", *args.mixed]
    if args.mode:
        command += ["--mode", args.mode]
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": tree}, cwd=tree,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="the other source tree (a checkout's root)")
    parser.add_argument("--new", default=str(Path(__file__).resolve().parents[1]),
                        help="default: this tree")
    parser.add_argument("--cells", nargs="*", default=["131072:1024"], help="TOKENS:N")
    parser.add_argument("--docs", nargs="*", default=[], help="D:N (2M tokens in D docs)")
    parser.add_argument("--mixed", nargs="*", default=[],
                        help="D:N (D mixed lengths per data set and family, ~2M tokens)")
    parser.add_argument("--mode", default=None, help="comm_mode of every request")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None, help="markdown table (default: print only)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.cells, args.docs, args.mixed, args.mode)))
        return
    if not args.base:
        parser.error("--base is required")
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, list]]] = {"base": [], "new": []}
    for _ in range(args.rounds):
        for side in ("base", "new"):
            runs[side].append(_run(getattr(args, side), args))
    load_after = os.getloadavg()
    lines = [
        "| cases | sequences | layout ms median / max: base | new | solve ms median / max: base "
        "| new | layout wall ms median / max: base | new | plans identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    changed: list[tuple[str, list, list]] = []
    for name in runs["base"][0]:
        figures = {}
        for side, side_runs in runs.items():
            count = len(side_runs[0][name])
            layout = [min(run[name][i][0] for run in side_runs) for i in range(count)]
            solved = [min(run[name][i][1] for run in side_runs) for i in range(count)]
            wall = [min(run[name][i][3] for run in side_runs) for i in range(count)]
            figures[side] = (f"{statistics.median(layout):.1f} / {max(layout):.1f}",
                             f"{statistics.median(solved):.1f} / {max(solved):.1f}",
                             f"{statistics.median(wall):.1f} / {max(wall):.1f}")
        same = sum(a[2] == b[2] for a, b in zip(runs["base"][0][name], runs["new"][0][name],
                                                 strict=True))
        lines.append(f"| {name} | {count} | {figures['base'][0]} | {figures['new'][0]} | "
                     f"{figures['base'][1]} | {figures['new'][1]} | {figures['base'][2]} | "
                     f"{figures['new'][2]} | {same} / {count} |")
        changed += [(f"{name}, sequence {i}", a, b) for i, (a, b) in enumerate(
            zip(runs["base"][0][name], runs["new"][0][name], strict=True)) if a[2] != b[2]]
    lines += ["", "Plans that differ (base -> new): imbalance, KV tokens received (plan "
              "metrics), R met (or missed and declared). Sequence i of a case is its i-th "
              "source: wlbllm, code, then the families by name (packed cases: each source's "
              "sequences in turn).", ""]
    lines += ["| case | imbalance | KV tokens | R met |", "|---|---|---|---|"]
    lines += [f"| {name} | {a[4]:.6f} -> {b[4]:.6f} | {a[5]:,} -> {b[5]:,} | {a[6]} -> {b[6]} |"
              for name, a, b in changed] or ["| none | | | |"]
    header = [
        "# flashcp solve time: two source trees side by side",
        "",
        f"Command: `python -m bench.scale_compare {' '.join(argv if argv is not None else sys.argv[1:])}`"
        f" (base: {args.base}). Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; load average (1, 5, 15 min) before "
        f"{', '.join(f'{x:.2f}' for x in load_before)}, after "
        f"{', '.join(f'{x:.2f}' for x in load_after)}. CPU ms per call (`time.process_time`), "
        f"the minimum of {args.rounds} alternating rounds per case (wall: `time.perf_counter`)"
        + (f"; comm_mode {args.mode}" if args.mode else "") + ".",
        "",
    ]
    text = "\n".join(header + lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
