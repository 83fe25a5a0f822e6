"""Segment kernels: one varlen attention call that returns its log-sum-exp, and that call's
backward given the output and log-sum-exp of the whole attention (all parts merged).

The segments path (``segments.py``) and the segment ring split a rank's attention into several such calls
and merges them by log-sum-exp; these are the two kernels it can run:

- ``ReferenceSegments``: exact PyTorch (``kernels.attention_forward`` /
  ``attention_backward`` on ``build_masked_meta``), any device and dtype, float64-exact;
  the CPU tests run the flash path with it;
- ``aten_flash.AtenSegments``: PyTorch's own FlashAttention ops
  (``torch.ops.aten._flash_attention_forward`` / ``_backward``), the default CUDA kernel;
- ``FlashSegments``: flash-attn's ``_flash_attn_varlen_forward`` /
  ``_flash_attn_varlen_backward`` (flash-attn 2.8: CUDA, fp16/bf16). These are private
  functions of ``flash_attn.flash_attn_interface``; :func:`flash_segments` checks their
  parameters and runs a tiny probe against the reference before use, and returns None (one
  warning per process) where they are missing or differ, so the runtime falls back to the
  gathered path (opt-in: kernel ``flash``).

``SegmentVarlen`` runs one call of any of them under autograd (the gathered path).

Contract (shape legend as ``kernels.py``: T query rows, K key rows, H heads, G KV heads):

- ``forward(q_THD, k_KGD, v_KGD, meta, scale) -> (out [T, H, D], lse [H, T])``: segment b
  pairs queries ``cu_q[b]:cu_q[b+1]`` with keys ``cu_k[b]:cu_k[b+1]``; ``causal``: query t
  of a segment of Lq queries and Lk keys sees keys ``[0, Lk - Lq + t]`` (bottom-right),
  else every key of its segment; ``window`` (optional, a causal call only; None: causal):
  query t sees keys ``[Lk - Lq + t - window + 1, Lk - Lq + t]`` (flash-attn's
  ``window_size = (window - 1, 0)``). ``out`` in the kernel's dtype (flash: q's; reference: the
  compute dtype), ``lse`` float32 (flash) or the compute dtype, natural log, flash's
  varlen layout ``[H, T]``.
- ``backward(dout, q, k, v, out, lse, meta, scale) -> (dq, dk, dv)``: ``out`` and ``lse``
  are the merged ones, so the gradients of the parts add up (the ring-attention identity).
- A query that sees no key (an empty key segment, a *hollow* segment) has undefined out,
  lse and dq (flash: 0, +inf; reference: NaN, -inf): the caller masks them. A segment
  with keys and no queries (a *zero-query* segment) gives its keys dK = dV = 0.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from worker_runtime.kernels import (
    VarlenMeta,
    attention_backward,
    attention_forward,
    build_masked_meta,
    check_window,
)
from worker_runtime.layout import expand_ranges


class SegmentMeta(NamedTuple):
    """One call's segments on one device."""

    cu_seqlens_q: torch.Tensor
    """int32 ``[S + 1]``."""
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    masked: VarlenMeta | None
    """The reference kernel's per-row mask data (None for flash-attn)."""
    window: int | None = None
    """Sliding window of a causal call (None: causal)."""


class SegmentKernel(Protocol):
    """What the flash path needs from a kernel (module docstring)."""

    name: str

    def meta(self, cu_q: np.ndarray, cu_k: np.ndarray, causal: bool,
             device: torch.device, window: int | None = None) -> SegmentMeta: ...

    def forward(self, q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor,
                meta: SegmentMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout_THD: torch.Tensor, q_THD: torch.Tensor, k_KGD: torch.Tensor,
                 v_KGD: torch.Tensor, out_THD: torch.Tensor, lse_HT: torch.Tensor,
                 meta: SegmentMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def segment_meta(cu_q: np.ndarray, cu_k: np.ndarray, causal: bool, device: torch.device,
                  masked: VarlenMeta | None, window: int | None = None) -> SegmentMeta:
    """A call's segments on ``device``; ValueError for bad boundaries, a window below 1 or
    a window on a full (non-causal) call."""
    window = check_window(window)
    if window is not None and not causal:
        raise ValueError("window applies to a causal segment call only (causal=True)")
    cu_q, cu_k = np.asarray(cu_q, np.int64), np.asarray(cu_k, np.int64)
    if len(cu_q) != len(cu_k) or len(cu_q) < 2 or (np.diff(cu_q) < 0).any() or (np.diff(cu_k) < 0).any():
        raise ValueError("cu_seqlens_q/k must be non-decreasing, of equal length >= 2")

    def tensor(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(x.astype(np.int32)).to(device)

    return SegmentMeta(tensor(cu_q), tensor(cu_k), int(np.diff(cu_q).max()),
                       int(np.diff(cu_k).max()), causal, masked, window)


def flash_window(meta: SegmentMeta) -> tuple[int, int]:
    """FlashAttention's ``(window_size_left, window_size_right)`` of a call: ``(-1, -1)``
    without a window, ``(window - 1, 0)`` with one."""
    return (-1, -1) if meta.window is None else (meta.window - 1, 0)


class ReferenceSegments:
    """Exact PyTorch segment kernel (module docstring); no flash-attn needed."""

    name = "reference"

    def meta(self, cu_q: np.ndarray, cu_k: np.ndarray, causal: bool,
             device: torch.device, window: int | None = None) -> SegmentMeta:
        """O(T + K) numpy: a causal query sits at key position ``Lk - Lq + t`` of its
        segment, a full one at ``Lk - 1`` (sees the whole segment)."""
        window = check_window(window)
        if window is not None and not causal:
            raise ValueError("window applies to a causal segment call only (causal=True)")
        lq: np.ndarray = np.diff(np.asarray(cu_q, np.int64))
        lk: np.ndarray = np.diff(np.asarray(cu_k, np.int64))
        segs = np.arange(len(lq), dtype=np.int64)
        if causal:
            q_pos = expand_ranges(lk - lq, lq)
        else:
            q_pos = np.repeat(lk - 1, lq)
        masked = build_masked_meta(np.repeat(segs, lq), q_pos, np.repeat(segs, lk),
                                   expand_ranges(np.zeros(len(lk), np.int64), lk), device,
                                   window=window)
        return segment_meta(cu_q, cu_k, causal, device, masked, window)

    def positional_meta(self, cu_q: np.ndarray, cu_k: np.ndarray, q_pos: np.ndarray,
                        k_pos: np.ndarray, causal: bool, device: torch.device,
                        window: int) -> SegmentMeta:
        """A call whose segment b's queries, at document positions ``q_pos``, see its keys
        at positions ``k_pos`` in ``(pos - window, pos]`` (causal or full alike: a full
        call's keys lie below its queries); positions ascend within each segment. Runs
        the segments path's and segment ring's piece calls under a window
        (``paths/window_pieces.py``). O(T + K) numpy."""
        checked = check_window(window)
        assert checked is not None
        window = checked
        lq: np.ndarray = np.diff(np.asarray(cu_q, np.int64))
        lk: np.ndarray = np.diff(np.asarray(cu_k, np.int64))
        segs = np.arange(len(lq), dtype=np.int64)
        masked = build_masked_meta(np.repeat(segs, lq), q_pos, np.repeat(segs, lk), k_pos,
                                   device, window=window)
        return segment_meta(cu_q, cu_k, True, device, masked, window)._replace(causal=causal)

    def forward(self, q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor,
                meta: SegmentMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        assert meta.masked is not None
        t, h, d = q_THD.shape
        out, lse = attention_forward(q_THD, k_KGD, v_KGD, meta.masked, scale)
        return out.view(t, h, d), lse.view(t, h).t().contiguous()

    def backward(self, dout_THD: torch.Tensor, q_THD: torch.Tensor, k_KGD: torch.Tensor,
                 v_KGD: torch.Tensor, out_THD: torch.Tensor, lse_HT: torch.Tensor,
                 meta: SegmentMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert meta.masked is not None
        t, h, d = q_THD.shape
        g = k_KGD.shape[1]
        cd = lse_HT.dtype
        do = dout_THD.reshape(t, g, h // g, d).to(cd)
        delta = (do * out_THD.reshape(t, g, h // g, d).to(cd)).sum(dim=-1)
        lse = lse_HT.t().reshape(t, g, h // g)
        dq, dk, dv = attention_backward(do, q_THD, k_KGD, v_KGD, lse, delta, meta.masked, scale)
        return dq.view(t, h, d), dk, dv


FORWARD_PARAMS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                  "dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right",
                  "softcap", "alibi_slopes", "return_softmax")
BACKWARD_PARAMS = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q",
                   "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale",
                   "causal", "window_size_left", "window_size_right", "softcap", "alibi_slopes",
                   "deterministic", "rng_state")
"""The keyword arguments passed to flash-attn's private varlen functions (flash-attn 2.8.3:
forward returns ``(out, softmax_lse [H, total_q] float32, S_dmask, rng_state)``; backward
writes dq, dk, dv in place)."""


class FlashApiError(RuntimeError):
    """flash-attn's private varlen API is missing or not the one this adapter was written for."""


def check_params(fn: Any, expected: tuple[str, ...], name: str) -> None:
    """Raise FlashApiError unless ``fn`` (a function or torch custom op) takes ``expected``
    as keyword arguments."""
    target = getattr(fn, "_init_fn", fn)
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError) as exc:
        raise FlashApiError(f"{name}: no inspectable signature ({exc})") from exc
    missing = [p for p in expected if p not in params]
    if missing:
        raise FlashApiError(f"{name} lacks parameters {missing}")


def load_flash_api() -> tuple[Any, Any]:
    """flash-attn's ``(_flash_attn_varlen_forward, _flash_attn_varlen_backward)``, checked.

    Raises FlashApiError when flash-attn is missing or its functions differ."""
    try:
        from flash_attn import flash_attn_interface as fai
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        raise FlashApiError(f"flash_attn.flash_attn_interface not importable ({exc})") from exc
    fwd = getattr(fai, "_flash_attn_varlen_forward", None)
    bwd = getattr(fai, "_flash_attn_varlen_backward", None)
    if fwd is None or bwd is None:
        raise FlashApiError("flash_attn.flash_attn_interface has no _flash_attn_varlen_forward/_backward")
    check_params(fwd, FORWARD_PARAMS, "_flash_attn_varlen_forward")
    check_params(bwd, BACKWARD_PARAMS, "_flash_attn_varlen_backward")
    return fwd, bwd


class FlashSegments:
    """flash-attn's varlen forward/backward as a segment kernel (module docstring)."""

    name = "flash"

    def __init__(self, forward_fn: Any, backward_fn: Any) -> None:
        self.forward_fn, self.backward_fn = forward_fn, backward_fn

    def meta(self, cu_q: np.ndarray, cu_k: np.ndarray, causal: bool,
             device: torch.device, window: int | None = None) -> SegmentMeta:
        return segment_meta(cu_q, cu_k, causal, device, None, window)

    def forward(self, q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor,
                meta: SegmentMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        result = self.forward_fn(
            q=q_THD, k=k_KGD, v=v_KGD, cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k, dropout_p=0.0, softmax_scale=scale,
            causal=meta.causal, window_size_left=flash_window(meta)[0],
            window_size_right=flash_window(meta)[1], softcap=0.0, alibi_slopes=None,
            return_softmax=False)
        return result[0], result[1]

    def backward(self, dout_THD: torch.Tensor, q_THD: torch.Tensor, k_KGD: torch.Tensor,
                 v_KGD: torch.Tensor, out_THD: torch.Tensor, lse_HT: torch.Tensor,
                 meta: SegmentMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = torch.empty_like(q_THD), torch.empty_like(k_KGD), torch.empty_like(v_KGD)
        self.backward_fn(
            dout=dout_THD.contiguous(), q=q_THD, k=k_KGD, v=v_KGD, out=out_THD,
            softmax_lse=lse_HT.contiguous(), dq=dq, dk=dk, dv=dv,
            cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, dropout_p=0.0,
            softmax_scale=scale, causal=meta.causal, window_size_left=flash_window(meta)[0],
            window_size_right=flash_window(meta)[1], softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None)
        return dq, dk, dv


class SegmentVarlen(torch.autograd.Function):
    """One differentiable call of a segment kernel, ``out [T, H, D]`` in q's dtype: the
    gathered path on a segment kernel (every query sees a key there)."""

    @staticmethod
    def forward(ctx: Any, q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor,  # type: ignore[override]
                kernel: SegmentKernel, meta: SegmentMeta, scale: float) -> torch.Tensor:
        out, lse = kernel.forward(q_THD, k_KGD, v_KGD, meta, scale)
        out = out.to(q_THD.dtype)
        ctx.save_for_backward(q_THD, k_KGD, v_KGD, out, lse)
        ctx.kernel, ctx.meta, ctx.scale = kernel, meta, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(dout.contiguous(), q, k, v, out, lse, ctx.meta, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


PROBE_TOL = 5e-2
"""Probe tolerance against the float32 reference on the same half-precision inputs,
relative to the reference's largest magnitude (at least 1)."""


PROBE_CALLS = (
    (np.array([0, 3, 5]), np.array([0, 4, 9]), True, None),
    (np.array([0, 3, 5]), np.array([0, 4, 9]), False, None),
    (np.array([0, 2, 2, 5, 6]), np.array([0, 3, 7, 7, 9]), False, None),
    (np.array([0, 3, 5]), np.array([0, 4, 9]), True, 2),
)
"""(cu_q, cu_k, causal, window) of the probe's calls: a causal and a full call, then a full
call with a zero-query segment (keys 3..6) and a hollow segment (queries 2..4, no keys),
as the segment ring runs them, then a causal call under a window of 2 (a sliding-window
layer's gathered call)."""


def probe(kernel: SegmentKernel, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Run ``kernel`` on tiny GQA problems (PROBE_CALLS, forward and backward) against the
    reference in float32; raise FlashApiError on any difference in shapes, dtypes or
    values beyond PROBE_TOL. Rows of hollow segments are compared nowhere (the caller masks
    them; backward gets a finite merged out/lse there, as after a merge), the dK/dV of a
    zero-query segment's keys must be 0."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    scale = head_dim**-0.5
    ref = ReferenceSegments()
    for cu_q, cu_k, causal, window in PROBE_CALLS:
        nq, nk = int(cu_q[-1]), int(cu_k[-1])
        seen = torch.from_numpy(np.repeat(np.diff(cu_k) > 0, np.diff(cu_q))).to(device)
        q, k, v, do = (torch.randn(n, h, head_dim, generator=gen).to(device=device, dtype=dtype)
                       for n, h in ((nq, 2), (nk, 1), (nk, 1), (nq, 2)))
        where = f"causal={causal}, cu_q={cu_q.tolist()}, cu_k={cu_k.tolist()}, window={window}"
        try:
            if window is None:
                meta, ref_meta = kernel.meta(cu_q, cu_k, causal, device), ref.meta(cu_q, cu_k, causal, device)
            else:
                meta = kernel.meta(cu_q, cu_k, causal, device, window=window)
                ref_meta = ref.meta(cu_q, cu_k, causal, device, window=window)
            out, lse = kernel.forward(q, k, v, meta, scale)
            want_out, want_lse = ref.forward(q.float(), k.float(), v.float(), ref_meta, scale)
            if out.shape != q.shape or lse.shape != (2, nq) or lse.dtype != torch.float32:
                raise FlashApiError(f"forward returned out {tuple(out.shape)}, lse "
                                    f"{tuple(lse.shape)} {lse.dtype}; expected {tuple(q.shape)}, "
                                    f"(2, {nq}) float32 ({where})")
            # A merged out/lse is finite on every row: stand in the reference's on rows
            # with keys, zeros on hollow rows.
            merged_out = torch.where(seen[:, None, None], want_out, 0.0)
            merged_lse = torch.where(seen[None, :], want_lse, 0.0)
            grads = kernel.backward(do, q, k, v, merged_out.to(dtype), merged_lse, meta, scale)
            want = ref.backward(do.float(), q.float(), k.float(), v.float(), merged_out,
                                merged_lse, ref_meta, scale)
        except FlashApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the private API disables it
            raise FlashApiError(f"probe call failed ({where}): {type(exc).__name__}: {exc}") from exc
        pairs = [("out", out[seen], want_out[seen]), ("lse", lse[:, seen], want_lse[:, seen]),
                 ("dq", grads[0][seen], want[0][seen])]
        pairs += list(zip(("dk", "dv"), grads[1:], want[1:], strict=True))
        for name, got, exp in pairs:
            err = (got.float() - exp.float()).abs().max().item() if exp.numel() else 0.0
            scale_ref = max(1.0, exp.abs().max().item() if exp.numel() else 0.0)
            if not err <= PROBE_TOL * scale_ref:
                raise FlashApiError(f"probe: {name} differs from the reference by {err:.3g} ({where})")


_FLASH: dict[tuple[str, torch.dtype, int], FlashSegments | None] = {}
_WARNED: list[str] = []


def flash_segments(device: torch.device, dtype: torch.dtype, head_dim: int) -> FlashSegments | None:
    """The checked flash-attn segment kernel for ``device``, ``dtype`` and ``head_dim``, or
    None (with one RuntimeWarning per process) when the private API is missing, differs,
    or fails the probe, or the head dim is not a multiple of 8 up to 256 (flash-attn's
    own limits without padding). Cached per (device, dtype, head_dim)."""
    key = (str(device), dtype, int(head_dim))
    if key not in _FLASH:
        kernel: FlashSegments | None = None
        try:
            if head_dim % 8 or head_dim > 256:
                raise FlashApiError(f"head_dim {head_dim} is not a multiple of 8 up to 256")
            kernel = FlashSegments(*load_flash_api())
            probe(kernel, device, dtype, head_dim)
        except FlashApiError as exc:
            kernel = None
            if not _WARNED:
                _WARNED.append(str(exc))
                warnings.warn(f"flash path: flash-attn's varlen forward/backward cannot be used "
                              f"({exc}); falling back to the gathered path", RuntimeWarning,
                              stacklevel=2)
        _FLASH[key] = kernel
    return _FLASH[key]
