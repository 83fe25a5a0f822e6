"""Varlen causal attention kernels: flash-attn on CUDA, an exact PyTorch kernel otherwise.

Both compute, for every segment j, queries ``q[cu_q[j]:cu_q[j+1]]`` against keys
``k[cu_k[j]:cu_k[j+1]]`` with bottom-right causal alignment (the last query sees every
key; query t of a segment of Lq queries and Lk keys sees keys ``[0, Lk - Lq + t]``),
which is exactly "queries of shard (d, p, e) attend keys [0, e) of doc d".

A sliding window ``W`` (``window=``, None: causal) keeps, of those keys, the ones within
``W - 1`` positions of the query's own: query t sees keys ``[Lk - Lq + t - W + 1, Lk - Lq
+ t]`` (transformers' ``sliding_window`` and flash-attn's ``window_size = (W - 1, 0)``).

Shape legend: T = query rows, K = key rows, H = query heads, G = KV heads (GQA, H = G x R),
D = head dim. ``q_THD``, ``k_KGD``; query head h uses KV head h // R (flash-attn's rule).

The PyTorch kernel is FlashAttention's algorithm in plain torch: query blocks x key
blocks, online softmax forward, recomputation backward, so memory stays bounded by the
block size and float64 inputs give float64-exact results.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any, NamedTuple

import numpy as np
import torch

from worker_runtime.layout import expand_ranges

KERNELS = ("auto", "torch", "flash")
BLOCK_Q = 256
BLOCK_K = 256
"""Query x key rows of one block pair of the PyTorch kernel. A pair's score, probability
and gradient tensors are ``H x BLOCK_Q x BLOCK_K`` floats each; at 256 x 256 they stay in
a core's cache, so the time per computed pair varies little with the block shapes, which
is what the step-time model's per-pair rate assumes (``python -m bench.kernel_blocks``
measures it per block size)."""


class VarlenMeta(NamedTuple):
    """cu_seqlens and the torch kernel's per-row segment data, on one device."""

    cu_seqlens_q: torch.Tensor
    """int32 ``[S + 1]``."""
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    q_seg: torch.Tensor
    """``[T]`` segment of each query row."""
    q_limit: torch.Tensor
    """``[T]`` largest key position (within its segment) the query may see."""
    k_seg: torch.Tensor
    k_pos: torch.Tensor
    blocks: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]
    """(q0, q1, key blocks) tiles that hold every unmasked pair (torch kernel only)."""
    window: int | None = None
    """Sliding window: a query at position p sees keys ``(p - window, p]``; None: causal."""


def check_window(window: int | None) -> int | None:
    """``window`` itself if None or an integer >= 1; else ValueError naming it."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be None (causal) or an integer >= 1, got {window!r}")
    return int(window)


def build_meta(
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    device: torch.device | str = "cpu",
    *,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    window: int | None = None,
) -> VarlenMeta:
    """Metadata for segments with the given boundaries (``window``: the sliding window, None
    causal); raises ValueError if a segment has more queries than keys (bottom-right
    alignment would leave queries with no key) or for a window below 1."""
    window = check_window(window)
    cu_q = np.asarray(cu_seqlens_q, dtype=np.int64)
    cu_k = np.asarray(cu_seqlens_k, dtype=np.int64)
    lq, lk = np.diff(cu_q), np.diff(cu_k)
    if len(lq) != len(lk) or (lq > lk).any() or (lq < 0).any():
        raise ValueError("cu_seqlens_q/k must have equal length and every segment Lq <= Lk")
    segs = np.arange(len(lq), dtype=np.int64)
    q_seg = np.repeat(segs, lq)
    q_limit = expand_ranges(lk - lq, lq)
    k_seg = np.repeat(segs, lk)
    k_pos = expand_ranges(np.zeros(len(lk), dtype=np.int64), lk)
    blocks = []
    num_q = int(cu_q[-1]) if len(cu_q) else 0
    for q0 in range(0, num_q, block_q):
        q1 = min(q0 + block_q, num_q)
        # Keys from the first query's segment start (window: its window's start) to the
        # last query's own limit.
        k_lo = int(cu_k[q_seg[q0]])
        if window is not None:
            k_lo += max(0, int(q_limit[q0]) - window + 1)
        k_hi = int(cu_k[q_seg[q1 - 1]] + q_limit[q1 - 1] + 1)
        keys = tuple((k0, min(k0 + block_k, k_hi)) for k0 in range(k_lo, k_hi, block_k))
        blocks.append((q0, q1, keys))

    def tensor(x: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.from_numpy(x).to(device=device, dtype=dtype)

    return VarlenMeta(
        cu_seqlens_q=tensor(cu_q, torch.int32),
        cu_seqlens_k=tensor(cu_k, torch.int32),
        max_seqlen_q=int(lq.max(initial=0)),
        max_seqlen_k=int(lk.max(initial=0)),
        q_seg=tensor(q_seg), q_limit=tensor(q_limit), k_seg=tensor(k_seg), k_pos=tensor(k_pos),
        blocks=tuple(blocks), window=window,
    )


def build_masked_meta(
    q_seg: np.ndarray,
    q_pos: np.ndarray,
    k_seg: np.ndarray,
    k_pos: np.ndarray,
    device: torch.device | str = "cpu",
    *,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    window: int | None = None,
) -> VarlenMeta:
    """Torch-kernel metadata for "query (doc, pos) sees key (doc, p) iff p <= pos" (and
    ``p > pos - window`` under a sliding window).

    Queries and keys are each sorted by (doc, pos); keys need not be contiguous in
    position (a rank's own pieces of a doc, a peer's block, the remote pieces it needs).
    Key rows with a doc no query has (padding: any negative doc) are never seen. Each query
    block reads the keys from its first query's doc start to its last query's own
    position (window: from its first query's window start). No cu_seqlens (flash-attn
    cannot take this form). O(T + K) numpy.
    """
    window = check_window(window)
    q_seg, q_pos = np.asarray(q_seg, np.int64), np.asarray(q_pos, np.int64)
    k_seg, k_pos = np.asarray(k_seg, np.int64), np.asarray(k_pos, np.int64)
    stride = int(max(q_pos.max(initial=0), k_pos.max(initial=0))) + 1
    k_key = np.where(k_seg < 0, np.iinfo(np.int64).max, k_seg * stride + k_pos)
    blocks = []
    for q0 in range(0, len(q_seg), block_q):
        q1 = min(q0 + block_q, len(q_seg))
        low = 0 if window is None else max(0, int(q_pos[q0]) - window + 1)
        k_lo = int(np.searchsorted(k_key, q_seg[q0] * stride + low, side="left"))
        k_hi = int(np.searchsorted(k_key, q_seg[q1 - 1] * stride + q_pos[q1 - 1], side="right"))
        keys = tuple((k0, min(k0 + block_k, k_hi)) for k0 in range(k_lo, k_hi, block_k))
        blocks.append((q0, q1, keys))

    def tensor(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=torch.int64)

    empty = torch.zeros(0, dtype=torch.int32, device=device)
    return VarlenMeta(
        cu_seqlens_q=empty, cu_seqlens_k=empty, max_seqlen_q=0, max_seqlen_k=0,
        q_seg=tensor(q_seg), q_limit=tensor(q_pos), k_seg=tensor(k_seg), k_pos=tensor(k_pos),
        blocks=tuple(blocks), window=window,
    )


def flash_attn_available(device: torch.device) -> bool:
    """True on CUDA when the flash_attn package is importable."""
    return device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None


def uses_flash(q: torch.Tensor, kernel: str) -> bool:
    """Whether ``kernel`` runs flash-attn for queries like ``q`` (``auto``: CUDA, fp16/bf16,
    flash-attn importable)."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    return kernel == "flash" or (kernel == "auto" and half and flash_attn_available(q.device))


def varlen_attention(
    q_THD: torch.Tensor,
    k_KGD: torch.Tensor,
    v_KGD: torch.Tensor,
    meta: VarlenMeta,
    softmax_scale: float,
    kernel: str = "auto",
) -> torch.Tensor:
    """Segment-wise bottom-right causal attention (``meta.window``: sliding), differentiable;
    returns ``[T, H, D]``.

    ``kernel``: ``flash`` (flash_attn_varlen_func; CUDA, fp16/bf16), ``torch`` (exact) or
    ``auto`` (flash when available for this device and dtype, else torch).
    Raises ValueError for an unknown kernel or flash requested where it cannot run.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    half = q_THD.dtype in (torch.float16, torch.bfloat16)
    if uses_flash(q_THD, kernel):
        if not (half and flash_attn_available(q_THD.device)):
            raise ValueError("kernel='flash' needs CUDA tensors in fp16/bf16 and flash-attn installed")
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(
            q_THD, k_KGD, v_KGD, meta.cu_seqlens_q, meta.cu_seqlens_k,
            meta.max_seqlen_q, meta.max_seqlen_k, dropout_p=0.0,
            softmax_scale=softmax_scale, causal=True,
            window_size=(-1, -1) if meta.window is None else (meta.window - 1, 0),
        )
    return _TorchVarlen.apply(q_THD, k_KGD, v_KGD, meta, softmax_scale)


def _block_mask(meta: VarlenMeta, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    same = meta.q_seg[q0:q1, None] == meta.k_seg[None, k0:k1]
    seen = same & (meta.k_pos[None, k0:k1] <= meta.q_limit[q0:q1, None])
    if meta.window is not None:
        seen &= meta.k_pos[None, k0:k1] > meta.q_limit[q0:q1, None] - meta.window
    return seen


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def attention_forward(
    q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor, meta: VarlenMeta, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact blockwise forward, no autograd: ``(out [T, G, R, D], lse [T, G, R])`` in the
    compute dtype (float64 for float64 inputs, else float32). Every query needs at least one
    visible key (else its row is NaN)."""
    t, h, d = q_THD.shape
    g = k_KGD.shape[1]
    r = h // g
    cd = _compute_dtype(q_THD.dtype)
    out = torch.zeros(t, g, r, d, dtype=cd, device=q_THD.device)
    lse = torch.zeros(t, g, r, dtype=cd, device=q_THD.device)
    for q0, q1, keys in meta.blocks:
        q_QGRD = q_THD[q0:q1].view(q1 - q0, g, r, d).to(cd)
        m = torch.full((g, r, q1 - q0), -math.inf, dtype=cd, device=q_THD.device)
        den = torch.zeros_like(m)
        acc = torch.zeros(g, r, q1 - q0, d, dtype=cd, device=q_THD.device)
        for k0, k1 in keys:
            mask = _block_mask(meta, q0, q1, k0, k1)
            s = torch.einsum("qgrd,kgd->grqk", q_QGRD, k_KGD[k0:k1].to(cd)) * scale
            s = s.masked_fill(~mask, -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            den = den * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + torch.einsum("grqk,kgd->grqd", p, v_KGD[k0:k1].to(cd))
            m = m_new
        out[q0:q1] = (acc / den[..., None]).permute(2, 0, 1, 3)
        lse[q0:q1] = (m + torch.log(den)).permute(2, 0, 1)
    return out, lse


def attention_backward(
    do_TGRD: torch.Tensor,
    q_THD: torch.Tensor,
    k_KGD: torch.Tensor,
    v_KGD: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    meta: VarlenMeta,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact blockwise backward of one part of the keys, no autograd.

    ``lse`` and ``delta = rowsum(dout * out)`` are of the *whole* attention (all parts
    merged), so the parts' gradients add up to the gradient of the merged output (the
    ring-attention identity). Returns ``(dq [T, G, R, D], dk, dv)`` in the compute dtype.
    """
    t, h, d = q_THD.shape
    g = k_KGD.shape[1]
    r = h // g
    cd = lse.dtype
    dq = torch.zeros(t, g, r, d, dtype=cd, device=q_THD.device)
    dk = torch.zeros(k_KGD.shape, dtype=cd, device=q_THD.device)
    dv = torch.zeros(v_KGD.shape, dtype=cd, device=q_THD.device)
    for q0, q1, keys in meta.blocks:
        q_QGRD = q_THD[q0:q1].view(q1 - q0, g, r, d).to(cd)
        do = do_TGRD[q0:q1]
        lse_b = lse[q0:q1].permute(1, 2, 0)[..., None]
        delta_b = delta[q0:q1].permute(1, 2, 0)[..., None]
        for k0, k1 in keys:
            mask = _block_mask(meta, q0, q1, k0, k1)
            kb, vb = k_KGD[k0:k1].to(cd), v_KGD[k0:k1].to(cd)
            s = torch.einsum("qgrd,kgd->grqk", q_QGRD, kb) * scale
            p = torch.exp(s - lse_b).masked_fill(~mask, 0.0)
            dv[k0:k1] += torch.einsum("grqk,qgrd->kgd", p, do)
            dp = torch.einsum("qgrd,kgd->grqk", do, vb)
            ds = p * (dp - delta_b) * scale
            dq[q0:q1] += torch.einsum("grqk,kgd->qgrd", ds, kb)
            dk[k0:k1] += torch.einsum("grqk,qgrd->kgd", ds, q_QGRD)
    return dq, dk, dv


class _TorchVarlen(torch.autograd.Function):
    """Blockwise exact attention; saves only the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, q_THD, k_KGD, v_KGD, meta: VarlenMeta, scale: float):  # type: ignore[override]
        out, lse = attention_forward(q_THD, k_KGD, v_KGD, meta, scale)
        out_THD = out.view(q_THD.shape).to(q_THD.dtype)
        ctx.save_for_backward(q_THD, k_KGD, v_KGD, out_THD, lse)
        ctx.meta, ctx.scale = meta, scale
        return out_THD

    @staticmethod
    def backward(ctx: Any, dout_THD):  # type: ignore[override]
        q_THD, k_KGD, v_KGD, out_THD, lse = ctx.saved_tensors
        t, h, d = q_THD.shape
        g = k_KGD.shape[1]
        r = h // g
        cd = lse.dtype
        do_all = dout_THD.reshape(t, g, r, d).to(cd)
        delta = (do_all * out_THD.view(t, g, r, d).to(cd)).sum(dim=-1)  # [T, G, R]
        dq, dk, dv = attention_backward(do_all, q_THD, k_KGD, v_KGD, lse, delta, ctx.meta, ctx.scale)
        return (
            dq.view(t, h, d).to(q_THD.dtype), dk.to(k_KGD.dtype), dv.to(v_KGD.dtype), None, None,
        )


def rows_in_window(q_doc: np.ndarray, q_pos: np.ndarray, k_doc: np.ndarray, k_pos: np.ndarray,
                   window: int) -> np.ndarray:
    """Query rows (doc, pos) that see at least one key (doc, p) with ``pos - window < p <=
    pos``; keys in any order, negative docs (padding) ignored. O((T + K) log K) numpy."""
    q_doc, q_pos = np.asarray(q_doc, np.int64), np.asarray(q_pos, np.int64)
    real = np.asarray(k_doc) >= 0
    k_doc, k_pos = np.asarray(k_doc, np.int64)[real], np.asarray(k_pos, np.int64)[real]
    if len(k_doc) == 0 or len(q_doc) == 0:
        return np.zeros(0, dtype=np.int64)
    stride = int(max(q_pos.max(), k_pos.max())) + 1
    key = np.sort(k_doc * stride + k_pos)
    hi = np.searchsorted(key, q_doc * stride + q_pos, side="right")
    lo = np.searchsorted(key, q_doc * stride + np.maximum(q_pos - window + 1, 0), side="left")
    return np.flatnonzero(hi > lo)
