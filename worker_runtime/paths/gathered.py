"""The gathered path (``ExecutionPath.GATHERED``): exchange (blocking), gather every shard's
keys, one varlen kernel call.

Forward: the stacked K/V exchange (``comm.KVExchange``: differentiable, its backward sends
dK/dV back), then per own shard ``[s, e)`` of doc d its keys ``[0, e)`` of d gathered from
the local and received rows (``CommMap.kv_index``) into contiguous ``[keys, G, D]`` K and V
(the layout flash-attn's varlen format wants), then one causal varlen call: the segment
kernel's (``segment_kernels.SegmentVarlen``), or flash-attn's public varlen function
(``kernels.varlen_attention`` with kernel ``flash``) where no segment kernel runs. A
``p2p_ring`` plan runs its bytes as ``full`` here.

A sliding-window layer (``windows.py``) runs this path's one causal windowed call, on the
window's halo map for ``alltoallv`` and ``compact_allgather`` (each shard reading its
window span ``[max(0, s - W + 1), e)``, ``window_map.window_gather``), for a ``p2p_ring``
plan on the blocks of the ring's steps 1 .. ``steps_run`` (the ring's bytes,
``window_map.build_ring_window_map``), else on the causal map; the segments path and the
segment ring run it too under a window on flash kernels.

With a sink (``sinks.py``) the one call runs as a segment kernel call that returns its
log-sum-exp (``GatheredSinkAttention``): the segment kernel, or without one flash-attn's
varlen forward/backward (``segment_kernels.flash_segments``) on the flash kernel and the
exact reference elsewhere.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from worker_runtime.comm import Exchanger, KVExchange
from worker_runtime.kernels import VarlenMeta, build_meta, uses_flash, varlen_attention
from worker_runtime.layout import RankLayout
from worker_runtime.paths.base import PathContext, PlannedCall, PlannedTransfer
from worker_runtime.paths.segment_kernels import (
    ReferenceSegments,
    SegmentKernel,
    SegmentMeta,
    SegmentVarlen,
    flash_segments,
)
from worker_runtime.sinks import merge_sink_, row_delta, sink_grad
from worker_runtime.window_map import window_gather
from worker_runtime.windows import HALO_MODES, window_exchanger

VARLEN_KERNEL = "flash"
"""``kernels.varlen_attention``'s kernel for the call without a segment kernel."""


class GatheredState(NamedTuple):
    """One rank's gathered call on one device (built once per kernel and window)."""

    layout: RankLayout
    exchanger: Exchanger
    kv_index: torch.Tensor
    """Rows of the exchange's output that form the gathered keys (shard order)."""
    cu_seqlens_k: np.ndarray
    kernel: SegmentKernel | None
    meta: SegmentMeta | VarlenMeta | None
    """The call's metadata: the segment kernel's, or ``kernels.build_meta``'s (None for a
    rank without queries: it makes no call)."""
    window: int | None
    sink_metas: dict[str, tuple[SegmentKernel, SegmentMeta]]
    """Without a segment kernel: the sink call's kernel and metadata, per kernel name."""


def build(ctx: PathContext) -> GatheredState:
    """The causal comm map's gather (``kv_index``), or a window's on its halo map."""
    lay, device = ctx.layout, ctx.device
    exchanger, cu_k = ctx.exchanger, lay.cu_seqlens_k
    if ctx.window is not None and (ctx.gather_mode in HALO_MODES or ctx.ring):
        exchanger = window_exchanger(ctx)
        found = window_gather(lay, exchanger.comm, ctx.window)
        kv_index, cu_k = torch.from_numpy(found.kv_index).to(device), found.cu_seqlens_k
    else:
        kv_index = torch.from_numpy(ctx.comm_map.kv_index).to(device)
    assert exchanger is not None, "the gathered path runs over an exchange"
    meta: SegmentMeta | VarlenMeta | None = None  # a rank without queries makes no call
    if lay.num_real and ctx.kernel is not None:
        meta = ctx.kernel.meta(lay.cu_seqlens_q, cu_k, True, device, window=ctx.window)
    elif lay.num_real:
        meta = build_meta(lay.cu_seqlens_q, cu_k, device, window=ctx.window)
    return GatheredState(lay, exchanger, kv_index, cu_k, ctx.kernel, meta, ctx.window, {})


def sink_kernel(state: GatheredState, q: torch.Tensor) -> tuple[SegmentKernel, SegmentMeta]:
    """The segment kernel and metadata of the call with a sink (module docstring). Raises
    ValueError where the flash kernel runs but its varlen API cannot be used."""
    if state.kernel is not None:
        assert isinstance(state.meta, SegmentMeta)
        return state.kernel, state.meta
    flash = uses_flash(q, "auto")
    kern: SegmentKernel | None = flash_segments(q.device, q.dtype, q.shape[-1]) if flash else ReferenceSegments()
    if kern is None:
        raise ValueError("attention sinks on the flash kernel need flash-attn's varlen forward/backward "
                         "with log-sum-exp (segment_kernels.flash_segments), which cannot be used here: "
                         "pass kernel='torch' or drop the sink")
    if kern.name not in state.sink_metas:
        lay = state.layout
        state.sink_metas[kern.name] = (kern, kern.meta(lay.cu_seqlens_q, state.cu_seqlens_k, True,
                                                       q.device, window=state.window))
    return state.sink_metas[kern.name]


def run(state: GatheredState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        overlap: bool, sink: torch.Tensor | None) -> torch.Tensor:
    """The gathered call (blocking: ``overlap`` changes nothing here)."""
    lay = state.layout
    kv = torch.stack((k, v), dim=1)
    source = KVExchange.apply(kv, state.exchanger)
    r = lay.num_real
    if r == 0:
        # No queries here, but peers may still send dK/dV back in backward: keep the
        # exchange in the graph so this rank joins that collective.
        return q * 0 + (source.sum() + (sink.sum() if sink is not None else 0)) * 0
    # Gathering K and V apart gives the contiguous [keys, G, D] tensors flash-attn wants.
    k_seq = source[:, 0].index_select(0, state.kv_index)
    v_seq = source[:, 1].index_select(0, state.kv_index)
    if sink is not None:
        kern, meta = sink_kernel(state, q)
        out = GatheredSinkAttention.apply(q[:r], k_seq, v_seq, sink, kern, meta, scale)
    elif state.kernel is not None:
        assert isinstance(state.meta, SegmentMeta)
        out = SegmentVarlen.apply(q[:r], k_seq, v_seq, state.kernel, state.meta, scale)
    else:
        assert isinstance(state.meta, VarlenMeta)
        out = varlen_attention(q[:r], k_seq, v_seq, state.meta, scale, VARLEN_KERNEL)
    return torch.cat((out, q.new_zeros((lay.num_tokens - r, *q.shape[1:]))))


class GatheredSinkAttention(torch.autograd.Function):
    """The gathered path with a sink: one causal varlen call of ``kernel`` (queries
    ``q [T, H, D]`` against each shard's gathered keys), the sink merged into its output
    and log-sum-exp, backward from the merged ones. Differentiable in q, k, v and sink."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                sink: torch.Tensor, kernel: SegmentKernel, meta: SegmentMeta,
                scale: float) -> torch.Tensor:
        out, lse = kernel.forward(q, k, v, meta, scale)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out, lse = out.to(acc), lse.to(acc)
        merge_sink_(out, lse.t(), sink)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, sink)
        ctx.kernel, ctx.meta, ctx.scale = kernel, meta, scale
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # type: ignore[override]
        q, k, v, result, lse, sink = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ctx.kernel.backward(dout, q, k, v, result, lse, ctx.meta, ctx.scale)
        d_sink = sink_grad(lse.t(), row_delta(dout, result, lse.dtype), sink)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_sink, None, None, None


def planned_calls(state: GatheredState) -> tuple[PlannedCall, ...]:
    """The one call: every real query against the gathered keys."""
    r = state.layout.num_real
    if r == 0:
        return ()
    kind = "segment" if state.kernel is not None else "varlen"
    return (PlannedCall(kind, state.meta, "gathered", 0, r, 0, len(state.kv_index)),)


def buffers(state: GatheredState) -> dict[str, int]:
    return {"queries": state.layout.num_real, "gathered": len(state.kv_index)}


def planned_transfers(state: GatheredState) -> tuple[PlannedTransfer, ...]:
    """The stacked K/V exchange forward and its dK/dV backward, blocking."""
    return (PlannedTransfer("stacked", state.exchanger.comm.recv_rows, 1),)
