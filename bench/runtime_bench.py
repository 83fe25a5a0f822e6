"""Worker-runtime CPU benchmark: index-map preparation time, KV bytes per layer, KV memory
per rank, and overlapped / ring execution over gloo.

    .venv/bin/python -m bench.runtime_bench            # writes bench/results/runtime.md
    .venv/bin/python -m bench.runtime_bench --profile  # also CPU timings for the cost fit
    .venv/bin/python -m bench.runtime_bench --execution  # bench/results/runtime_bench_execution.md
    .venv/bin/python -m bench.runtime_bench --execution --device cuda  # NCCL, one GPU per rank

1. Preparation: plan -> (layout, comm map) on one rank, for 128K-token packed sequences
   of the WLB-LLM and code length sets at N = 8; every rank timed (median of repeats).
2. Bytes: critical-path KV bytes per layer per pass (the rank that receives most) of the
   full, compact all-gather and all-to-all-v exchanges, from the runtime's own comm maps
   (Llama-3-8B: 8 KV heads x 128 x bf16 = 4 KiB per token), checked against the plan's
   figures.
3. ``--profile``: attention and comm timings on CPU in the ``cp-planner-timings/v1``
   format (bench/results/timings_cpu.json), the file the cost-model fit reads.
4. ``--execution``: (a) KV memory per rank from the plans' ``kv_tokens_peak`` against the
   keys a per-shard gather would hold (sum of shard ends), 128K, N = 8; (b)
   the same plans run with overlap off and on, ring plans also as an all-gather: one
   layer's forward + backward time, the time the kernel waited for an exchange (exposed),
   peak KV bytes per rank, and the share of queries whose keys are all local (what
   overlap can hide). CPU: gloo, the torch kernel in float32 with small heads
   (``EXEC_MODEL``); ``--device cuda``: NCCL, one GPU per rank, the runtime's default
   kernel (flash-attn's segments path and segment ring where flash-attn is installed) in
   bf16 with Llama-3-8B heads (``CUDA_EXEC_MODEL``); N without enough GPUs is skipped.
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
from worker_runtime import GATHER_MODES, ContextParallelAttention, build_comm_map, build_layout
from worker_runtime.paths.lean import local_share
from worker_runtime.profiler import attention_records, comm_record, timings_document, write_timings
from worker_runtime.testing import run_distributed

RESULTS = Path(__file__).resolve().parent / "results"
CONTEXT_32K = 32768
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
            for mode in GATHER_MODES:
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
            mean = {m: statistics.mean(critical_bytes(p, m) for p in plans) / MIB for m in GATHER_MODES}
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
        for mode in GATHER_MODES:
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


def memory_table(num_seq: int, cp: int) -> list[str]:
    """Max over ranks of KV tokens held per layer / tokens per rank: the keys a per-shard
    gather would hold (sum of shard ends) against the plan's ``kv_tokens_peak``."""
    lines = ["| dataset | strategy | mode | per-shard gather (mean / max) | kv_tokens_peak (mean / max) | "
             "local query share (mean / min over ranks) |", "|---|---|---|---:|---:|---:|"]
    for ds in DATASETS:
        seqs = sequences(ds, num_seq)
        for strategy in ("llama3", "per_doc", "flashcp"):
            gather, peak, shares = [], [], []
            for seq in seqs:
                plan = solve(PlanRequest(doc_lengths=tuple(seq), cp_size=cp, strategy=strategy,
                                         context_length=CONTEXT_128K, model=LLAMA3_8B))
                t = plan.metrics.tokens_per_rank
                gather.append(max(sum(e for _, _, e in plan.rank_shards(r)) for r in range(cp)) / t)
                peak.append(max(max(g.rank_stats.kv_tokens_peak) for g in plan.groups) / t)
                for r in range(cp):
                    lay = build_layout(plan, r)
                    local, real = local_share(lay, build_comm_map(lay, "alltoallv"))
                    shares.append(local / real if real else 1.0)
            lines.append(f"| {ds} | {strategy} | {plan.comm_mode} | {statistics.mean(gather):.2f} / "
                         f"{max(gather):.2f} | {statistics.mean(peak):.2f} / {max(peak):.2f} | "
                         f"{statistics.mean(shares):.1%} / {min(shares):.1%} |")
    return lines


EXEC_MODEL = ModelSpec(num_heads=4, num_kv_heads=2, head_dim=32, dtype_bytes=4)
"""Small heads so a 32K layer runs in seconds on one CPU thread (float32)."""
CUDA_EXEC_MODEL = ModelSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
"""Llama-3-8B's attention heads in bf16 (CUDA)."""


def exec_setup(device: str) -> tuple[ModelSpec, str, torch.dtype]:
    """(model, kernel, dtype) the execution benchmark runs on ``device``."""
    if device == "cpu":
        return EXEC_MODEL, "torch", torch.float32
    return CUDA_EXEC_MODEL, "auto", torch.bfloat16


def exec_worker(rank: int, world_size: int, cases: list[tuple[str, str, bool]], repeats: int,
                device: str) -> list[dict]:
    """Per case (plan JSON, mode, overlap): per repeat this rank's forward + backward
    seconds, exposed exchange seconds, bytes moved and peak KV tokens."""
    import torch.distributed as dist

    dev = torch.device(device if device == "cpu" else f"cuda:{rank}")
    m, kernel, dtype = exec_setup(device)
    out = []
    for ci, (text, mode, overlap) in enumerate(cases):
        plan = Plan.from_json(text)
        attn = ContextParallelAttention(plan, comm_mode=mode, overlap=overlap, kernel=kernel)
        gen = torch.Generator().manual_seed(1000 * ci + rank)
        t = attn.num_tokens
        q, dout = (torch.randn(t, m.num_heads, m.head_dim, generator=gen).to(dev, dtype) for _ in range(2))
        k, v = (torch.randn(t, m.num_kv_heads, m.head_dim, generator=gen).to(dev, dtype) for _ in range(2))
        runs = []
        for i in range(repeats + 1):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            dist.barrier()
            attn.counter.reset()
            start = time.perf_counter()
            attn(leaves[0], leaves[1], leaves[2]).backward(dout)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            seconds = time.perf_counter() - start
            c = attn.counter
            c.settle()
            if i:  # the first call builds the index maps and warms up
                runs.append({"s": seconds, "exposed_s": c.exposed_forward_s + c.exposed_backward_s,
                             "bytes": c.forward_bytes + c.backward_bytes, "peak": c.kv_tokens_peak})
        out.append({"runs": runs, "share": attn.local_query_share()})
    return out


def execution_table(cps: tuple[int, ...], num_seq: int, context: int, repeats: int, device: str) -> list[str]:
    lines = ["| N | seq | plan | run as | overlap | fwd+bwd ms | exposed exchange ms | "
             "KV MiB moved | peak KV MiB per rank | local query share |",
             "|---:|---:|---|---|---|---:|---:|---:|---:|---:|"]
    model = exec_setup(device)[0]
    row_bytes = model.kv_bytes_per_token
    for cp in cps:
        if device == "cuda" and torch.cuda.device_count() < cp:
            lines.append(f"| {cp} | | skipped: {torch.cuda.device_count()} CUDA device(s), needs {cp} |"
                         " | | | | | | |")
            continue
        cases, labels = [], []
        for si, seq in enumerate(sequences("wlbllm", num_seq, context)):
            for strategy, modes in (("flashcp", (None,)), ("zigzag", ("full", "p2p_ring"))):
                plan = solve(PlanRequest(doc_lengths=tuple(seq), cp_size=cp, strategy=strategy,
                                         model=model))
                for mode in modes:
                    for overlap in (False, True):
                        cases.append((plan.to_json(), mode or plan.comm_mode, overlap))
                        labels.append((si, strategy, mode or plan.comm_mode, overlap))
        res = run_distributed(exec_worker, cp, cases, repeats, device, timeout_s=3600,
                              pg_timeout_s=600, backend="gloo" if device == "cpu" else "nccl")
        for ci, (si, strategy, mode, overlap) in enumerate(labels):
            per_rep = list(zip(*(r[ci]["runs"] for r in res), strict=True))
            step = statistics.median(max(x["s"] for x in rep) for rep in per_rep) * 1e3
            exposed = statistics.median(max(x["exposed_s"] for x in rep) for rep in per_rep) * 1e3
            moved = max(x["bytes"] for x in per_rep[0]) / MIB
            peak = max(x["peak"] for x in per_rep[0]) * row_bytes / MIB
            local, total = (sum(r[ci]["share"][j] for r in res) for j in (0, 1))
            lines.append(f"| {cp} | {si} | {strategy} | {mode} | {'on' if overlap else 'off'} | "
                         f"{step:.0f} | {exposed:.1f} | {moved:.2f} | {peak:.2f} | {local / total:.1%} |")
    return lines


def execution_main(args: argparse.Namespace) -> None:
    out = RESULTS / ("runtime_bench_execution.md" if args.device == "cpu" else "runtime_bench_execution_cuda.md")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: --device cuda needs CUDA (torch.cuda.is_available() is False); nothing written")
        return
    load = os.getloadavg()
    exec_model, exec_kernel, exec_dtype = exec_setup(args.device)
    command = (f".venv/bin/python -m bench.runtime_bench --execution --device {args.device} "
               f"--exec-sequences {args.exec_sequences} --exec-repeats {args.exec_repeats} --memory-sequences "
               f"{args.memory_sequences}")
    lines = [
        f"# Worker runtime execution benchmark ({args.device})",
        "",
        f"Command: `{command}`",
        "",
        f"Load average at start {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) on "
        f"{os.cpu_count()} cores; 1 torch thread per rank. Timings on a shared, loaded machine are "
        "indicative only; the byte and memory columns are exact.",
        "",
        f"## KV held per layer per rank / tokens per rank, 128K, N = 8 ({args.memory_sequences} sequences)",
        "",
        "Per-shard gather: the keys a runtime that gathers per shard holds (every shard's prefix [0, end) of its",
        "doc, kept for backward). kv_tokens_peak: the plan's figure, which the lean runtime's",
        "counter equals (tests/test_path_lean.py): per doc, one copy of the prefix up to the",
        "rank's last shard end. Mean and max over sequences of the max over ranks. Local query",
        "share: queries whose keys are all on their own rank (they finish before any remote KV",
        "arrives: what overlap can hide), per rank, mean and min over ranks and sequences.",
        "",
        *memory_table(args.memory_sequences, 8),
        "",
        f"## One layer forward + backward, WLB-LLM {CONTEXT_32K} tokens, {args.exec_sequences} sequences",
        "",
        f"Model: {exec_model.num_heads} heads, {exec_model.num_kv_heads} KV heads x "
        f"{exec_model.head_dim}, {exec_dtype}, kernel {exec_kernel!r} (cuda 'auto': flash-attn's "
        "segments path and segment ring where installed). fwd+bwd: median over "
        f"{args.exec_repeats} repeats of the slowest rank; exposed exchange: time blocked waiting for the",
        "exchange (forward + backward), slowest rank; KV moved: forward + backward bytes of the rank",
        "that moves most (a ring's backward re-circulates K/V and carries dK/dV: twice the forward);",
        "peak KV: the counter's kv_tokens_peak x K/V bytes per token; local query share: queries",
        "whose keys are all on their own rank, over all ranks. A wait also covers slower peers",
        "(skew); N ranks on fewer shared cores inflate it, most for the ring (one wait per step).",
        "",
        *execution_table((2, 4), args.exec_sequences, CONTEXT_32K, args.exec_repeats, args.device),
        "",
        f"Load average at end {os.getloadavg()[0]:.1f}.",
    ]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=8, help="packed 128K sequences per dataset")
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="also write CPU timings (gloo)")
    parser.add_argument("--out", type=Path, default=RESULTS / "runtime.md")
    parser.add_argument("--execution", action="store_true",
                        help="KV memory and overlapped / ring execution (runtime_bench_execution.md)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--exec-sequences", type=int, default=1, help="32K WLB-LLM sequences per N")
    parser.add_argument("--exec-repeats", type=int, default=2, help="timed layers per case (after one warm-up)")
    parser.add_argument("--memory-sequences", type=int, default=10, help="128K sequences per dataset")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.execution:
        execution_main(args)
        return
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
