"""``bench/gpu_check.py``'s ``windows`` stage: every usable segment kernel's windowed varlen
call against the exact float64 reference kernel.

Under a sliding window the runtime's flash kernels run one causal varlen call per layer
whose segments are each shard's window span: a segment's keys are its queries' own
positions and up to W - 1 keys before them (the halo), aligned bottom right, with
``window_size_left = W - 1`` (worker_runtime/windows.py, the gathered form). This stage
runs such calls, windows 1, 7, 128 and 4,096 (divided by the smoke's scale, at least 1), on
segments of one token to a few thousand with no halo, a partial halo and a full one, GQA,
forward and backward, in the check's dtype, and compares them with
``ReferenceSegments`` (the windowed masked kernel) in float64 on the same metadata. Pass:
``|got - ref| <= tol + tol |ref|`` everywhere, as the correctness stage.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from bench.gpu_check_stages import Stage
from worker_runtime.paths.segment_kernels import ReferenceSegments

WINDOWS = (1, 7, 128, 4096)
QUERY_LENGTHS = (1, 5, 33, 700, 3000)
"""Each segment's query count (divided by the smoke's scale, at least 1)."""


def segments(window: int, scale: int) -> tuple[np.ndarray, np.ndarray]:
    """``cu_q``, ``cu_k`` of one call: every query length with no halo, half a halo and a
    full one (``W - 1`` keys before the first query)."""
    lq, lk = [], []
    for length in QUERY_LENGTHS:
        q = max(1, length // scale)
        for halo in (0, (window - 1) // 2, window - 1):
            lq.append(q)
            lk.append(q + halo)
    return (np.concatenate([[0], np.cumsum(lq)]).astype(np.int64),
            np.concatenate([[0], np.cumsum(lk)]).astype(np.int64))


def _run(kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
         cu_q: np.ndarray, cu_k: np.ndarray, window: int) -> list[torch.Tensor]:
    """Forward and backward of one windowed causal call: out, dq, dk, dv."""
    meta = kernel.meta(cu_q, cu_k, True, q.device, window=window)
    scale = q.shape[-1] ** -0.5
    out, lse = kernel.forward(q, k, v, meta, scale)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, meta, scale)
    return [out, dq, dk, dv]


def windows(s: Any, tol: float) -> Stage:
    m = s.check_model
    h, g, d = m.num_heads, m.num_kv_heads, m.head_dim
    gen = torch.Generator(device="cpu").manual_seed(5)
    rows: list[dict[str, Any]] = []
    for window in sorted({max(1, w // s.scale) for w in WINDOWS}):
        cu_q, cu_k = segments(window, s.scale)
        t, n = int(cu_q[-1]), int(cu_k[-1])
        q, dout = (torch.randn(t, h, d, generator=gen, dtype=torch.float64).to(s.device)
                   for _ in range(2))
        k, v = (torch.randn(n, g, d, generator=gen, dtype=torch.float64).to(s.device)
                for _ in range(2))
        want = _run(ReferenceSegments(), q, k, v, dout, cu_q, cu_k, window)
        for name, kernel in s.kernels.items():
            lq, lk, lv, ld = (x.to(s.dtype) for x in (q, k, v, dout))
            got = _run(kernel, lq, lk, lv, ld, cu_q, cu_k, window)
            errs: dict[str, tuple[float, float]] = {}
            for label, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
                diff = (a.double() - b).abs()
                errs[label] = (diff.max().item(), (diff / (tol + tol * b.abs())).max().item())
            rows.append({"window": window, "kernel": name, "segments": len(cu_q) - 1,
                         "queries": t, "keys": n, "errors": errs,
                         "ok": all(r <= 1.0 for _, r in errs.values())})
    ok = bool(s.kernels) and all(r["ok"] for r in rows)
    md = [f"Windowed causal varlen calls (`window_size_left = W - 1`), heads {h} on {g} KV "
          f"heads, head dim {d}, {s.dtype} against the float64 reference kernel; cell: max abs "
          f"error (max of |err| / ({tol} + {tol} |ref|), pass <= 1)", "",
          "| W | kernel | segments | queries | keys | out | dq | dk | dv | pass |",
          "|---|---|---|---|---|---|---|---|---|---|",
          *(f"| {r['window']} | {r['kernel']} | {r['segments']} | {r['queries']} | {r['keys']} | "
            + " | ".join(f"{e:.2e} ({x:.2f})" for e, x in r["errors"].values())
            + f" | {'yes' if r['ok'] else 'NO'} |" for r in rows)]
    worst = max((x for r in rows for _, x in r["errors"].values()), default=float("nan"))
    return Stage(md, {"rows": rows, "tolerance": tol}, ok,
                 f"{sum(r['ok'] for r in rows)}/{len(rows)} rows pass, worst ratio {worst:.2f}")
