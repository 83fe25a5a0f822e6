"""The measuring stages of ``bench/gpu_check.py`` (its docstring says what each one does).

Each stage takes the check's ``Setup`` and returns a ``Stage``: its markdown table, its
data (JSON) and whether it passed. Ranks run one after another on one device, from global
tensors, without the exchange (``simulate.py``'s way of running a plan in one process).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from planner_service.core.plan import Plan
from planner_service.core.profile_fit import fit_step_profile, profile_document
from planner_service.core.profiles import aten_profile, get_kernel_profile, get_link_profile
from planner_service.core.request import PlanRequest
from planner_service.core.step_time import plan_rank_terms
from planner_service.data import pack_sequences
from planner_service.solvers.registry import solve
from worker_runtime.comm import CommCounter
from worker_runtime.dispatch import dispatch
from worker_runtime.layout import RankLayout, build_comm_map, build_layout, expand_ranges
from worker_runtime.paths.piece_calls import build_segment_state
from worker_runtime.paths.ring_steps import ring_link
from worker_runtime.paths.segment_kernels import SegmentKernel, SegmentVarlen
from worker_runtime.paths.segment_ring import LocalSegmentRingAttention, build_segment_ring_state
from worker_runtime.paths.segments import LocalSegmentAttention
from worker_runtime.profiler import (
    AttentionRecord,
    device_name,
    median_ms,
    timings_document,
    write_timings,
)
from worker_runtime.reference import reference_attention
from worker_runtime.simulate import simulate_plan, simulate_segment_ring, simulate_segments

PATHS = ("segments", "segment_ring", "gathered")
FIGURE3_CASES = {"one 128K doc": [131072], "16 docs of 8K": [8192] * 16}
CHECK_STRATEGIES = ("flashcp", "per_doc", "zigzag", "llama3")
SEGMENTS: dict[str, Any] = {"comm_mode": "alltoallv", "flash_path": "segments"}
"""How the model check prices every plan: the segments path of the distinct remote KV (what
it runs, whatever the plan's own exchange; a ring plan too)."""


class Stage(NamedTuple):
    md: list[str]
    data: dict[str, Any]
    ok: bool
    summary: str = ""


def first_kernel(s: Any) -> tuple[str, SegmentKernel]:
    """The check's first segment kernel (PyTorch's FlashAttention on CUDA)."""
    if not s.kernels:
        raise RuntimeError("no segment kernel passed its probe here (see the RuntimeWarning)")
    name, kern = next(iter(s.kernels.items()))
    return name, kern


def simulate_gathered(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kernel: SegmentKernel) -> torch.Tensor:
    """The gathered path for every rank (per shard the keys ``[0, e)`` of its doc, one call
    of ``kernel``) on global packed tensors; differentiable."""
    out = q.new_zeros(q.shape)
    for rank in range(plan.cp_size):
        lay = build_layout(plan, rank)
        if lay.group_index < 0 or lay.num_real == 0:
            continue
        rows, keys, meta = _gathered_inputs(lay, kernel, q.device)
        o = SegmentVarlen.apply(q[rows], k[keys], v[keys], kernel, meta, q.shape[-1] ** -0.5)
        out = out.index_add(0, rows, o)
    return out


def _gathered_inputs(lay: RankLayout, kernel: SegmentKernel, dev: torch.device) -> tuple[Any, Any, Any]:
    docs = [s.doc for s in lay.shards]
    keys = expand_ranges(lay.doc_offsets[docs], np.array([s.end for s in lay.shards], np.int64))
    rows = torch.from_numpy(lay.global_index[: lay.num_real]).to(dev)
    return rows, torch.from_numpy(keys).to(dev), kernel.meta(lay.cu_seqlens_q, lay.cu_seqlens_k, True, dev)


def _inputs(n: int, heads: tuple[int, ...], d: int, seed: int, dev: torch.device,
            dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(n, h, d, generator=gen, dtype=torch.float64).to(device=dev, dtype=dtype)
            for h in heads]


def correctness(s: Any, tol: float) -> Stage:
    m = s.check_model
    context = max(256, 4096 // s.scale)
    # The data set's packing, then short docs (one token; single-shard docs beside long ones).
    lengths = pack_sequences(s.source, context_length=context * 3 // 4, num_sequences=1, seed=1)[0]
    lengths += [1, 5, 33, context // 4 - 39]
    h, g, d = m.num_heads, m.num_kv_heads, m.head_dim
    q, k, v, w = _inputs(sum(lengths), (h, g, g, h), d, 0, s.device, torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(leaves[0], leaves[1], leaves[2], lengths)
    want = [ref.detach(), *torch.autograd.grad((ref * w).sum(), leaves)]
    del ref, leaves
    rows: list[dict[str, Any]] = []
    for strategy in CHECK_STRATEGIES:
        plan = solve(PlanRequest(doc_lengths=tuple(lengths), cp_size=4, strategy=strategy, model=m))
        runs: list[tuple[str, str, Callable[..., torch.Tensor]]] = [
            (name, path, lambda *x, f=fn, kern=kern, plan=plan: f(plan, *x, kern))
            for name, kern in s.kernels.items()
            for path, fn in zip(PATHS, (simulate_segments, simulate_segment_ring, simulate_gathered),
                                strict=True)]
        runs.append(("torch", "lean", lambda *x, plan=plan: simulate_plan(
            plan, "alltoallv", *x, kernel="torch").output))
        for name, path, fn in runs:
            low = [x.to(s.dtype).requires_grad_() for x in (q, k, v)]
            out = fn(*low)
            got = [out, *torch.autograd.grad((out.double() * w).sum(), low)]
            errs: dict[str, tuple[float, float]] = {}
            for label, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
                diff = (a.double() - b).abs()
                errs[label] = (diff.max().item(), (diff / (tol + tol * b.abs())).max().item())
            rows.append({"strategy": strategy, "kernel": name, "path": path, "errors": errs,
                         "ok": all(r <= 1.0 for _, r in errs.values())})
    ok = bool(s.kernels) and all(r["ok"] for r in rows)
    md = [f"{sum(lengths)} tokens ({len(lengths)} docs), N = 4, heads {h} on {g} KV heads, head "
          f"dim {d}, {s.dtype} against float64; cell: max abs error (max of |err| / "
          f"({tol} + {tol} |ref|), pass <= 1)", "",
          "| strategy | kernel | path | out | dq | dk | dv | pass |", "|---|---|---|---|---|---|---|---|",
          *(f"| {r['strategy']} | {r['kernel']} | {r['path']} | "
            + " | ".join(f"{e:.2e} ({x:.2f})" for e, x in r["errors"].values())
            + f" | {'yes' if r['ok'] else 'NO'} |" for r in rows)]
    worst = max((x for r in rows for _, x in r["errors"].values()), default=math.nan)
    return Stage(md, {"rows": rows, "tolerance": tol}, ok,
                 f"{sum(r['ok'] for r in rows)}/{len(rows)} rows pass, worst ratio {worst:.2f}")


def _runner(path: str, plan: Plan, rank: int, kern: SegmentKernel, glob: list[torch.Tensor],
            seed: int) -> Callable[[], None] | None:
    """One rank's fwd+bwd on ``path`` from the global q, k, v (leaves); None if it has no rows."""
    q, k, v = glob
    lay = build_layout(plan, rank)
    dev, scale = q.device, q.shape[-1] ** -0.5
    if lay.group_index < 0 or lay.num_real == 0:
        return None
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def grad_like(rows: int) -> torch.Tensor:
        return torch.randn(rows, *q.shape[1:], generator=gen).to(device=dev, dtype=q.dtype)

    if path == "segments":
        comm = build_comm_map(lay, "alltoallv")
        state = build_segment_state(lay, comm, kern, dev)
        loc = torch.from_numpy(lay.global_index[: lay.num_real][state.plan.local_rows]).to(dev)
        far_np = (lay.doc_offsets[comm.remote_doc] + comm.remote_pos)[state.plan.remote_order]
        far = torch.from_numpy(far_np).to(dev)
        dout = grad_like(len(loc))

        def segments() -> None:
            out = LocalSegmentAttention.apply(q[loc], k[loc], v[loc], k[far], v[far], state, scale)
            torch.autograd.grad(out, (q, k, v), dout)

        return segments
    if path == "segment_ring":
        ring = build_segment_ring_state(lay, kern, ring_link(lay, None, None, CommCounter()), dev)
        owners = [build_layout(plan, lay.group_ranks[(lay.slot - i) % lay.num_ranks])
                  for i in range(lay.num_ranks)]
        blocks = [torch.stack([dispatch(o, x.detach()) for o in owners]).requires_grad_() for x in (k, v)]
        q_loc = dispatch(lay, q.detach()).requires_grad_()
        dout = grad_like(lay.num_tokens)

        def segment_ring() -> None:
            out = LocalSegmentRingAttention.apply(q_loc, blocks[0], blocks[1], ring, scale)
            torch.autograd.grad(out, (q_loc, *blocks), dout)

        return segment_ring
    rows, keys, meta = _gathered_inputs(lay, kern, dev)
    dout = grad_like(len(rows))

    def gathered() -> None:
        out = SegmentVarlen.apply(q[rows], k[keys], v[keys], kern, meta, scale)
        torch.autograd.grad(out, (q, k, v), dout)

    return gathered


def _global(s: Any, total: int) -> list[torch.Tensor]:
    m = s.model
    return [x.requires_grad_() for x in _inputs(total, (m.num_heads, m.num_kv_heads, m.num_kv_heads),
                                                   m.head_dim, 0, s.device, s.dtype)]


def _per_rank(path: str, plan: Plan, kern: SegmentKernel, glob: list[torch.Tensor], s: Any) -> list[float]:
    ms = []
    for rank in range(plan.cp_size):
        fn = _runner(path, plan, rank, kern, glob, rank)
        ms.append(median_ms(fn, s.device, repeats=s.repeats, warmup=s.warmup) if fn is not None else 0.0)
    return ms


def timings(s: Any) -> Stage:
    lengths = pack_sequences(s.source, context_length=131072 // s.scale, num_sequences=1, seed=0)[0]
    glob = _global(s, sum(lengths))
    rows: list[dict[str, Any]] = []
    for strategy in ("flashcp", "zigzag"):
        plan = solve(PlanRequest(doc_lengths=tuple(lengths), cp_size=8, strategy=strategy, model=s.model))
        for name, kern in s.kernels.items():
            for path in PATHS:
                ms = _per_rank(path, plan, kern, glob, s)
                rows.append({"strategy": strategy, "kernel": name, "path": path, "per_rank_ms": ms})
    md = [f"One packed sequence of {sum(lengths)} tokens ({len(lengths)} docs), N = 8, heads "
          f"{s.model.num_heads}/{s.model.num_kv_heads}, head dim {s.model.head_dim}; fwd+bwd ms "
          f"per rank without the exchange, median of {s.repeats}", "",
          "| strategy | kernel | path | max ms | mean ms | per-rank ms |", "|---|---|---|---:|---:|---|",
          *(f"| {r['strategy']} | {r['kernel']} | {r['path']} | {max(r['per_rank_ms']):.2f} | "
            f"{statistics.mean(r['per_rank_ms']):.2f} | "
            + ", ".join(f"{x:.2f}" for x in r["per_rank_ms"]) + " |" for r in rows)]
    return Stage(md, {"rows": rows, "lengths": lengths}, bool(rows), f"{len(rows)} rows")


def figure3(s: Any) -> Stage:
    name, kern = first_kernel(s)
    rows: list[dict[str, Any]] = []
    for case, full in FIGURE3_CASES.items():
        lengths = [n // s.scale for n in full]
        glob = _global(s, sum(lengths))
        for strategy in ("per_doc", "flashcp"):
            plan = solve(PlanRequest(doc_lengths=tuple(lengths), cp_size=8, strategy=strategy, model=s.model))
            ms = _per_rank("segments", plan, kern, glob, s)
            rows.append({"case": case, "strategy": strategy, "shards": plan.metrics.num_shards,
                         "per_rank_ms": ms})
    md = [f"Per-rank fwd+bwd ms on the segments path ({name} kernel), N = 8, ranks one after another", "",
          "| case | strategy | shards | max rank ms | mean rank ms | per-rank ms |", "|---|---|---:|---:|---:|---|",
          *(f"| {r['case']} | {r['strategy']} | {r['shards']} | {max(r['per_rank_ms']):.2f} | "
            f"{statistics.mean(r['per_rank_ms']):.2f} | " + ", ".join(f"{x:.2f}" for x in r["per_rank_ms"])
            + " |" for r in rows)]
    return Stage(md, {"kernel": name, "rows": rows}, bool(rows), f"{len(rows)} rows")


def _calls_only(lay: RankLayout, kern: SegmentKernel, s: Any, seed: int) -> Callable[[], None]:
    """The segments path's varlen calls alone, forward and backward (the kernel term)."""
    m, dev = s.model, s.device
    comm = build_comm_map(lay, "alltoallv")
    state = build_segment_state(lay, comm, kern, dev)
    h, g, d = m.num_heads, m.num_kv_heads, m.head_dim
    q, do = _inputs(lay.num_real, (h, h), d, seed, dev, s.dtype)
    kl, vl = _inputs(lay.num_real, (g, g), d, seed + 1, dev, s.dtype)
    kf, vf = _inputs(len(state.select), (g, g), d, seed + 2, dev, s.dtype)

    def run() -> None:
        for c, meta in zip(state.plan.calls, state.metas, strict=True):
            ks, vs = (kf, vf) if c.remote else (kl, vl)
            qs, kk, vv = q[c.q_lo : c.q_hi], ks[c.k_lo : c.k_hi], vs[c.k_lo : c.k_hi]
            out, lse = kern.forward(qs, kk, vv, meta, d**-0.5)
            kern.backward(do[c.q_lo : c.q_hi], qs, kk, vv, out, lse, meta, d**-0.5)

    return run


def model_check(s: Any) -> Stage:
    name, kern = first_kernel(s)
    base_name = aten_profile("FA2", device_name(s.device))[0] if s.device.type == "cuda" else "h100-aten-fa2"
    base, link = get_kernel_profile(base_name), get_link_profile("nvlink")
    plans: list[tuple[int, bool, Plan]] = []
    for n in (2, 4, 8):
        seqs = pack_sequences(s.source, context_length=n * 8192 // s.scale, num_sequences=2, seed=n)
        plans += [(n, i == 1, solve(PlanRequest(doc_lengths=tuple(x), cp_size=n, strategy=st, model=s.model)))
                  for i, x in enumerate(seqs) for st in CHECK_STRATEGIES]
    records: list[dict[str, Any]] = []
    for pi, (n, held_out, plan) in enumerate(plans):
        glob = _global(s, sum(plan.doc_lengths))
        for t in plan_rank_terms(plan, base, link, overlap=False, **SEGMENTS):
            assert t.path == "segments", t.path
            lay = build_layout(plan, t.rank)
            layer_fn = _runner("segments", plan, t.rank, kern, glob, t.rank)
            if layer_fn is None:
                continue
            kernel_ms = median_ms(_calls_only(lay, kern, s, t.rank), s.device, repeats=s.repeats,
                                  warmup=s.warmup)
            layer_ms = median_ms(layer_fn, s.device, repeats=s.repeats, warmup=s.warmup)
            records.append({"plan": pi, "held_out": held_out, "n": n, "strategy": plan.strategy,
                            "rank": t.rank, "fwd_flops": t.fwd_flops, "tiles": t.work.tiles,
                            "row_blocks": t.work.row_blocks, "segments": t.work.segments,
                            "calls": t.work.calls, "copy_bytes": t.copy_bytes, "copy_ops": t.copy_ops,
                            "comm_bytes": 0, "passes": 0, "peer_steps": 0, "kernel_ms": kernel_ms,
                            "copy_ms": max(0.0, layer_ms - kernel_ms), "exchange_ms": None,
                            "layer_ms": layer_ms})
    fit = fit_step_profile([r for r in records if not r["held_out"]], base_kernel=base,
                           base_link=link, name=f"{base.name}-fitted")
    rows: list[dict[str, Any]] = []
    for pi, (n, held_out, plan) in enumerate(plans):
        measured = [r for r in records if r["plan"] == pi]
        if not held_out or not measured:
            continue
        pred = {p: {t.rank: t.estimate for t in plan_rank_terms(plan, prof, link, overlap=False,
                                                                 **SEGMENTS)}
                for p, prof in (("fitted", fit.kernel), ("cited", base))}
        rows.append({"n": n, "strategy": plan.strategy,
                     "measured_ms": max(r["layer_ms"] for r in measured),
                     "measured_kernel_ms": max(r["kernel_ms"] for r in measured),
                     **{f"{p}_ms": max(e[r["rank"]].kernel_ms + e[r["rank"]].copy_ms for r in measured)
                        for p, e in pred.items()},
                     "fitted_kernel_ms": max(pred["fitted"][r["rank"]].kernel_ms for r in measured)})
    errors = [abs(r["fitted_ms"] / r["measured_ms"] - 1) for r in rows if r["measured_ms"] > 0]
    kernel_errors = [abs(r["fitted_kernel_ms"] / r["measured_kernel_ms"] - 1) for r in rows
                     if r["measured_kernel_ms"] > 0]
    med = statistics.median(errors) if errors else math.nan
    med_k = statistics.median(kernel_errors) if kernel_errors else math.nan
    md = [f"Segments path ({name} kernel), {len(records)} rank records of {len(plans)} plans; fitted on "
          f"the first sequence of each N, predicted on the second. Measured: the largest rank's fwd+bwd "
          f"without the exchange (kernel calls + merges + buffer gathers) and its kernel calls alone; "
          f"predicted (model): the largest rank's kernel + copy terms under the fitted profile and "
          f"under the cited {base.name}. Median abs rel error (fitted): {med:.1%} whole, "
          f"{med_k:.1%} kernel term.", "",
          "| N | strategy | measured ms | fitted ms | cited ms | kernel measured ms | kernel fitted ms |",
          "|---:|---|---:|---:|---:|---:|---:|",
          *(f"| {r['n']} | {r['strategy']} | {r['measured_ms']:.2f} | {r['fitted_ms']:.2f} | "
            f"{r['cited_ms']:.2f} | {r['measured_kernel_ms']:.2f} | {r['fitted_kernel_ms']:.2f} |"
            for r in rows),
          "", "Fitted kernel profile:", "", "```",
          json.dumps(fit.kernel.to_dict(), default=float), "```"]
    return Stage(md, {"profile": profile_document(fit), "records": records, "rows": rows,
                      "median_abs_rel_error": med, "kernel_median_abs_rel_error": med_k},
                 bool(rows), f"held-out median abs rel error {med:.1%} (kernel term {med_k:.1%})")


def fcp_timings(s: Any, out_dir: Any) -> Stage:
    """Profiler timings (``cp-planner-timings/v1``) of flashcp and zigzag plans, each rank's
    one gathered call on the first kernel, for FCP's cost-model fit (``planner
    fit-profile DIR/timings_gpu.json``)."""
    name, kern = first_kernel(s)
    records = []
    for context in (32768, 131072):
        lengths = pack_sequences(s.source, context_length=context // s.scale, num_sequences=1, seed=2)[0]
        glob = _global(s, sum(lengths))
        for degree in (4, 8):
            for strategy in ("flashcp", "zigzag"):
                plan = solve(PlanRequest(doc_lengths=tuple(lengths), cp_size=degree, strategy=strategy,
                                         model=s.model))
                records += [AttentionRecord(sum(lengths), degree, len(lengths), ms)
                            for ms in _per_rank("gathered", plan, kern, glob, s) if ms > 0]
    path = write_timings(out_dir / "timings_gpu.json", timings_document(
        records, device=device_name(s.device), dtype=s.dtype, model=s.model))
    md = [f"{len(records)} attention records (gathered path, {name} kernel) -> `{path.name}`; fit "
          f"FCP's cost model with `planner fit-profile {path.name} --out PROFILE.json`"]
    return Stage(md, {"records": len(records), "path": str(path)}, bool(records), f"{len(records)} records")
