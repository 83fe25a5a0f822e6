"""PyTorch's own FlashAttention as a segment kernel, and the runtime's kernel choice.

``AtenSegments`` runs the ``SegmentKernel`` contract (``paths/segment_kernels.py``) on
``torch.ops.aten._flash_attention_forward`` / ``_flash_attention_backward``, the varlen
FlashAttention-2 kernels every CUDA build of PyTorch ships (sm80 and newer, fp16/bf16,
head dim a multiple of 8 up to 256, int32 cu_seqlens), so the GPU path needs no package
beyond PyTorch:

- forward ``(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
  return_debug_mask, *, scale, ...) -> (output, softmax_logsumexp [H, T] float32,
  rng_state, unused, debug_attn_mask)``; causal alignment bottom-right, a query that sees
  no key gives out 0 and LSE +inf; a windowed call passes ``window_size_left = W - 1`` and
  ``window_size_right = 0`` (keywords of both ops);
- backward ``(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
  max_k, dropout_p, is_causal, rng_state, unused, *, scale, ...) -> (dq, dk, dv)`` takes
  ``out`` and ``logsumexp`` as plain inputs, so the merged output and LSE of all parts go
  in (the ring-attention identity) in one call. With dropout 0 the rng state is not read:
  like ``torch.nn.attention.varlen`` the adapter passes a zero ``uint64 [2]`` tensor and an
  empty one.
- GQA: the kernels take K/V with G heads dividing H (query head h uses KV head h // (H/G))
  and return dK/dV with G heads, summed over each group; nothing is expanded here.

Version differences are found by feature, never by version string: :func:`load_aten_ops`
checks that both ops exist and that their schemas take the arguments above in this order
(the backward's two rng tensors are ``rng_state, unused``, named ``philox_seed,
philox_offset`` in older builds; either is accepted), and :func:`flash_impl` reads
``torch.nn.attention.current_flash_attention_impl`` where it exists. PyTorch 2.11+ can
route these same ops to FlashAttention 3 or 4 process-wide
(``torch.nn.attention.activate_flash_attention_impl``, where the ``flash_attn_3`` /
``flash-attn-4`` package is installed): kernels ``aten-fa3`` / ``aten-fa4`` activate it.
Every (device, dtype, head dim, impl) is probed against the reference before first use
(``segment_kernels.probe``); a refusal gives None and one RuntimeWarning per process.

Kernel names (``ContextParallelAttention(kernel=...)``, RUNTIME_KERNELS), per call:

- ``auto`` (default): CUDA fp16/bf16 queries run PyTorch's FlashAttention; where it is
  refused, flash-attn if installed, else the PyTorch block kernel; other queries the
  PyTorch block kernel;
- ``aten``, ``aten-fa3``, ``aten-fa4``: PyTorch's FlashAttention (its default FA2, or FA3 /
  FA4 activated), the PyTorch block kernel where refused;
- ``flash``: the flash-attn package (opt-in: ``pip install flash-attn``); its private varlen
  API on the segments path, its public varlen function on the gathered path;
- ``torch``: the PyTorch block kernel (``kernels.py``; exact, any device and dtype).

Nothing here imports flash-attn unless ``flash`` is chosen, or ``auto`` falls back to it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from worker_runtime.kernels import flash_attn_available
from worker_runtime.paths.segment_kernels import (
    FlashApiError,
    SegmentKernel,
    SegmentMeta,
    flash_segments,
    flash_window,
    probe,
    segment_meta,
)

RUNTIME_KERNELS = ("auto", "aten", "aten-fa3", "aten-fa4", "flash", "torch")
"""Kernel names the runtime accepts (module docstring)."""
ATEN_IMPLS = {"aten": None, "aten-fa3": "FA3", "aten-fa4": "FA4"}
"""Kernel name -> the FlashAttention impl it activates (None: whatever the process has)."""

FORWARD_ARGS = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
                "dropout_p", "is_causal", "return_debug_mask")
BACKWARD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q",
                 "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
                 ("rng_state", "philox_seed"), ("unused", "philox_offset"))
"""The positional arguments of the aten ops, in order (a tuple: accepted names)."""


def schema_args(op: Any) -> tuple[list[str], list[str]]:
    """(positional names, keyword-only names) of a torch op's schema, or of a Python
    function's signature (a stand-in)."""
    schema = getattr(getattr(op, "default", op), "_schema", None)
    if schema is not None:
        args = schema.arguments
        return [a.name for a in args if not a.kwarg_only], [a.name for a in args if a.kwarg_only]
    import inspect

    params = inspect.signature(op).parameters.values()
    return ([p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD],
            [p.name for p in params if p.kind is p.KEYWORD_ONLY])


def check_schema(op: Any, expected: tuple[str | tuple[str, ...], ...], name: str) -> None:
    """Raise FlashApiError unless ``op`` takes ``expected`` positionally, in order, and
    ``scale`` as a keyword."""
    try:
        positional, keywords = schema_args(op)
    except (TypeError, ValueError) as exc:
        raise FlashApiError(f"{name}: no inspectable schema ({exc})") from exc
    want = [e if isinstance(e, tuple) else (e,) for e in expected]
    if len(positional) < len(want) or any(p not in w for p, w in zip(positional, want, strict=False)):
        raise FlashApiError(f"{name} takes {positional[: len(want)]}, expected "
                            f"{['|'.join(w) for w in want]}")
    if "scale" not in keywords:
        raise FlashApiError(f"{name} has no keyword 'scale' (keywords: {keywords})")


class AtenOps(NamedTuple):
    forward: Callable[..., Any]
    backward: Callable[..., Any]


def load_aten_ops() -> AtenOps:
    """PyTorch's ``_flash_attention_forward`` / ``_backward`` ops, checked (module docstring);
    raises FlashApiError where this PyTorch lacks them or they differ."""
    aten = torch.ops.aten
    if not (hasattr(aten, "_flash_attention_forward") and hasattr(aten, "_flash_attention_backward")):
        raise FlashApiError("torch.ops.aten has no _flash_attention_forward/_backward")
    ops = AtenOps(aten._flash_attention_forward, aten._flash_attention_backward)
    check_schema(ops.forward, FORWARD_ARGS, "aten._flash_attention_forward")
    check_schema(ops.backward, BACKWARD_ARGS, "aten._flash_attention_backward")
    return ops


def flash_impl() -> str:
    """The FlashAttention impl behind the aten ops in this process: ``FA2`` (PyTorch's own)
    unless ``torch.nn.attention.activate_flash_attention_impl`` swapped in another."""
    import torch.nn.attention as tna

    current = getattr(tna, "current_flash_attention_impl", None)
    return (current() if current is not None else None) or "FA2"


def activate_impl(impl: str) -> None:
    """Route the aten ops to ``impl`` (``FA3``, ``FA4``) process-wide; FlashApiError where
    this PyTorch cannot (no registry, impl not registered, its package missing)."""
    import torch.nn.attention as tna

    if flash_impl() == impl:
        return
    activate = getattr(tna, "activate_flash_attention_impl", None)
    listed = getattr(tna, "list_flash_attention_impls", None)
    if activate is None or listed is None:
        raise FlashApiError("torch.nn.attention has no activate_flash_attention_impl")
    if impl not in listed():
        raise FlashApiError(f"flash attention impl {impl} is not registered (have {listed()})")
    try:
        activate(impl)
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable"
        raise FlashApiError(f"activate_flash_attention_impl({impl!r}) failed: "
                            f"{type(exc).__name__}: {exc}") from exc


class AtenSegments:
    """PyTorch's FlashAttention ops as a segment kernel (module docstring). ``ops``: the
    (forward, backward) callables with the aten signatures (tests pass a stand-in)."""

    def __init__(self, ops: AtenOps, impl: str = "FA2", name: str = "aten") -> None:
        self.ops, self.impl, self.name = ops, impl, name
        self._rng: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def meta(self, cu_q: np.ndarray, cu_k: np.ndarray, causal: bool,
             device: torch.device, window: int | None = None) -> SegmentMeta:
        return segment_meta(cu_q, cu_k, causal, device, None, window)

    @staticmethod
    def _window(meta: SegmentMeta) -> dict[str, int]:
        """The ops' ``window_size_left/right`` keywords of a windowed call (none without)."""
        if meta.window is None:
            return {}
        left, right = flash_window(meta)
        return {"window_size_left": left, "window_size_right": right}

    def forward(self, q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor,
                meta: SegmentMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        result = self.ops.forward(q_THD, k_KGD, v_KGD, meta.cu_seqlens_q, meta.cu_seqlens_k,
                                  meta.max_seqlen_q, meta.max_seqlen_k, 0.0, meta.causal, False,
                                  scale=scale, **self._window(meta))
        return result[0], result[1]

    def backward(self, dout_THD: torch.Tensor, q_THD: torch.Tensor, k_KGD: torch.Tensor,
                 v_KGD: torch.Tensor, out_THD: torch.Tensor, lse_HT: torch.Tensor,
                 meta: SegmentMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dev = q_THD.device
        if dev not in self._rng:
            self._rng[dev] = (torch.zeros(2, dtype=torch.uint64, device=dev),
                              torch.empty(0, device=dev))
        rng, unused = self._rng[dev]
        dq, dk, dv = self.ops.backward(
            dout_THD.contiguous(), q_THD, k_KGD, v_KGD, out_THD.to(q_THD.dtype).contiguous(),
            lse_HT.to(torch.float32).contiguous(), meta.cu_seqlens_q, meta.cu_seqlens_k,
            meta.max_seqlen_q, meta.max_seqlen_k, 0.0, meta.causal, rng, unused, scale=scale,
            **self._window(meta))
        return dq, dk, dv


_ATEN: dict[tuple[str, torch.dtype, int, str], AtenSegments | None] = {}
_WARNED: list[str] = []


def aten_segments(device: torch.device, dtype: torch.dtype, head_dim: int,
                  kernel: str = "aten") -> AtenSegments | None:
    """The checked PyTorch FlashAttention segment kernel for ``device``, ``dtype``, ``head_dim``
    under kernel name ``kernel`` (ATEN_IMPLS: activates FA3 / FA4), or None with one
    RuntimeWarning per process where the ops are missing, differ, cannot be activated or
    fail the probe, or the head dim is not a multiple of 8 up to 256. Cached per (device,
    dtype, head dim, impl)."""
    want = ATEN_IMPLS[kernel]
    problem = None
    try:
        if want is not None:
            activate_impl(want)
    except FlashApiError as exc:
        problem = exc
    impl = want or flash_impl()
    key = (str(device), dtype, int(head_dim), impl)
    if key not in _ATEN or problem is not None:
        found: AtenSegments | None = None
        try:
            if problem is not None:
                raise problem
            if head_dim % 8 or head_dim > 256:
                raise FlashApiError(f"head_dim {head_dim} is not a multiple of 8 up to 256")
            found = AtenSegments(load_aten_ops(), impl=impl, name=kernel)
            probe(found, device, dtype, head_dim)
        except FlashApiError as exc:
            found = None
            if not _WARNED:
                _WARNED.append(str(exc))
                warnings.warn(f"kernel {kernel}: PyTorch's FlashAttention ({impl}) cannot be used "
                              f"for {device} {dtype} head_dim {head_dim} ({exc}); falling back",
                              RuntimeWarning, stacklevel=2)
        _ATEN[key] = found
    return _ATEN[key]


class KernelChoice(NamedTuple):
    """What runs a call's attention (``choose_kernel``)."""

    segment_kernel: SegmentKernel | None
    """Runs the segments path, the segment ring or the gathered path."""
    flash_gathered: bool
    """Without a segment kernel: flash-attn's public varlen function on the gathered path
    (else the PyTorch block kernel's lean path or ring)."""


def choose_kernel(kernel: str, q: torch.Tensor, flash_path: str) -> KernelChoice:
    """The kernel a call with queries like ``q`` runs under kernel name ``kernel`` (module
    docstring). ``flash_path="gathered"`` skips flash-attn's private API (its public
    varlen function runs). ValueError for an unknown name."""
    if kernel not in RUNTIME_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(RUNTIME_KERNELS)}, got {kernel!r}")
    if kernel == "torch" or q.dim() != 3:
        return KernelChoice(None, False)
    half = q.dtype in (torch.float16, torch.bfloat16)
    if kernel in ATEN_IMPLS or (kernel == "auto" and half and q.device.type == "cuda"):
        found = aten_segments(q.device, q.dtype, q.shape[-1], "aten" if kernel == "auto" else kernel)
        if found is not None or kernel != "auto":
            return KernelChoice(found, False)
    if kernel == "flash" or (kernel == "auto" and half and flash_attn_available(q.device)):
        found_flash = flash_segments(q.device, q.dtype, q.shape[-1]) if flash_path == "segments" else None
        return KernelChoice(found_flash, True)
    return KernelChoice(None, False)


def kernel_record(path: str, found: SegmentKernel | None, flash_gathered: bool) -> dict[str, str]:
    """What ran: ``path``, kernel name, FlashAttention impl, torch version (the runtime's
    kernel record, ``ContextParallelAttention.kernel_record``)."""
    if found is not None:
        name, impl = found.name, getattr(found, "impl", found.name)
    elif flash_gathered:
        name, impl = "flash", "flash_attn_varlen_func"
    else:
        name, impl = "torch", "block"
    return {"path": path, "kernel": name, "impl": impl, "torch": torch.__version__}
