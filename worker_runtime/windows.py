"""Sliding-window layers on every path: ``ContextParallelAttention.attention(..., window=W)``.

A layer of window W lets the query at document position p attend keys
``[max(0, p - W + 1), p]`` (transformers' ``sliding_window_overlay``: ``kv_idx > q_idx -
sliding_window``; flash-attn's ``window_size = (W - 1, 0)``). One plan serves every layer
(token placement is shared); what differs per window is kept here, built on the first call
of each window and cached by W on the runtime's per-device state:

- the exchange (``window_map.py``): ``alltoallv`` moves only the halo, the keys
  ``[max(0, s - W + 1), s)`` before each own shard ``[s, e)`` held by a peer
  (``planner_service.core.halo_map``'s transfers); ``compact_allgather`` each shard's
  suffix that a later run of its doc on another rank reaches; ``full`` the causal comm
  map (every local buffer moves whatever the window);
- the lean path (torch kernel, gather modes): its two parts on windowed masks, the remote
  part's queries being those with a remote key in their window;
- the ring (torch kernel, ``p2p_ring``): windowed masks per step; the ring stops after
  the group's last useful step (``window_map.ring_steps``: no later transfer or kernel),
  a rank runs no kernel on a step whose block holds no key inside its windows, and
  backward sends the last dK/dV accumulator straight to its owner;
- the gathered form (a segment kernel's or flash-attn's one causal windowed varlen call):
  the gathered path, and the segments path and segment ring under a window (their full
  calls on remote gaps have per-document alignments one flash call cannot window; the
  gathered call can). On the halo maps each shard reads its window span ``[max(0, s - W +
  1), e)`` (``window_map.window_gather``); on ``full`` (a ring plan's bytes) its keys
  ``[0, e)`` from the causal map.

``window=None`` never reaches this module: the causal paths run unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from worker_runtime.comm import Exchanger, KVExchange
from worker_runtime.kernels import build_meta, uses_flash, varlen_attention
from worker_runtime.layout import CommMap
from worker_runtime.overlap import LeanAttention, build_state
from worker_runtime.ring import RingAttention, build_ring_state
from worker_runtime.segkernels import (
    ReferenceSegments,
    SegmentKernel,
    SegmentVarlen,
    flash_segments,
)
from worker_runtime.sinks import GatheredSinkAttention
from worker_runtime.window_map import build_window_comm_map, window_gather


def run_windowed(rt: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Any,
                 path: str, segment_kernel: SegmentKernel | None, scale: float,
                 sink: torch.Tensor | None, window: int) -> torch.Tensor:
    """The windowed call of ``rt`` (a ContextParallelAttention) on ``path`` (module
    docstring); ``state`` is its per-device state."""
    lay = rt.layout
    if path == "lean":
        ex = window_exchanger(rt, state, window, q.device)
        lean = rt._path_state(state, "lean", None, lambda: build_state(lay, ex, q.device, window), window)
        return LeanAttention.apply(q, k, v, lean, scale, rt.overlap, sink)
    if path == "ring":
        ring = rt._path_state(state, "ring", None, lambda: build_ring_state(
            lay, rt.process_group, rt.order, rt.counter, q.device, window), window)
        return RingAttention.apply(q, k, v, ring, scale, rt.overlap, sink)
    return _gathered(rt, q, k, v, state, segment_kernel, scale, sink, window)


def window_exchanger(rt: Any, state: Any, window: int, device: torch.device) -> Exchanger:
    """The exchange of a ``window`` layer on the lean path: the halo map of ``alltoallv``
    or ``compact_allgather`` (``window_map.py``), the causal one for ``full``."""
    if rt.gather_mode not in ("alltoallv", "compact_allgather"):
        return state.exchanger

    def build() -> Exchanger:
        comm = build_window_comm_map(rt.layout, rt.gather_mode, window, rt.order)
        position = dist.get_rank(rt.process_group) if rt.process_group is not None else 0
        return Exchanger.create(comm, rt.process_group, position, rt.counter, device)

    return rt._path_state(state, "exchange", None, build, window)  # type: ignore[no-any-return]


def window_comm_map(rt: Any, window: int) -> CommMap:
    """The comm map a ``window`` call of ``rt`` exchanges on the lean path."""
    if rt.gather_mode not in ("alltoallv", "compact_allgather"):
        return rt.comm_map  # type: ignore[no-any-return]
    return build_window_comm_map(rt.layout, rt.gather_mode, window, rt.order)


def _gathered(rt: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Any,
              segment_kernel: SegmentKernel | None, scale: float, sink: torch.Tensor | None,
              window: int) -> torch.Tensor:
    """One causal windowed varlen call on every shard's gathered keys: ``[max(0, s - W +
    1), e)`` on the window's halo map (``alltoallv``, ``compact_allgather``), else ``[0,
    e)`` on the causal map."""
    lay = rt.layout
    halo = rt.gather_mode in ("alltoallv", "compact_allgather")
    exchanger, kv_index, cu_k = state.exchanger, state.kv_index, lay.cu_seqlens_k
    if halo:
        exchanger = window_exchanger(rt, state, window, q.device)
        found_gather = rt._path_state(state, "gather_index", None, lambda: _gather_index(
            rt, exchanger, window, q.device), window)
        kv_index, cu_k = found_gather
    kv = torch.stack((k, v), dim=1)
    source = KVExchange.apply(kv, exchanger)
    k_seq = source[:, 0].index_select(0, kv_index)
    v_seq = source[:, 1].index_select(0, kv_index)
    r = lay.num_real
    if r == 0:
        # No queries here, but peers may still send dK/dV back in backward: keep the
        # exchange in the graph so this rank joins that collective.
        tied = (source.sum() + (sink.sum() if sink is not None else 0)) * 0
        return q * 0 + tied
    with_sink = sink is not None
    kern = segment_kernel
    if kern is None and with_sink:
        flash = uses_flash(q, "auto")
        kern = flash_segments(q.device, q.dtype, q.shape[-1]) if flash else ReferenceSegments()
        if kern is None:
            raise ValueError("attention sinks on the flash kernel need flash-attn's varlen forward/backward "
                             "with log-sum-exp (segkernels.flash_segments), which cannot be used here: "
                             "pass kernel='torch' or drop the sink")
    if kern is not None:
        found = kern
        meta = rt._path_state(state, "gathered", found, lambda: found.meta(
            lay.cu_seqlens_q, cu_k, True, q.device, window=window), window)
        if with_sink:
            out = GatheredSinkAttention.apply(q[:r], k_seq, v_seq, sink, found, meta, scale)
        else:
            out = SegmentVarlen.apply(q[:r], k_seq, v_seq, found, meta, scale)
    else:
        vmeta = rt._path_state(state, "gathered", None, lambda: build_meta(
            lay.cu_seqlens_q, cu_k, q.device, window=window), window)
        out = varlen_attention(q[:r], k_seq, v_seq, vmeta, scale, "flash")
    return torch.cat((out, q.new_zeros((lay.num_tokens - r, *q.shape[1:]))))


def _gather_index(rt: Any, exchanger: Exchanger, window: int,
                  device: torch.device) -> tuple[torch.Tensor, Any]:
    """(key rows on ``device``, cu_seqlens_k) of the gathered form on a halo map."""
    found = window_gather(rt.layout, exchanger.comm, window)
    return torch.from_numpy(found.kv_index).to(device), found.cu_seqlens_k
