"""Worker-runtime CPU benchmark: index-map preparation time and KV bytes per layer.

    .venv/bin/python -m bench.runtime_bench            # writes bench/results/runtime.md
    .venv/bin/python -m bench.runtime_bench --profile  # also CPU timings for the cost fit

1. Preparation: plan -> (layout, comm map) on one rank, for 128K-token packed sequences
   of the WLB-LLM and code length sets at N = 8; every rank timed (median of repeats).
2. Bytes: critical-path KV bytes per layer per pass (the rank that receives most) of the
   full, compact all-gather and all-to-all-v exchanges, from the runtime's own comm maps
   (Llama-3-8B: 8 KV heads x 128 x bf16 = 4 KiB per token), checked against the plan's
   figures.
3. ``--profile``: attention and comm timings on CPU in the ``cp-planner-timings/v1``
   format (bench/results/timings_cpu.json), the file the cost-model fit reads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from planner_service.core.model import ModelSpec
from planner_service.core.plan import Plan
from planner_service.core.request import PlanRequest
from planner_service.data import CONTEXT_128K, make_source, pack_sequences
from planner_service.solvers.registry import solve
from worker_runtime import COMM_MODES, ContextParallelAttention, build_comm_map, build_layout
from worker_runtime.profiler import attention_records, comm_record, timings_document, write_timings
from worker_runtime.testing import run_distributed

RESULTS = Path(__file__).resolve().parent / "results"
DATASETS = ("wlbllm", "code")
PREP_STRATEGIES = ("llama3", "per_doc", "flashcp")
LLAMA3_8B = ModelSpec()
MIB = 1 << 20


def sequences(dataset: str, num: int, context: int = CONTEXT_128K) -> list[list[int]]:
    return pack_sequences(make_source(dataset), context_length=context, num_sequences=num, seed=0)


def prep_ms(plan: Plan, rank: int, mode: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        build_comm_map(build_layout(plan, rank), mode)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def prep_table(num_seq: int, cp: int, repeats: int) -> list[str]:
    lines = ["| dataset | strategy | mode | median ms | p95 ms | max ms |", "|---|---|---|---:|---:|---:|"]
    for ds in DATASETS:
        plans = {s: [solve(PlanRequest(doc_lengths=tuple(seq), cp_size=cp, strategy=s, context_length=CONTEXT_128K))
                     for seq in sequences(ds, num_seq)] for s in PREP_STRATEGIES}
        for strategy, ps in plans.items():
            for mode in COMM_MODES:
                t = [prep_ms(p, r, mode, repeats) for p in ps for r in range(cp)]
                lines.append(f"| {ds} | {strategy} | {mode} | {statistics.median(t):.2f} | "
                             f"{np.percentile(t, 95):.2f} | {max(t):.2f} |")
    return lines


def critical_bytes(plan: Plan, mode: str) -> int:
    """Max over ranks of the runtime's receive rows, in bytes; asserts the plan agrees."""
    rows = [build_comm_map(build_layout(plan, r), mode).recv_rows for r in range(plan.cp_size)]
    want = {"full": plan.metrics.full_comm_tokens, "compact_allgather": plan.metrics.compact_allgather_tokens,
            "alltoallv": plan.metrics.alltoallv_tokens}[mode]
    assert max(rows) == want, (plan.strategy, mode, max(rows), want)
    return max(rows) * plan.model.kv_bytes_per_token


def bytes_table(num_seq: int, cp: int) -> list[str]:
    lines = ["| dataset | strategy | full MiB | compact_allgather MiB | alltoallv MiB | "
             "compact saving | a2av saving |", "|---|---|---:|---:|---:|---:|---:|"]
    for ds in DATASETS:
        seqs = sequences(ds, num_seq)
        for strategy in ("llama3", "per_doc", "flashcp"):
            plans = [solve(PlanRequest(doc_lengths=tuple(s), cp_size=cp, strategy=strategy,
                                       context_length=CONTEXT_128K, model=LLAMA3_8B)) for s in seqs]
            mean = {m: statistics.mean(critical_bytes(p, m) for p in plans) / MIB for m in COMM_MODES}
            lines.append(
                f"| {ds} | {strategy} | {mean['full']:.1f} | {mean['compact_allgather']:.1f} | "
                f"{mean['alltoallv']:.1f} | {1 - mean['compact_allgather'] / mean['full']:.1%} | "
                f"{1 - mean['alltoallv'] / mean['full']:.1%} |"
            )
    return lines


PROFILE_MODEL = ModelSpec(num_heads=4, num_kv_heads=2, head_dim=64, dtype_bytes=4)


def profile_comm_worker(rank: int, world_size: int, plan_jsons: list[str]) -> list[dict]:
    out = []
    for text in plan_jsons:
        plan = Plan.from_json(text)
        for mode in COMM_MODES:
            rec = comm_record(ContextParallelAttention(plan, comm_mode=mode), PROFILE_MODEL, repeats=3)
            if rec is not None:
                out.append(rec.to_dict())
    return out


def profile(path: Path) -> str:
    """CPU timings: a few packed sequences, flashcp and zigzag plans, degrees 2 and 4."""
    torch.set_num_threads(1)
    records: list = []
    comm: list[dict] = []
    for degree, context in ((2, 4096), (4, 8192)):
        seqs = sequences("wlbllm", 1, context) + [[context]]
        plans = [solve(PlanRequest(doc_lengths=tuple(s), cp_size=degree, strategy=st, model=PROFILE_MODEL))
                 for s in seqs for st in ("flashcp", "zigzag")]
        for p in plans:
            records += attention_records(p, repeats=2)
        for res in run_distributed(profile_comm_worker, degree, [p.to_json() for p in plans], timeout_s=300):
            comm += res
    doc = timings_document(records, device="cpu (torch kernel, gloo loopback)", dtype=torch.float32,
                           model=PROFILE_MODEL)
    doc["records"] += comm
    write_timings(path, doc)
    return f"{len(records)} attention and {len(comm)} comm records -> {path.relative_to(RESULTS.parent.parent)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=8, help="packed 128K sequences per dataset")
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="also write CPU timings (gloo)")
    parser.add_argument("--out", type=Path, default=RESULTS / "runtime.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [
        "# Worker runtime benchmark (CPU)",
        "",
        f"Command: `.venv/bin/python -m bench.runtime_bench --sequences {args.sequences} --cp {args.cp}"
        + (" --profile`" if args.profile else "`"),
        "",
        f"{args.sequences} packed sequences of {CONTEXT_128K} tokens per dataset (seed 0), N = {args.cp}; "
        f"1 torch/numpy thread; load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.",
        "",
        "## Plan -> index maps (one rank: layout + comm map), ms",
        "",
        "Every rank of every sequence, median of "
        f"{args.repeats} runs each; numpy on a shared 2-core machine, so p95/max include noise.",
        "",
        *prep_table(args.sequences, args.cp, args.repeats),
        "",
        "## KV bytes per layer per pass, critical-path rank (Llama-3-8B, bf16)",
        "",
        "Mean over sequences of the receive volume of the rank that receives most, computed from",
        "the runtime's comm maps (asserted equal to the plan's figures). Backward moves the same.",
        "",
        *bytes_table(args.sequences, args.cp),
    ]
    if args.profile:
        lines += ["", "## CPU timings for the cost-model fit", "", profile(RESULTS / "timings_cpu.json")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
