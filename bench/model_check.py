"""The step-time model against the worker runtime: measure plans, fit on half, predict the rest.

    .venv/bin/python -m bench.model_check                 # full CPU calibration (bench/results/)
    .venv/bin/python -m bench.model_check --cpu-smoke DIR # tiny end-to-end run (CI), into DIR
    .venv/bin/python -m bench.model_check --device cuda   # NCCL + flash-attn (bench/gpu_check.py)
    .venv/bin/python -m bench.model_check --cpu-smoke DIR --reference-segments  # flash's path on CPU

1. Batches: packed sequences of the shared data sets (``wlbllm``, ``code``), parametric
   families (``family:pile``, ``family:redpajama``) and adversarial inputs (one doc filling
   the context; docs of 8 tokens), for N in {2, 3, 4, 8}, ``--tokens-per-rank`` tokens per
   rank (context = N x that). A batch is one sequence at one N; every strategy in
   STRATEGIES plans it, each with its own exchange, run on the path the runtime takes for
   it (``ContextParallelAttention.execution_path``): on CPU the PyTorch kernel's lean path
   for the gather modes and a ring for ``p2p_ring``; on CUDA flash-attn's segments path
   (the runtime's default; a ring plan as the segment ring), or its gathered path where
   flash-attn's private varlen API fails the runtime's probe. Each rank records the path
   it ran, and the model prices the plan on that path (core/step_time/
   ``execution_path``; a mismatch is an error). ``--reference-segments`` runs the segments
   path with the exact PyTorch segment kernel on any device (a check of this harness on
   CPU; plans and the base profile are then ``h100-fa2``'s).
2. Measure: one process group per N (gloo on loopback, 1 thread per rank; NCCL with one
   GPU per rank on CUDA). Per plan and rank, the median over ``--repeats`` of the
   runtime's forward+backward attention layer (``ContextParallelAttention`` call plus
   backward), of its kernel calls alone (every call the path lists for the rank,
   ``worker_runtime.paths.PATHS[path].planned_calls``, forward and backward on random
   buffers of the rank's sizes) and of its transfers alone (every transfer it lists,
   ``planned_transfers``: the split K/V and dK/dV collectives of the lean and segments
   paths, the gathered path's blocking stacked exchange, both rings' 3 (N - 1) shifts), each
   waited for; copies = layer - kernel - exchange. The repeats interleave the three
   (layer, kernel, exchange, layer, ...). On CPU the times are each rank's process CPU
   time (the ranks of a world meet at a barrier before each measured call): the machine
   has fewer cores than ranks, and CPU time counts a
   rank's own work as if it had a core to itself, like a rank on its own GPU; a rank
   waiting in gloo uses no CPU (gloo blocks, it does not spin). CPU time cannot show
   overlap (gloo's threads are the rank's own process either way), so on CPU the runtime
   and the model run with overlap off (``--overlap`` turns it on for both). Wall times are
   recorded beside them. On CUDA the times are wall times after a device synchronize.
3. Fit the model's coefficients (core/profile_fit.py) on the rank records of half the
   batches, predict every plan of the other half: the batches of each data set, in order
   of N and sequence, alternate between the halves, so both hold every data set (the one-
   sequence adversarial sets included). A plan's measured step is the
   largest per-rank layer time, its prediction the largest per-rank kernel + copies +
   exchange of core/step_time/ under the fitted profile.
4. Report: median and p90 absolute relative error, Spearman correlation of predicted vs
   measured over held-out plans, and per held-out batch whether the strategy the model
   ranks fastest is measured fastest or within 3% of it, with the model's margin (how much
   slower it predicts the runner-up), beside the measurement's noise floor (how far apart
   the ranks of one plan measure per attention pair). Writes ``model_check.md``,
   ``model_check.json`` (every record with its prediction), ``model_check.png`` (scatter)
   and ``model_check_profile.json`` (the fitted profile).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from planner_service.core.model import ModelSpec
from planner_service.core.paths import execution_path
from planner_service.core.plan import Plan
from planner_service.core.profile_fit import RECORDS_FORMAT, fit_step_profile, profile_document
from planner_service.core.profiles import (
    KernelProfile,
    LinkProfile,
    get_kernel_profile,
    get_link_profile,
)
from planner_service.core.request import PlanRequest
from planner_service.core.step_time import plan_rank_terms
from planner_service.data import make_source, pack_sequences
from planner_service.solvers.registry import solve
from worker_runtime import CommCounter, ContextParallelAttention, varlen_attention
from worker_runtime.aten_flash import choose_kernel
from worker_runtime.kernels import attention_backward, attention_forward
from worker_runtime.paths import PATHS, PlannedCall, RuntimePath, standalone_context
from worker_runtime.paths.gathered import VARLEN_KERNEL
from worker_runtime.paths.ring_steps import ring_link, shift
from worker_runtime.paths.segment_kernels import ReferenceSegments, SegmentKernel
from worker_runtime.testing import free_port, run_distributed

RESULTS = Path(__file__).resolve().parent / "results"
STRATEGIES = ("flashcp", "per_doc", "llama3", "ring", "zigzag", "fcp", "ilp")
OPTIONS: dict[str, dict[str, Any]] = {"ilp": {"time_limit_s": 1.0, "workers": 1}}
DATASETS = ("wlbllm", "code", "family:pile", "family:redpajama")
ADVERSARIAL = ("one doc", "8-token docs")
CP_SIZES = (2, 3, 4, 8)
CPU_MODEL = ModelSpec(num_heads=4, num_kv_heads=2, head_dim=32, dtype_bytes=4,
                      hidden_size=128, ffn_hidden_size=256)
GPU_MODEL = ModelSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
WITHIN = 0.03
"""A batch's model-fastest strategy counts as right when measured within 3% of the fastest."""


def batch_lengths(dataset: str, context: int, count: int) -> list[list[int]]:
    if dataset == "one doc":
        return [[context]]
    if dataset == "8-token docs":
        return [[8] * (context // 8)]
    return pack_sequences(make_source(dataset), context_length=context, num_sequences=count, seed=0)


def make_batches(datasets: Sequence[str], cp_sizes: Sequence[int], sequences: int,
                 tokens_per_rank: int, model: ModelSpec, strategies: Sequence[str],
                 kernel: str, link: str) -> list[dict[str, Any]]:
    """Every (data set, N, sequence) with each strategy's plan; a strategy that refuses an
    input is listed under ``skipped`` with its one-line reason."""
    batches = []
    seen: dict[str, int] = {}  # batches of each data set so far
    for n in cp_sizes:
        context = n * tokens_per_rank
        for ds in datasets:
            for i, lengths in enumerate(batch_lengths(ds, context, sequences)):
                plans, skipped = {}, {}
                for s in strategies:
                    try:
                        plans[s] = solve(PlanRequest(
                            doc_lengths=tuple(lengths), cp_size=n, strategy=s, context_length=context,
                            model=model, kernel=kernel, link=link, options=OPTIONS.get(s, {})))
                    except ValueError as exc:
                        skipped[s] = str(exc).splitlines()[0]
                seen[ds] = seen.get(ds, 0) + 1
                # Alternate within each data set (by N, then sequence; the phase shifts from
                # one data set to the next): a data set with two or more batches is in both
                # halves, so no held-out plan is of a kind the fit never saw.
                held_out = (seen[ds] + datasets.index(ds)) % 2 == 0
                batches.append({"dataset": ds, "n": n, "sequence": i, "num_docs": len(lengths),
                                "plans": plans, "skipped": skipped, "held_out": held_out})
    return batches


# -- measurement (runs inside each rank's process) ---------------------------------------

def _timer(device: torch.device) -> Callable[[Callable[[], None]], tuple[float, float]]:
    """(cpu ms, wall ms) of one call."""
    def run(fn: Callable[[], None]) -> tuple[float, float]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.process_time() - c0) * 1e3, (time.perf_counter() - w0) * 1e3
    return run


def measure_plan(plan: Plan, rank: int, model: ModelSpec, repeats: int, device: torch.device,
                 dtype: torch.dtype, kernel: str, overlap: bool,
                 reference_segments: bool = False) -> dict[str, Any]:
    """This rank's layer, kernel and exchange times for ``plan`` on the path the runtime
    takes (collective over the world), and that path (``path``)."""
    attn = ContextParallelAttention(
        plan, comm_mode=None, kernel=kernel, verify="never", overlap=overlap,
        segment_kernel=ReferenceSegments() if reference_segments else None)
    lay = attn.layout
    h, g, d = model.num_heads, model.num_kv_heads, model.head_dim
    gen = torch.Generator(device=device).manual_seed(rank)

    def rand(*shape: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_(grad)

    t = lay.num_tokens
    q, k, v = rand(t, h, d), rand(t, g, d), rand(t, g, d)
    dout = rand(t, h, d, grad=False)

    def layer() -> None:
        out = attn(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    path, segment_kernel = attn.execution_path(q)
    if lay.group_index < 0:
        kernel_call = exchange = _nothing
    else:
        state = attn.path_state(path, device, segment_kernel)
        kernel_call = planned_kernel_calls(PATHS[path], state, model, rand, segment_kernel)
        exchange = planned_exchange(PATHS[path], state, attn, model, device, dtype, rand)
    timer = _timer(device)
    out: dict[str, Any] = {"path": path}
    # CPU: process CPU time (see the module docstring); CUDA: wall time after a synchronize.
    primary = 1 if device.type == "cuda" else 0
    parts = (("layer", layer), ("kernel", kernel_call), ("exchange", exchange))
    for _, fn in parts:
        fn()  # warm-up
    # Repeats interleave the three functions, so a burst of load on the machine falls on
    # all of them alike and the copies (layer - kernel - exchange) do not absorb it. One
    # barrier before each measured call: CPU time does not count waiting, and the layer's
    # and exchange's own collectives keep the ranks in step on CUDA.
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in parts}
    for _ in range(repeats):
        for name, fn in parts:
            dist.barrier()
            runs[name].append(timer(fn))
    for name, timed in runs.items():
        out[f"{name}_ms"] = statistics.median(r[primary] for r in timed)
        out[f"{name}_wall_ms"] = statistics.median(r[1] for r in timed)
    return out


def _nothing() -> None:
    """A rank in no group: no kernel call, no transfer."""


def planned_kernel_calls(runtime: RuntimePath, state: Any, model: ModelSpec,
                         rand: Callable[..., torch.Tensor],
                         segment_kernel: SegmentKernel | None) -> Callable[[], None]:
    """Every kernel call the path lists for ``state`` (``RuntimePath.planned_calls``),
    forward and backward, on random queries and one random buffer per key buffer it names
    (no merges, no copies)."""
    h, g, d = model.num_heads, model.num_kv_heads, model.head_dim
    sizes = runtime.buffers(state)
    q, do = rand(sizes["queries"], h, d, grad=False), rand(sizes["queries"], h, d, grad=False)
    keys = {name: (rand(n, g, d, grad=False), rand(n, g, d, grad=False))
            for name, n in sizes.items() if name != "queries"}
    runs = []
    for c in runtime.planned_calls(state):
        k, v = (x[c.k_lo : c.k_hi] for x in keys[c.buffer])
        runs.append(_call(c, q[c.q_lo : c.q_hi], k, v, do[c.q_lo : c.q_hi], model, segment_kernel, rand))

    def run() -> None:
        for call in runs:
            call()

    return run


def _call(c: PlannedCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
          model: ModelSpec, segment_kernel: SegmentKernel | None,
          rand: Callable[..., torch.Tensor]) -> Callable[[], None]:
    """One planned call, forward + backward, as the path runs it."""
    h, g, d = model.num_heads, model.num_kv_heads, model.head_dim
    scale = d**-0.5
    if c.kind == "segment":
        assert segment_kernel is not None

        def segment() -> None:
            out, lse = segment_kernel.forward(q, k, v, c.meta, scale)
            segment_kernel.backward(do, q, k, v, out, lse, c.meta, scale)

        return segment
    if c.kind == "varlen":
        leaves = (rand(*q.shape), rand(*k.shape), rand(*v.shape))

        def varlen() -> None:
            out = varlen_attention(*leaves, c.meta, scale, VARLEN_KERNEL)
            torch.autograd.grad(out, leaves, do)

        return varlen
    do_g = do.reshape(len(q), g, h // g, d)

    def packed() -> None:
        _, lse = attention_forward(q, k, v, c.meta, scale)
        attention_backward(do_g.to(lse.dtype), q, k, v, lse, torch.zeros_like(lse), c.meta, scale)

    return packed


def planned_exchange(runtime: RuntimePath, state: Any, attn: ContextParallelAttention,
                     model: ModelSpec, device: torch.device, dtype: torch.dtype,
                     rand: Callable[..., torch.Tensor]) -> Callable[[], None]:
    """Every transfer the path lists for ``state`` (``RuntimePath.planned_transfers``),
    each waited for: the split K/V and dK/dV collectives, the stacked blocking exchange, or
    the ring's shifts of a ``T``-row block."""
    g, d = model.num_kv_heads, model.head_dim
    lay = attn.layout
    ex = attn.exchanger(device)
    link = ring_link(lay, attn.process_group, attn.order, CommCounter())
    runs: list[Callable[[], None]] = []
    for t in runtime.planned_transfers(state):
        kt, vt = rand(lay.num_tokens, g, d, grad=False), rand(lay.num_tokens, g, d, grad=False)
        if t.kind == "split":
            back = torch.zeros((t.rows, g, d), device=device, dtype=dtype)
            runs += [lambda kt=kt, vt=vt, back=back: (ex.start_forward(kt, vt).wait(),
                                                      ex.start_backward(back, back).wait())] * t.times
        elif t.kind == "stacked":
            local = torch.stack((kt, vt), dim=1)
            ones = torch.ones((t.rows, 2, g, d), device=device, dtype=dtype)
            runs += [lambda local=local, ones=ones: (ex.forward(local),
                                                     ex.backward(ones, torch.zeros_like(local)))] * t.times
        else:
            block = (rand(t.rows, g, d, grad=False), rand(t.rows, g, d, grad=False))
            runs += [lambda block=block: shift(link, block, "forward").wait()] * t.times

    def exchange() -> None:
        for run in runs:
            run()

    return exchange


def measure_kernel_only(plan: Plan, model: ModelSpec, repeats: int, device: torch.device,
                        dtype: torch.dtype, kernel: str,
                        reference_segments: bool = False) -> list[dict[str, Any]]:
    """Per rank of ``plan``, its kernel alone on this one device (wall ms after a
    synchronize), ranks one after another: the kernel term where the plan has more ranks
    than there are GPUs, on the flash path the runtime would take (segments, or the segment
    ring for a ring plan, on the segment kernel ``aten_flash.choose_kernel`` picks: PyTorch's
    own FlashAttention by default; gathered where none passes its probe), each call as the
    path lists it (``RuntimePath.planned_calls``; ``kernel``, the runtime's kernel name, is
    kept for the callers: the gathered call runs the path's own varlen kernel).
    Layer, copies and exchange are not measured (None)."""
    from worker_runtime import build_layout
    from worker_runtime.profiler import median_ms

    h, d = model.num_heads, model.head_dim
    probe = torch.empty((1, h, d), device=device, dtype=dtype)
    segment_kernel: SegmentKernel | None = (
        ReferenceSegments() if reference_segments else choose_kernel("auto", probe, "segments").segment_kernel)
    tiling_path = "segments" if segment_kernel is not None else "gathered"
    path = execution_path("segment", plan.comm_mode, tiling_path)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_(grad)

    out: list[dict[str, Any]] = []
    for rank in range(plan.cp_size):
        lay = build_layout(plan, rank)
        ms = 0.0
        if lay.num_real:
            ctx = standalone_context(lay, plan.comm_mode, device, segment_kernel)
            state = PATHS[path].build(ctx)
            calls = planned_kernel_calls(PATHS[path], state, model, rand, segment_kernel)
            ms = median_ms(calls, device, repeats=repeats)
        out.append({"path": path, "kernel_ms": ms, "kernel_wall_ms": ms, "layer_ms": None,
                    "exchange_ms": None, "layer_wall_ms": None, "exchange_wall_ms": None})
    return out


def measure_worker(rank: int, world: int, plan_jsons: list[str], model: dict[str, Any],
                   repeats: int, device_kind: str, kernel: str, overlap: bool,
                   reference_segments: bool) -> list[dict[str, Any]]:
    device = torch.device(f"cuda:{rank}" if device_kind == "cuda" else "cpu")
    dtype = torch.bfloat16 if device_kind == "cuda" else torch.float32
    spec = ModelSpec(**model)
    return [measure_plan(Plan.from_json(p), rank, spec, repeats, device, dtype, kernel, overlap,
                         reference_segments) for p in plan_jsons]


def _nccl_child(rank: int, world: int, port: int, args: tuple[Any, ...], results: Any) -> None:
    import traceback
    from datetime import timedelta

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=300),
                                device_id=torch.device(f"cuda:{rank}"))
        results.put((rank, True, measure_worker(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_nccl(world: int, args: tuple[Any, ...], timeout_s: float) -> list[Any]:
    """measure_worker on ``world`` GPUs, one process each (NCCL); RuntimeError on failure."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_child, args=(r, world, port, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, ok, value = results.get(timeout=timeout_s)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return [out[r] for r in range(world)]


# -- records, fit, validation --------------------------------------------------------------

def flash_path_of(path: str) -> str:
    """The model's ``flash_path`` that prices a run on ``path`` (lean and ring: either)."""
    return "gathered" if path == "gathered" else "segments"


def run_path(per_rank: Sequence[dict[str, Any]]) -> str:
    """The path a plan's ranks ran (they agree: the runtime checks it)."""
    paths = {m["path"] for m in per_rank}
    if len(paths) != 1:
        raise ValueError(f"the ranks of one plan ran different paths: {sorted(paths)}")
    return paths.pop()


def rank_records(batches: list[dict[str, Any]], measured: dict[tuple[int, str], list[dict[str, Any]]],
                 kernel: KernelProfile, link: LinkProfile, overlap: bool) -> list[dict[str, Any]]:
    """One record per grouped rank of every measured plan: model inputs + measured times,
    priced on the path the plan ran (noted in the batch's ``paths``); ValueError when the
    model's path for the profile differs from it."""
    out = []
    for bi, b in enumerate(batches):
        for s, plan in b["plans"].items():
            per_rank = measured.get((bi, s))
            if per_rank is None:
                continue
            path = run_path(per_rank)
            b.setdefault("paths", {})[s] = path
            for terms in plan_rank_terms(plan, kernel, link, overlap=overlap,
                                         flash_path=flash_path_of(path)):
                if terms.path != path:
                    raise ValueError(f"{s} plan of batch {bi} ran on the {path} path but kernel "
                                     f"profile {kernel.name} prices it on the {terms.path} path")
                m = per_rank[terms.rank]
                layer, kern, exch = m["layer_ms"], m["kernel_ms"], m["exchange_ms"]
                copies = None if layer is None or kern is None or exch is None else max(
                    0.0, layer - kern - exch)
                out.append({
                    "batch": bi, "held_out": b["held_out"], "strategy": s, "plan_id": plan.plan_id,
                    "comm_mode": plan.comm_mode,
                    "path": terms.path, "n": b["n"], "dataset": b["dataset"], "rank": terms.rank,
                    "group": terms.group, "pairs": terms.work.pairs, "tiles": terms.work.tiles,
                    "segments": terms.work.segments, "row_blocks": terms.work.row_blocks,
                    "calls": terms.work.calls, "peer_steps": terms.peer_steps,
                    "fwd_flops": terms.fwd_flops, "copy_bytes": terms.copy_bytes,
                    "copy_ops": terms.copy_ops, "comm_bytes": terms.comm_bytes,
                    "passes": terms.passes, **m, "copy_ms": copies,
                })
    return out


def predict(plan: Plan, kernel: KernelProfile, link: LinkProfile, overlap: bool,
            path: str) -> tuple[float, dict[int, Any]]:
    """(predicted step = largest per-rank layer ms, per-rank terms) under the profiles, on
    the path the plan ran."""
    terms = plan_rank_terms(plan, kernel, link, overlap=overlap, flash_path=flash_path_of(path))
    return max(t.estimate.layer_ms for t in terms), {t.rank: t for t in terms}


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(values: Sequence[float]) -> np.ndarray:
        x = np.asarray(values, dtype=float)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for value in np.unique(x):
            same = x == value
            r[same] = r[same].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    if len(a) < 2 or ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def validate(batches: list[dict[str, Any]], records: list[dict[str, Any]], kernel: KernelProfile,
             link: LinkProfile, overlap: bool) -> dict[str, Any]:
    """Held-out batch figures under the fitted profiles. A record's predicted
    exchange is every transfer in full (what was measured alone); its predicted layer has
    the exposed part."""
    by_plan: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in records:
        by_plan.setdefault((r["batch"], r["strategy"]), []).append(r)
    plans, batch_rows = [], []
    for bi, b in enumerate(batches):
        rows = []
        for s, plan in b["plans"].items():
            recs = by_plan.get((bi, s))
            if not recs or any(r["layer_ms"] is None for r in recs):
                if recs:  # kernel-only records: per-term predictions only
                    _, per_rank = predict(plan, kernel, link, overlap, b["paths"][s])
                    for r in recs:
                        r.update(pred_kernel_ms=per_rank[r["rank"]].estimate.kernel_ms)
                continue
            pred, per_rank = predict(plan, kernel, link, overlap, b["paths"][s])
            meas = max(r["layer_ms"] for r in recs)
            for r in recs:
                t = per_rank[r["rank"]]
                e = t.estimate
                r.update(pred_kernel_ms=e.kernel_ms, pred_copy_ms=e.copy_ms,
                         pred_exchange_ms=t.transfer_ms, pred_exposed_ms=e.comm_ms,
                         pred_layer_ms=e.layer_ms)
            rows.append({"batch": bi, "strategy": s, "held_out": b["held_out"], "measured_ms": meas,
                         "predicted_ms": pred, "rel_error": (pred - meas) / meas})
        plans += rows
        held = [r for r in rows if r["held_out"]]
        if len(held) >= 2:
            ranked = sorted(held, key=lambda r: r["predicted_ms"])
            best_pred = ranked[0]
            fastest = min(r["measured_ms"] for r in held)
            batch_rows.append({
                "batch": bi, "dataset": b["dataset"], "n": b["n"], "model_fastest": best_pred["strategy"],
                "measured_fastest": min(held, key=lambda r: r["measured_ms"])["strategy"],
                "gap": best_pred["measured_ms"] / fastest - 1.0,
                "margin": ranked[1]["predicted_ms"] / best_pred["predicted_ms"] - 1.0,
            })
    held = [p for p in plans if p["held_out"]]
    errors = [abs(p["rel_error"]) for p in held]
    return {
        "plans": plans, "batches": batch_rows,
        "held_out_plans": len(held),
        "median_abs_rel_error": float(np.median(errors)) if errors else float("nan"),
        "p90_abs_rel_error": float(np.percentile(errors, 90)) if errors else float("nan"),
        "spearman": spearman([p["predicted_ms"] for p in held], [p["measured_ms"] for p in held]),
        "fastest_ok": sum(r["gap"] <= WITHIN for r in batch_rows),
        "num_batches": len(batch_rows),
    }


def term_errors(records: list[dict[str, Any]]) -> dict[str, float]:
    """Median absolute relative error per term on held-out ranks (terms measured > 0)."""
    out = {}
    for term, pred in (("kernel_ms", "pred_kernel_ms"), ("copy_ms", "pred_copy_ms"),
                       ("exchange_ms", "pred_exchange_ms")):
        errs = [abs(r[pred] - r[term]) / r[term] for r in records
                if r["held_out"] and r.get(term) and pred in r]
        out[term] = float(np.median(errs)) if errs else float("nan")
    return out


def rank_spread(records: list[dict[str, Any]]) -> tuple[float, float]:
    """The measurement's noise floor: per plan with two or more ranks that compute, the
    ratio of its ranks' largest to smallest kernel time per attention pair, minus 1
    (the same kernel code on nearly equal work); median and p90 over plans."""
    per_plan: dict[tuple[int, str], list[float]] = {}
    for r in records:
        if r.get("kernel_ms") and r.get("pairs"):
            per_plan.setdefault((r["batch"], r["strategy"]), []).append(r["kernel_ms"] / r["pairs"])
    spread = [max(v) / min(v) - 1.0 for v in per_plan.values() if len(v) > 1]
    if not spread:
        return float("nan"), float("nan")
    return float(np.median(spread)), float(np.percentile(spread, 90))


def scatter(path: Path, plans: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for held, color, label in ((False, "#9ab", "fit half"), (True, "#c33", "held-out half")):
        pts = [p for p in plans if p["held_out"] == held]
        ax.scatter([p["measured_ms"] for p in pts], [p["predicted_ms"] for p in pts], s=10,
                   c=color, label=label)
    values = [v for p in plans for v in (p["measured_ms"], p["predicted_ms"]) if v > 0]
    if values:
        lo, hi = min(values), max(values)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("measured step ms (max over ranks)")
    ax.set_ylabel("predicted step ms (fitted profile)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def layout_key(plan: Plan) -> str:
    """What the runtime executes of a plan: its exchange and every group's ranks, shards and
    padding (strategies that return the same layout run the same program)."""
    return json.dumps([plan.comm_mode, [[list(g.ranks), [[list(s) for s in rank] for rank in g.shards],
                                         list(g.padding)] for g in plan.groups]])


def distinct_layouts(keys: Sequence[tuple[int, str]], batches: list[dict[str, Any]]
                     ) -> tuple[list[tuple[int, str]], dict[tuple[int, str], tuple[int, str]]]:
    """The plans to run (the first of each batch's distinct layouts) and, for every plan,
    the one whose measurement it shares. Measuring one layout twice and ranking the two
    runs would rank noise."""
    first: dict[tuple[int, str], tuple[int, str]] = {}
    same: dict[tuple[int, str], tuple[int, str]] = {}
    for bi, s in keys:
        rep = first.setdefault((bi, layout_key(batches[bi]["plans"][s])), (bi, s))
        same[(bi, s)] = rep
    return list(first.values()), same


def run(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    load_start = os.getloadavg()
    cuda = args.device == "cuda"
    model = GPU_MODEL if cuda else CPU_MODEL
    base_kernel = get_kernel_profile(args.base_kernel)
    base_link = get_link_profile(args.base_link)
    batches = make_batches(args.datasets, args.cp_sizes, args.sequences, args.tokens_per_rank, model,
                           args.strategies, base_kernel.name, base_link.name)
    plan_seconds = time.perf_counter() - start
    measured: dict[tuple[int, str], list[dict[str, Any]]] = {}
    kernel_name = "flash" if cuda else "torch"
    runs = 0  # distinct layouts run
    for n in args.cp_sizes:
        every = [(bi, s) for bi, b in enumerate(batches) if b["n"] == n for s in b["plans"]]
        if not every:
            continue
        keys, same = distinct_layouts(every, batches)
        runs += len(keys)
        plans = [batches[bi]["plans"][s] for bi, s in keys]
        work = ([p.to_json() for p in plans], model.to_dict(), args.repeats, args.device,
                kernel_name, args.overlap, args.reference_segments)
        if cuda and n > torch.cuda.device_count():
            device = torch.device("cuda:0")
            for bi, s in keys:
                measured[(bi, s)] = measure_kernel_only(batches[bi]["plans"][s], model, args.repeats,
                                                        device, torch.bfloat16, kernel_name,
                                                        args.reference_segments)
        else:
            if cuda:
                results = run_nccl(n, work, timeout_s=args.world_timeout)
            else:
                results = run_distributed(measure_worker, n, *work, timeout_s=args.world_timeout,
                                          pg_timeout_s=args.world_timeout)
            for j, key in enumerate(keys):
                measured[key] = [results[r][j] for r in range(n)]
        for key, rep in same.items():
            if key != rep:
                measured[key] = [dict(m) for m in measured[rep]]
    records = rank_records(batches, measured, base_kernel, base_link, args.overlap)
    fit_records = [r for r in records if not r["held_out"]]
    fitted = fit_step_profile(fit_records, base_kernel=base_kernel, base_link=base_link,
                              name=args.profile_name)
    result = validate(batches, records, fitted.kernel, fitted.link, args.overlap)
    result.update(
        seconds=time.perf_counter() - start, plan_seconds=plan_seconds, load_start=load_start,
        load_end=os.getloadavg(), records=records, fit=profile_document(fitted),
        terms=term_errors(records), spread=rank_spread(records), num_plans=sum(1 for _ in measured), num_runs=runs,
        paths={p: sum(1 for b in batches for q in b.get("paths", {}).values() if q == p)
               for p in sorted({q for b in batches for q in b.get("paths", {}).values()})},
        skipped=[f"{b['dataset']} N={b['n']} #{b['sequence']}: {s}: {why}"
                 for b in batches for s, why in b["skipped"].items()],
    )
    write_outputs(args, result, model)
    return result


def write_outputs(args: argparse.Namespace, r: dict[str, Any], model: ModelSpec) -> None:
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    stem = args.stem
    (out / f"{stem}_profile.json").write_text(json.dumps(r["fit"], indent=1) + "\n")
    doc = {"format": RECORDS_FORMAT, "device": args.device, "overlap": args.overlap,
           "model": model.to_dict(),
           "base_kernel": args.base_kernel, "base_link": args.base_link, "records": r["records"],
           "plans": r["plans"], "batches": r["batches"]}
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    title = (f"{args.device}: {r['held_out_plans']} held-out plans, median |err| "
             f"{r['median_abs_rel_error']:.1%}, Spearman {r['spearman']:.2f}")
    scatter(out / f"{stem}.png", r["plans"], title)
    k, link = r["fit"]["kernel"], r["fit"]["link"]
    fit = r["fit"]["fit"]
    ok = r["fastest_ok"], r["num_batches"]
    lines = [
        f"# The step-time model against the worker runtime ({args.device})",
        "",
        f"Command: `{args.command}`",
        "",
        f"Machine: {os.cpu_count()} cores, torch {torch.__version__}; "
        f"{'NCCL, flash-attn, bf16' if args.device == 'cuda' else 'gloo on loopback, PyTorch kernel, float32, 1 thread per rank'}; "
        f"overlap {'on' if args.overlap else 'off'} (runtime and model); paths run "
        f"(plans): {', '.join(f'{p} {c}' for p, c in r['paths'].items())}"
        f"{' (segments with the reference PyTorch segment kernel)' if args.reference_segments else ''}; "
        f"model {model.num_heads} heads / {model.num_kv_heads} KV heads x {model.head_dim}. "
        f"{r['num_plans']} plans measured as {r['num_runs']} distinct layouts (plans of one batch "
        f"with the same shards share one run) ({len(r['records'])} rank records), {args.repeats} repeats "
        f"each (median); data sets {', '.join(args.datasets)}; N in {list(args.cp_sizes)}; "
        f"{args.tokens_per_rank} tokens per rank. Run took {r['seconds']:.0f} s "
        f"(planning {r['plan_seconds']:.0f} s); load average {r['load_start'][0]:.1f} at start, "
        f"{r['load_end'][0]:.1f} at end.",
        "",
        "## Held-out plans (every second batch of each data set; profile fitted on the others)",
        "",
        "| figure | value | target |",
        "|---|---:|---:|",
        f"| held-out plans | {r['held_out_plans']} | |",
        f"| median abs rel error of the step | {r['median_abs_rel_error']:.1%} | <= 10% |",
        f"| p90 abs rel error of the step | {r['p90_abs_rel_error']:.1%} | <= 25% |",
        f"| Spearman predicted vs measured | {r['spearman']:.3f} | >= 0.9 |",
        f"| batches whose model-fastest is measured fastest or within 3% | {ok[0]} / {ok[1]} "
        f"({ok[0] / max(1, ok[1]):.0%}) | >= 90% |",
        "",
        "Median abs rel error per term on held-out ranks: "
        + ", ".join(f"{t} {e:.1%}" for t, e in r["terms"].items()) + ".",
        "",
        f"Noise floor: the ranks of one plan, running the same kernel on nearly equal work, "
        f"differ by {r['spread'][0]:.1%} (median over plans; p90 {r['spread'][1]:.1%}) in kernel "
        "time per attention pair (largest / smallest - 1). Model margin (below): how much slower "
        "the model predicts its second-fastest strategy; where it is under the noise floor, the "
        "model's pick among near-equal plans is decided by measurement noise.",
        "",
        "## Fitted profile",
        "",
        f"Kernel: fwd {k['fwd_tflops'] * 1e3:.3g} GFLOP/s, bwd {k['bwd_tflops'] * 1e3:.3g} GFLOP/s, "
        f"per tile {k['per_tile_us']:.3g} us, per query block {k['per_row_block_us']:.3g} us, "
        f"per segment {k['per_seq_us']:.3g} us, per call "
        f"{k['call_overhead_us']:.3g} us (RMS residual {fit['kernel']['rms_rel_pct']:.1f}%); copies "
        f"{k['copy_gbps']:.3g} GB/s + {k['op_overhead_us']:.3g} us per op (RMS "
        f"{fit['copy']['rms_rel_pct']:.1f}%); exchange {link['bandwidth_gbps']:.3g} GB/s + "
        f"{link['latency_us']:.3g} us per collective or shift + {link['per_peer_us']:.3g} us per peer"
        + (f" (RMS {fit['exchange']['rms_rel_pct']:.1f}%)." if "rms_rel_pct" in fit["exchange"] else "."),
        "",
        "## Held-out batches",
        "",
        "| data | N | model fastest | model margin | measured fastest | model's pick vs fastest |",
        "|---|---:|---|---:|---|---:|",
        *(f"| {b['dataset']} | {b['n']} | {b['model_fastest']} | {b['margin']:.1%} | "
          f"{b['measured_fastest']} | +{b['gap']:.1%} |" for b in r["batches"]),
        "",
        f"Files: {args.stem}.json (records and predictions), {args.stem}.png (scatter), "
        f"{args.stem}_profile.json (fitted profile).",
    ]
    if r["skipped"]:
        lines += ["", "Plans a strategy refused (not measured):", "",
                  *(f"- {s}" for s in r["skipped"])]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sequences", type=int, default=2, help="sequences per data set and N")
    parser.add_argument("--tokens-per-rank", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per plan and rank (default 5 on CPU, 3 on CUDA)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--cpu-smoke", type=Path, metavar="DIR", help="tiny end-to-end run into DIR")
    parser.add_argument("--world-timeout", type=float, default=900.0)
    parser.add_argument("--overlap", action="store_true",
                        help="run the runtime and the model with overlap on (CPU time cannot "
                             "show it; on CUDA the segments path overlaps, the gathered never)")
    parser.add_argument("--reference-segments", action="store_true",
                        help="run flash's segments path with the exact PyTorch segment kernel "
                             "(any device; plans and base profile h100-fa2): checks the harness")
    args = parser.parse_args(argv)
    args.command = " ".join(["python -m bench.model_check", *(argv if argv is not None else sys.argv[1:])])
    args.strategies, args.cp_sizes = STRATEGIES, CP_SIZES
    args.datasets = (*DATASETS, *ADVERSARIAL)
    cuda = args.device == "cuda"
    args.base_kernel = "h100-fa2" if cuda or args.reference_segments else "cpu-torch"
    args.base_link = "nvlink" if cuda else "gloo-local"
    args.profile_name = f"fitted-{args.base_kernel}"
    args.stem = "model_check_gpu" if cuda else "model_check"
    if args.tokens_per_rank is None:
        args.tokens_per_rank = 16384 if cuda else 1024
    if args.repeats is None:
        args.repeats = 3 if cuda else 5
    if args.cpu_smoke:
        args.device, args.base_link = "cpu", "gloo-local"
        args.base_kernel = "h100-fa2" if args.reference_segments else "cpu-torch"
        args.profile_name, args.stem = f"fitted-{args.base_kernel}", "model_check"
        args.out_dir, args.sequences, args.repeats = args.cpu_smoke, 1, 1
        args.tokens_per_rank, args.cp_sizes = 128, (3,)
        args.datasets = ("wlbllm", "family:pile", "one doc")
        args.strategies = ("flashcp", "per_doc", "llama3", "zigzag", "fcp")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("model_check: no CUDA device; nothing run, nothing written")
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
