"""flashcp at scale: solve time against N and documents, adversarial inputs, plan quality.

    python -m bench.scale            # the full run (under 10 minutes on 2 quiet cores)
    python -m bench.scale --quick    # a few seconds: every part, tiny sizes
    python -m bench.scale --only-n 1024 --only-tokens 131072 --parts nsweep \
        --out bench/results/scale_slice.md   # one slice (``bench.scale_compare``: two trees)

Writes ``--out`` (markdown), the same figures as JSON beside it, and a log-log plot (PNG).

- **N sweep**: packed sequences (seeded) of 32K, 128K, 512K and 2M tokens from the two
  shared data sets and every parametric family, N = 2 .. 1024; per token count and N the
  min, median and p99 over all sequences of (a) the strategy's layout (``flashcp_layout``)
  and (b) ``solve(check=False)`` (layout, metrics and plan hash, as the service runs it).
- **Docs sweep**: 2M tokens in D = 10 .. 100,000 docs, N = 8 and 1024: equal docs, and
  mixed lengths drawn from each shared data set and family (``mixed_lengths``: D lengths
  scaled to 2M tokens in all); per (D, N) the time of each input and the worst.
- **Growth exponents**: least-squares slope of log(median layout time) against log N
  (N >= 8) per token count, and against log D per N.
- **Adversarial inputs**: one doc filling the context at N = 1 .. 1024, one-token docs by
  the thousand, more ranks than tokens, and real corpora at 32K and N = 32; each solved
  and validated, the worst solve time reported.
- **Quality**: per cell (data set or family, 32K and 128K, N = 4 and 8, R = 1.05), mean
  imbalance and mean all-to-all-v saving of flashcp against the pre-change reference
  (``bench/results/scale_baseline.json``), and, under compact all-gather, flashcp's mean
  saving against Algorithm 1's (``flashcp_paper``) at the same R.

Timings are CPU time of this process (``time.process_time``), which on a quiet machine
equals the wall time of a solve; the output names the load average before and after, as a
busy machine still slows a process down (shared caches, frequency).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from planner_service.core.request import PlanRequest
from planner_service.data import FAMILIES, make_source, pack_sequences
from planner_service.solvers.flashcp import flashcp_layout
from planner_service.solvers.registry import solve

TARGET = 1.05
SHARED = ("wlbllm", "code")
QUALITY_SOURCES = ("wlbllm", "code", "pile", "redpajama", "books")
QUALITY_CONTEXTS = (32768, 131072)
QUALITY_CP = (4, 8)
BASELINE = Path("bench/results/scale_baseline.json")


class Config:
    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.sources = ("wlbllm", "pile") if quick else (
            *SHARED, *(f"family:{name}" for name in sorted(FAMILIES)))
        self.contexts: tuple[int, ...] = (32768, 131072) if quick else (32768, 131072, 524288, 2097152)
        self.cps: tuple[int, ...] = (2, 8, 64) if quick else (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
        # Sequences per source: fewer at the largest token counts.
        self.sequences = {c: 1 for c in self.contexts} if quick else {
            32768: 6, 131072: 6, 524288: 3, 2097152: 2}
        self.docs = (10, 100, 1000) if quick else (10, 100, 1000, 10_000, 100_000)
        self.doc_tokens = 1 << 16 if quick else 2097152
        self.doc_cps: tuple[int, ...] = (8, 64) if quick else (8, 1024)
        self.corpus_sequences = 3 if quick else 200
        self.quality_sequences = 3 if quick else 100


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


def stats(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values),
            "p99": percentile(values, 99), "max": max(values), "count": len(values)}


def timed(fn: Callable[[], object]) -> float:
    """CPU milliseconds of one call (``time.process_time``: on a busy machine, unlike the
    wall clock, it does not count the time other processes hold the cores)."""
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1e3


def request_for(seq: Sequence[int], n: int, **changes: object) -> PlanRequest:
    return replace(PlanRequest(doc_lengths=tuple(seq), cp_size=n, context_length=None,
                               imbalance_target=TARGET), **changes)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-6)) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly, strict=True)) / den if den else 0.0


def n_sweep(cfg: Config) -> list[dict]:
    rows = []
    for context in cfg.contexts:
        batches = {source: pack_sequences(make_source(source), context_length=context,
                                          num_sequences=cfg.sequences[context], seed=0)
                   for source in cfg.sources}
        for n in cfg.cps:
            layout_ms, solve_ms = [], []
            for sequences in batches.values():
                for seq in sequences:
                    request = request_for(seq, n)
                    layout_ms.append(timed(lambda: flashcp_layout(seq, request)))  # noqa: B023
                    solve_ms.append(timed(lambda: solve(request, check=False)))  # noqa: B023
            rows.append({"context": context, "n": n, "layout_ms": stats(layout_ms),
                         "solve_ms": stats(solve_ms)})
            print(f"tokens {context} N {n}: layout median {rows[-1]['layout_ms']['median']:.2f} ms, "
                  f"solve median {rows[-1]['solve_ms']['median']:.2f} ms, "
                  f"max {rows[-1]['solve_ms']['max']:.1f} ms", flush=True)
    return rows


def mixed_lengths(source: str, docs: int, tokens: int, seed: int = 0) -> list[int]:
    """``docs`` lengths drawn from ``source`` (seeded), scaled to about ``tokens`` in all
    (each x tokens / their sum, rounded, at least 1): a real length distribution at any
    document count."""
    import numpy as np

    raw = make_source(source).draw(np.random.default_rng(seed), docs).astype(np.float64)
    return np.maximum(1, np.round(raw * (tokens / raw.sum()))).astype(np.int64).tolist()


def doc_sweep(cfg: Config) -> list[dict]:
    rows = []
    for n in cfg.doc_cps:
        for d in cfg.docs:
            length, extra = divmod(cfg.doc_tokens, d)
            inputs = [("equal", [length + (i < extra) for i in range(d)])]
            inputs += [(source, mixed_lengths(source, d, cfg.doc_tokens)) for source in cfg.sources]
            for name, seq in inputs:
                request = request_for(seq, n)
                layout = [timed(lambda: flashcp_layout(seq, request)) for _ in range(2)]  # noqa: B023
                solved = [timed(lambda: solve(request, check=False)) for _ in range(2)]  # noqa: B023
                rows.append({"docs": d, "n": n, "tokens": sum(seq), "input": name,
                             "layout_ms": stats(layout), "solve_ms": stats(solved)})
            cell = rows[-len(inputs):]
            worst = max(cell, key=lambda r: r["solve_ms"]["min"])
            print(f"{d} docs N {n}: equal layout {min(cell[0]['layout_ms'].values()):.1f} ms; "
                  f"worst solve {worst['solve_ms']['min']:.1f} ms ({worst['input']})", flush=True)
    return rows


def adversarial_inputs(cfg: Config) -> list[tuple[str, list[list[int]], int]]:
    one_doc_ns = (1, 2, 16, 64) if cfg.quick else (
        1, 2, 8, 14, 16, 17, 18, 19, 20, 32, 64, 128, 256, 512, 1024)
    cases = [(f"one doc of 131072 tokens, N = {n}", [[131072]], n) for n in one_doc_ns]
    cases += [(f"one doc of 2097152 tokens, N = {n}", [[2097152]], n)
              for n in ((8,) if cfg.quick else (8, 1024))]
    cases += [
        ("300 one-token docs, N = 1024", [[1] * 300], 1024),
        ("100 docs of 7 tokens, N = 999", [[7] * 100], 999),
        ("3000 one-token docs, N = 8", [[1] * 3000], 8),
        ("3000 one-token docs, N = 1024", [[1] * 3000], 1024),
        ("10000 one-token docs, N = 1024", [[1] * 10000], 1024),
        ("6 tokens in 3 docs, N = 1024", [[3, 2, 1]], 1024),
        ("docs 4099,37,1023,8191,1,511, N = 4", [[4099, 37, 1023, 8191, 1, 511]], 4),
    ]
    for source in ("wlbllm", "code", "pile"):
        seqs = pack_sequences(make_source(source), context_length=32768,
                              num_sequences=cfg.corpus_sequences, seed=0)
        cases.append((f"{source}, {len(seqs)} x 32K, N = 32", seqs, 32))
    return cases


def adversarial(cfg: Config) -> list[dict]:
    rows = []
    for name, sequences, n in adversarial_inputs(cfg):
        times = []
        for seq in sequences:
            request = request_for(seq, n)
            times.append(timed(lambda: solve(request, check=False)))  # noqa: B023
            solve(request)  # the validator's self-check, untimed
        rows.append({"input": name, "n": n, "sequences": len(sequences), "solve_ms": stats(times)})
        print(f"{name}: max {rows[-1]['solve_ms']['max']:.1f} ms", flush=True)
    return rows


def quality(sequences_per_cell: int, seed: int) -> list[dict]:
    cells = []
    for source in QUALITY_SOURCES:
        for context in QUALITY_CONTEXTS:
            sequences = pack_sequences(make_source(source), context_length=context,
                                       num_sequences=sequences_per_cell, seed=seed)
            for n in QUALITY_CP:
                imb, sav, ag_sav, ag_imb, p_sav, p_imb, ms = [], [], [], [], [], [], []
                for seq in sequences:
                    request = PlanRequest(doc_lengths=tuple(seq), cp_size=n,
                                          context_length=context, imbalance_target=TARGET)
                    start = time.perf_counter()
                    plan = solve(request, check=False)
                    ms.append((time.perf_counter() - start) * 1e3)
                    imb.append(plan.metrics.imbalance)
                    sav.append(plan.metrics.comm_saving_alltoallv)
                    ag = solve(replace(request, comm_mode="compact_allgather"), check=False)
                    ag_sav.append(ag.metrics.comm_saving_allgather)
                    ag_imb.append(ag.metrics.imbalance)
                    paper = solve(replace(request, strategy="flashcp_paper",
                                          comm_mode="compact_allgather"), check=False)
                    p_sav.append(paper.metrics.comm_saving_allgather)
                    p_imb.append(paper.metrics.imbalance)
                cell = {
                    "source": source, "context": context, "n": n, "sequences": len(sequences),
                    "imbalance_mean": statistics.fmean(imb),
                    "saving_alltoallv_mean": statistics.fmean(sav),
                    "allgather_saving_mean": statistics.fmean(ag_sav),
                    "allgather_imbalance_mean": statistics.fmean(ag_imb),
                    "paper_allgather_saving_mean": statistics.fmean(p_sav),
                    "paper_imbalance_mean": statistics.fmean(p_imb),
                    "solve_ms_median": statistics.median(ms),
                }
                cells.append(cell)
    return cells


def exponents(n_rows: list[dict], doc_rows: list[dict]) -> dict[str, dict[str, float]]:
    in_n = {}
    for context in sorted({r["context"] for r in n_rows}):
        rows = [r for r in n_rows if r["context"] == context and r["n"] >= 8]
        if len(rows) >= 2:
            in_n[str(context)] = slope([r["n"] for r in rows], [r["layout_ms"]["median"] for r in rows])
    in_d = {}
    for n in sorted({r["n"] for r in doc_rows}):
        docs = sorted({r["docs"] for r in doc_rows if r["n"] == n})
        worst = [max(r["layout_ms"]["median"] for r in doc_rows if r["n"] == n and r["docs"] == d)
                 for d in docs]
        in_d[str(n)] = slope(docs, worst)
    return {"n": in_n, "docs": in_d}


def plot(n_rows: list[dict], doc_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for context in sorted({r["context"] for r in n_rows}):
        rows = [r for r in n_rows if r["context"] == context]
        ns = [r["n"] for r in rows]
        left.plot(ns, [r["solve_ms"]["median"] for r in rows], marker="o",
                  label=f"{context // 1024}K solve (median)")
        left.plot(ns, [r["layout_ms"]["median"] for r in rows], linestyle="--", alpha=0.6,
                  label=f"{context // 1024}K layout")
    left.set(xscale="log", yscale="log", xlabel="ranks N", ylabel="ms",
             title="flashcp solve time against N")
    left.xaxis.set_minor_formatter(NullFormatter())
    if n_rows:
        left.legend(fontsize=7)
    for n in sorted({r["n"] for r in doc_rows}):
        rows = [r for r in doc_rows if r["n"] == n and r.get("input", "equal") == "equal"]
        ds = [r["docs"] for r in rows]
        right.plot(ds, [r["solve_ms"]["median"] for r in rows], marker="o", label=f"N = {n} equal, solve")
        docs = sorted({r["docs"] for r in doc_rows if r["n"] == n})
        right.plot(docs, [max(r["solve_ms"]["median"] for r in doc_rows if r["n"] == n and r["docs"] == d)
                          for d in docs], linestyle="--", label=f"N = {n} worst input, solve")
    right.set(xscale="log", yscale="log", xlabel="documents D", ylabel="ms",
              title="against the number of documents")
    if doc_rows:
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def quality_lines(cells: list[dict], baseline_path: Path) -> list[str]:
    base = {}
    if baseline_path.exists():
        base = {(c["source"], c["context"], c["n"]): c
                for c in json.loads(baseline_path.read_text())["cells"]}
    lines = [
        "| cell | sequences | saving a2av before | after | change (points) | imbalance before | after "
        "| compact AG saving: flashcp | Algorithm 1 | imbalance flashcp / Alg. 1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        b = base.get((c["source"], c["context"], c["n"]))
        before = f"{b['saving_alltoallv_mean']:.2%}" if b and b["sequences"] == c["sequences"] else "-"
        change = (f"{100 * (c['saving_alltoallv_mean'] - b['saving_alltoallv_mean']):+.2f}"
                  if b and b["sequences"] == c["sequences"] else "-")
        imb_before = f"{b['imbalance_mean']:.4f}" if b and b["sequences"] == c["sequences"] else "-"
        lines.append(
            f"| {c['source']} {c['context'] // 1024}K N={c['n']} | {c['sequences']} | {before} | "
            f"{c['saving_alltoallv_mean']:.2%} | {change} | {imb_before} | {c['imbalance_mean']:.4f} | "
            f"{c['allgather_saving_mean']:.2%} | {c['paper_allgather_saving_mean']:.2%} | "
            f"{c['allgather_imbalance_mean']:.4f} / {c['paper_imbalance_mean']:.4f} |")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--quality-only", action="store_true",
                        help="only the quality cells, as JSON to --out")
    parser.add_argument("--sequences", type=int, default=None,
                        help="sequences per quality cell (default 100, quick 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only-n", type=int, nargs="+", default=None,
                        help="only these N in the N and docs sweeps")
    parser.add_argument("--only-tokens", type=int, nargs="+", default=None,
                        help="only these token counts in the N sweep")
    parser.add_argument("--parts", default="nsweep,docs,adversarial,quality",
                        help="comma-separated subset of nsweep, docs, adversarial, quality")
    parser.add_argument("--out", default=None,
                        help="default bench/results/scale.md (quick: scale_quick.md)")
    args = parser.parse_args(argv)
    cfg = Config(args.quick)
    if args.only_n:
        cfg.cps = tuple(n for n in cfg.cps if n in args.only_n) or tuple(args.only_n)
        cfg.doc_cps = tuple(n for n in cfg.doc_cps if n in args.only_n) or tuple(args.only_n)
    if args.only_tokens:
        cfg.contexts = tuple(args.only_tokens)
        cfg.sequences = {c: cfg.sequences.get(c, 2) for c in cfg.contexts}
    parts = set(args.parts.split(","))
    per_cell = args.sequences or cfg.quality_sequences
    started = time.time()
    cpu_started = time.process_time()
    load_before = os.getloadavg()
    command = "python -m bench.scale" + " ".join(["", *(argv if argv is not None else sys.argv[1:])])
    if args.quality_only:
        out = Path(args.out or "bench/results/scale_quality.json")
        cells = quality(per_cell, args.seed)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"command": command, "load_average": load_before,
                                   "imbalance_target": TARGET, "cells": cells}, indent=1) + "\n")
        print(f"written to {out}")
        return
    out = Path(args.out or ("bench/results/scale_quick.md" if args.quick else "bench/results/scale.md"))
    n_rows = n_sweep(cfg) if "nsweep" in parts else []
    doc_rows = doc_sweep(cfg) if "docs" in parts else []
    adv_rows = adversarial(cfg) if "adversarial" in parts else []
    cells = quality(per_cell, args.seed) if "quality" in parts else []
    slopes = exponents(n_rows, doc_rows)
    load_after = os.getloadavg()
    wall = time.time() - started
    cpu = time.process_time() - cpu_started
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plot(n_rows, doc_rows, png)
    out.with_suffix(".json").write_text(json.dumps({
        "command": command, "load_average_before": load_before, "load_average_after": load_after,
        "wall_s": wall, "cpu_s": cpu, "n_sweep": n_rows, "doc_sweep": doc_rows, "adversarial": adv_rows,
        "quality": cells, "exponents": slopes}, indent=1) + "\n")
    lines = [
        "# flashcp at scale: solve time and plan quality",
        "",
        f"Command: `{command}` ({wall:.0f} s). Machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; load average (1, 5, 15 min) before "
        f"{', '.join(f'{x:.2f}' for x in load_before)}, after {', '.join(f'{x:.2f}' for x in load_after)}.",
        "Times are CPU milliseconds of one call (`time.process_time`). Layout: `flashcp_layout` "
        f"alone; solve: `solve(check=False)` (layout, metrics and plan hash). R = {TARGET}. "
        f"CPU time of the whole run: {cpu:.0f} s. Plot: [{png.name}]({png.name}); figures: "
        f"[{out.with_suffix('.json').name}]({out.with_suffix('.json').name}).",
        "",
        f"## Against N (sources: {', '.join(cfg.sources)}; packed, seed 0)",
        "",
        "| tokens | N | sequences | layout ms min / median / p99 | solve ms min / median / p99 | solve ms max |",
        "|---|---|---|---|---|---|",
    ]
    for r in n_rows:
        lay, sol = r["layout_ms"], r["solve_ms"]
        lines.append(f"| {r['context'] // 1024}K | {r['n']} | {sol['count']} | {lay['min']:.2f} / "
                     f"{lay['median']:.2f} / {lay['p99']:.2f} | {sol['min']:.2f} / {sol['median']:.2f} "
                     f"/ {sol['p99']:.2f} | {sol['max']:.1f} |")
    lines += ["", "Growth exponent in N (slope of log median layout time, N >= 8): " + ", ".join(
        f"{int(k) // 1024}K: {v:.2f}" for k, v in slopes["n"].items()) + ".", "",
        f"## Against the number of documents ({cfg.doc_tokens} tokens in D docs: equal, or "
        "mixed lengths of each source scaled to that total)", "",
        "| D | N | input | layout ms min / median | solve ms min / median |",
        "|---|---|---|---|---|"]
    for r in doc_rows:
        lines.append(f"| {r['docs']} | {r['n']} | {r.get('input', 'equal')} | "
                     f"{r['layout_ms']['min']:.1f} / {r['layout_ms']['median']:.1f} | "
                     f"{r['solve_ms']['min']:.1f} / {r['solve_ms']['median']:.1f} |")
    lines += ["", "Growth exponent in D (slope of log median layout time of the worst input): " + ", ".join(
        f"N = {k}: {v:.2f}" for k, v in slopes["docs"].items()) + ".", "",
        "## Adversarial inputs (each plan also validated)", "",
        "| input | sequences | solve ms median | solve ms max |", "|---|---|---|---|"]
    for r in adv_rows:
        lines.append(f"| {r['input']} | {r['sequences']} | {r['solve_ms']['median']:.1f} | "
                     f"{r['solve_ms']['max']:.1f} |")
    lines += ["", f"## Quality (R = {TARGET}; {per_cell} packed sequences per cell, seed "
              f"{args.seed}; before: `{BASELINE}`)", "",
              *quality_lines(cells, BASELINE), ""]
    out.write_text("\n".join(lines) + "\n")
    print(f"written to {out}, {png} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
