"""Every GPU check and timing of the worker runtime in one call (one GPU is enough).

    .venv/bin/python -m bench.gpu_check [--out bench/results/gpu_check.md]

1. ``pytest -m gpu`` on the runtime's kernel tests: flash-attn forward and backward in
   bf16 against the float64 reference (TransformerEngine's CP tolerance, 2.5e-2), on the
   gathered path (one call per rank), the segments path (flash-attn's private varlen
   forward/backward per call, merged by log-sum-exp) and the segment ring (a ring plan's
   steps on the same calls, zero-query segments included).
2. FlashCP's Figure 3 effect: per-rank forward+backward kernel time of per_doc vs flashcp
   plans, ranks run one after another on this GPU, for one 128K doc and for 16 docs of 8K
   (Llama-3-8B attention shape, bf16, N = 8).
3. Profiler timings (``cp-planner-timings/v1``) of flashcp and zigzag plans on packed
   WLB-LLM sequences, for the cost-model fit (bench/results/timings_gpu.json).
4. The two flash paths per rank without the exchange (kernel calls, merges and copies,
   forward + backward), flashcp and zigzag plans of one packed WLB-LLM 128K sequence, N = 8:
   gathered (per-shard key gather, one call) against segments (local and remote buffers,
   M (M + 1) calls at most, LSE merges). Both read their inputs by index from global
   tensors, so both pay a query gather the runtime does not (its local buffer is a view
   when every doc has one shard on the rank).
5. The step-time model check (bench/model_check.py ``--device cuda``): plans of every
   strategy at N in {2, 3, 4, 8}; worlds of up to the visible GPU count run on NCCL
   (kernel, copies and exchange per rank), larger N time each rank's flash-attn kernel on
   one GPU; fits the profile on half the batches and validates on the rest
   (bench/results/model_check_gpu.md, .json, .png, _profile.json).

Without CUDA it prints why and exits 0 without writing anything. ``--cpu-smoke`` runs
the same code paths on CPU at 1/64 scale (float32, torch kernel) into a temporary folder,
so the script itself is tested where no GPU is available.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from planner_service.core.model import ModelSpec
from planner_service.core.request import PlanRequest
from planner_service.data import make_source, pack_sequences
from planner_service.solvers.registry import solve
from worker_runtime.kernels import build_meta, flash_attn_available, varlen_attention
from worker_runtime.layout import build_comm_map, build_layout, expand_ranges
from worker_runtime.profiler import (
    attention_records,
    device_name,
    median_ms,
    time_shards,
    timings_document,
    write_timings,
)
from worker_runtime.segattention import LocalSegmentAttention, build_segment_state
from worker_runtime.segkernels import ReferenceSegments, flash_segments

RESULTS = Path(__file__).resolve().parent / "results"
FIGURE3_CASES = {"one 128K doc": [131072], "16 docs of 8K": [8192] * 16}


def run_gpu_tests() -> dict:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "tests/test_runtime_kernels.py",
         "tests/test_runtime_segments.py", "tests/test_runtime_segring.py"],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
    )
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"returncode": proc.returncode, "seconds": time.perf_counter() - start, "tail": tail}


def figure3(kernel: str, repeats: int, device: str, dtype: torch.dtype, scale: int,
            model: ModelSpec) -> list[dict]:
    rows = []
    for case, lengths in FIGURE3_CASES.items():
        lengths = [n // scale for n in lengths]
        for strategy in ("per_doc", "flashcp"):
            plan = solve(PlanRequest(doc_lengths=tuple(lengths), cp_size=8, strategy=strategy, model=model))
            ms = [time_shards(shards, model, dtype=dtype, device=device, kernel=kernel,
                              repeats=repeats) for shards in plan.groups[0].shards]
            rows.append({"case": case, "strategy": strategy, "per_rank_ms": ms, "max_ms": max(ms),
                         "mean_ms": statistics.mean(ms), "shards": plan.metrics.num_shards,
                         "imbalance": plan.metrics.imbalance})
    return rows


def flash_paths(kernel: str, repeats: int, device: str, dtype: torch.dtype, scale: int,
                model: ModelSpec) -> list[dict]:
    """Per-rank fwd+bwd ms of the gathered and segments flash paths (module docstring, 4)."""
    dev = torch.device(device)
    seg_kernel = flash_segments(dev, dtype, model.head_dim) if kernel == "flash" else ReferenceSegments()
    if seg_kernel is None:
        return []
    lengths = pack_sequences(make_source("wlbllm"), context_length=131072 // scale, num_sequences=1,
                             seed=0)[0]
    total, softmax_scale = sum(lengths), model.head_dim**-0.5
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(total, h, model.head_dim, generator=gen, device=dev, dtype=dtype).requires_grad_()
               for h in (model.num_heads, model.num_kv_heads, model.num_kv_heads))
    rows = []
    for strategy in ("flashcp", "zigzag"):
        plan = solve(PlanRequest(doc_lengths=tuple(lengths), cp_size=8, strategy=strategy, model=model))
        gathered_ms, segments_ms, calls = [], [], []
        for rank in range(8):
            lay = build_layout(plan, rank)
            comm = build_comm_map(lay, "alltoallv")
            state = build_segment_state(lay, comm, seg_kernel, dev)
            r = lay.num_real
            docs = [s.doc for s in lay.shards]
            keys = expand_ranges(lay.doc_offsets[docs], [s.end for s in lay.shards])

            def index(x):
                return torch.from_numpy(x).to(dev)

            q_rows, key_rows = index(lay.global_index[:r]), index(keys)
            loc = index(lay.global_index[:r][state.plan.local_rows])
            far = index((lay.doc_offsets[comm.remote_doc] + comm.remote_pos)[state.plan.remote_order])
            meta = build_meta(lay.cu_seqlens_q, lay.cu_seqlens_k, dev)
            grad = torch.randn(r, model.num_heads, model.head_dim, generator=gen, device=dev, dtype=dtype)

            def gathered(q_rows=q_rows, key_rows=key_rows, meta=meta, grad=grad):
                out = varlen_attention(q[q_rows], k[key_rows], v[key_rows], meta, softmax_scale, kernel)
                torch.autograd.grad(out, (q, k, v), grad)

            def segments(loc=loc, far=far, state=state, grad=grad):
                out = LocalSegmentAttention.apply(q[loc], k[loc], v[loc], k[far], v[far], state,
                                                  softmax_scale)
                torch.autograd.grad(out, (q, k, v), grad)

            gathered_ms.append(median_ms(gathered, dev, repeats=repeats))
            segments_ms.append(median_ms(segments, dev, repeats=repeats))
            calls.append(len(state.plan.calls))
        rows.append({"strategy": strategy, "gathered_ms": gathered_ms, "segments_ms": segments_ms,
                     "calls": calls})
    return rows


def profile(kernel: str, path: Path, device: str, dtype: torch.dtype, scale: int,
            model: ModelSpec) -> int:
    records = []
    for context in (16384, 32768, 65536, 131072):
        context //= scale
        seqs = pack_sequences(make_source("wlbllm"), context_length=context, num_sequences=2, seed=0)
        for degree in (2, 4, 8):
            for lengths in seqs:
                for strategy in ("flashcp", "zigzag"):
                    plan = solve(PlanRequest(doc_lengths=tuple(lengths), cp_size=degree, strategy=strategy, model=model))
                    records += attention_records(plan, dtype=dtype, device=device, kernel=kernel, repeats=3)
    write_timings(path, timings_document(records, device=device_name(device), dtype=dtype, model=model))
    return len(records)


def model_check_step(smoke_dir: Path | None) -> str:
    """Run bench/model_check.py (CUDA, or its CPU smoke mode into ``smoke_dir``); one line."""
    from bench import model_check

    argv = ["--cpu-smoke", str(smoke_dir / "model_check")] if smoke_dir else ["--device", "cuda"]
    start = time.perf_counter()
    args = model_check.parse_args(argv)
    r = model_check.run(args)
    return (f"`python -m bench.model_check {' '.join(argv)}` ({time.perf_counter() - start:.0f} s): "
            f"{r['num_plans']} plans, {r['held_out_plans']} held out with whole-layer times: median "
            f"abs rel error {r['median_abs_rel_error']:.1%}, p90 {r['p90_abs_rel_error']:.1%}, "
            f"Spearman {r['spearman']:.3f}, model's fastest right in {r['fastest_ok']} / "
            f"{r['num_batches']} batches; kernel term median error {r['terms']['kernel_ms']:.1%}. "
            f"Table: {args.out_dir / (args.stem + '.md')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_check.md")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-profile", action="store_true")
    parser.add_argument("--skip-model-check", action="store_true")
    parser.add_argument("--cpu-smoke", type=Path, metavar="DIR",
                        help="run every step on CPU at 1/64 scale, writing into DIR")
    args = parser.parse_args()
    model = ModelSpec()  # Llama-3-8B attention: 32 heads, 8 KV heads, head_dim 128
    if args.cpu_smoke:
        device, dtype, scale, kernel, repeats = "cpu", torch.float32, 64, "torch", 1
        model = ModelSpec(num_heads=4, num_kv_heads=2, head_dim=16)
        out, timings = args.cpu_smoke / "gpu_check.md", args.cpu_smoke / "timings_gpu.json"
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing run, nothing written")
        return 0
    else:
        device, dtype, scale, repeats = "cuda", torch.bfloat16, 1, args.repeats
        kernel = "flash" if flash_attn_available(torch.device("cuda")) else "torch"
        out, timings = args.out, RESULTS / "timings_gpu.json"
    tests = run_gpu_tests()
    fig3 = figure3(kernel, repeats, device, dtype, scale, model)
    paths = flash_paths(kernel, repeats, device, dtype, scale, model)
    num_records = 0 if args.skip_profile else profile(kernel, timings, device, dtype, scale, model)
    check = None if args.skip_model_check else model_check_step(args.cpu_smoke)
    lines = [
        "# Worker runtime GPU check",
        "",
        "Command: `.venv/bin/python -m bench.gpu_check`",
        "",
        f"Device: {device_name(device)}; torch {torch.__version__}; kernel: {kernel}; {dtype}; "
        f"sizes / {scale}.",
        "",
        f"## pytest -m gpu (return code {tests['returncode']}, {tests['seconds']:.0f} s)",
        "",
        "```", *tests["tail"], "```",
        "",
        f"## Figure 3 effect: per-rank fwd+bwd kernel ms (heads {model.num_heads}/{model.num_kv_heads}, "
        f"head_dim {model.head_dim}, N = 8)",
        "",
        "| case | strategy | shards | max rank ms | mean rank ms | per-rank ms |",
        "|---|---|---:|---:|---:|---|",
        *(f"| {r['case']} | {r['strategy']} | {r['shards']} | {r['max_ms']:.2f} | {r['mean_ms']:.2f} | "
          + ", ".join(f"{x:.2f}" for x in r["per_rank_ms"]) + " |" for r in fig3),
        "",
        "## Flash paths per rank: fwd+bwd ms without the exchange (one WLB-LLM 128K sequence, N = 8)",
        "",
        "| strategy | gathered max / mean ms | segments max / mean ms | calls per pass | per-rank gathered / segments ms |",
        "|---|---:|---:|---|---|",
        *(f"| {p['strategy']} | {max(p['gathered_ms']):.2f} / {statistics.mean(p['gathered_ms']):.2f} | "
          f"{max(p['segments_ms']):.2f} / {statistics.mean(p['segments_ms']):.2f} | "
          + ", ".join(str(c) for c in p["calls"]) + " | "
          + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(p["gathered_ms"], p["segments_ms"], strict=True))
          + " |" for p in paths),
        *([] if paths else ["skipped: flash-attn's private varlen API refused (see the warning)"]),
        "",
        f"Profiler: {num_records} attention records -> {timings}",
        "",
        "## Step-time model check",
        "",
        check or "skipped",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"tests": tests, "figure3": fig3, "flash_paths": paths},
                                                   indent=1))
    print("\n".join(lines))
    return 0 if tests["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
