"""Run a plan's ranks one after another in one process, with the exchange done by indexing.

Same layouts, comm maps and kernels as the distributed runtime; only the collectives are
replaced by reading the peers' buffers directly, so one process (or one GPU) can check a
whole plan against the reference and time every rank's kernel (ring-flash-attention's
tests loop their shard metadata over every rank the same way). ``simulate_plan`` runs the
gathered path (one varlen call per rank); ``simulate_segments`` the flash path's calls;
``simulate_segment_ring`` the segment ring's calls (``paths/segment_ring.py``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from planner_service.core.plan import Plan
from worker_runtime.comm import CommCounter
from worker_runtime.dispatch import dispatch, undispatch
from worker_runtime.kernels import build_meta, varlen_attention
from worker_runtime.layout import CommMap, RankLayout, build_comm_map, build_layout
from worker_runtime.paths.piece_calls import build_segment_state
from worker_runtime.paths.ring_steps import ring_link
from worker_runtime.paths.segment_kernels import SegmentKernel
from worker_runtime.paths.segment_ring import LocalSegmentRingAttention, build_segment_ring_state
from worker_runtime.paths.segments import LocalSegmentAttention


class Simulated(NamedTuple):
    output: torch.Tensor
    """Global ``[S, H, D]`` output assembled from every rank's local output."""
    recv_tokens: tuple[int, ...]
    """Receive-buffer rows per plan rank (per pass)."""
    layouts: tuple[RankLayout, ...]
    comm_maps: tuple[CommMap, ...]


def peer_block(maps: tuple[CommMap, ...], sender: RankLayout, receiver: RankLayout,
               kv_local: torch.Tensor) -> torch.Tensor:
    """Rows ``sender`` puts in ``receiver``'s receive buffer (padded for all-gathers)."""
    comm = maps[sender.rank]
    send = kv_local.index_select(0, torch.from_numpy(comm.send_index).to(kv_local.device))
    if comm.collective == "all_gather":
        pad = kv_local.new_zeros((comm.buffer_rows - len(send), *kv_local.shape[1:]))
        return torch.cat((send, pad))
    order = np.argsort(np.argsort(sender.group_ranks))
    position = int(order[sender.group_ranks.index(receiver.rank)])
    start = sum(comm.send_splits[:position])
    return send[start : start + comm.send_splits[position]]


def simulate_plan(
    plan: Plan,
    mode: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kernel: str = "auto",
    softmax_scale: float | None = None,
) -> Simulated:
    """Every rank's attention on global packed q ``[S, H, D]``, k, v ``[S, G, D]``.

    Differentiable end to end (gradients reach the global q, k, v through the indexing).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    layouts = tuple(build_layout(plan, r) for r in range(plan.cp_size))
    maps = tuple(build_comm_map(lay, mode) for lay in layouts)
    kv_global = torch.stack((k, v), dim=1)
    kv_local = [dispatch(lay, kv_global) for lay in layouts]
    out = q.new_zeros(q.shape)
    for lay, comm in zip(layouts, maps, strict=True):
        if lay.group_index < 0:
            continue
        order = np.argsort(np.argsort(lay.group_ranks))
        peers = [lay.group_ranks[s] for s in np.argsort(order) if lay.group_ranks[s] != lay.rank]
        recv = [peer_block(maps, layouts[p], lay, kv_local[p]) for p in peers] if comm.collective != "none" else []
        source = torch.cat([kv_local[lay.rank], *recv])
        kv_index = torch.from_numpy(comm.kv_index).to(q.device)
        meta = build_meta(lay.cu_seqlens_q, lay.cu_seqlens_k, q.device)
        q_local = dispatch(lay, q)[: lay.num_real]
        o = varlen_attention(q_local, source[:, 0].index_select(0, kv_index),
                             source[:, 1].index_select(0, kv_index), meta, scale, kernel)
        o = torch.cat((o, o.new_zeros((lay.num_tokens - lay.num_real, *o.shape[1:]))))
        out = out + undispatch(lay, o)
    return Simulated(out, tuple(m.recv_rows for m in maps), layouts, maps)


def simulate_segments(
    plan: Plan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel: SegmentKernel,
    *,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """The flash path's calls (``paths.segments.LocalSegmentAttention``) for every rank on
    global packed q ``[S, H, D]``, k, v ``[S, G, D]``; the remote buffer is read from the
    global K and V (the distinct remote KV is the same in every gather mode). Returns the
    global output; differentiable end to end."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    out = q.new_zeros(q.shape)
    for rank in range(plan.cp_size):
        lay = build_layout(plan, rank)
        if lay.group_index < 0:
            continue
        comm = build_comm_map(lay, "alltoallv")
        state = build_segment_state(lay, comm, kernel, q.device)
        rows = torch.from_numpy(lay.global_index[: lay.num_real][state.plan.local_rows]).to(q.device)
        far_np = lay.doc_offsets[comm.remote_doc] + comm.remote_pos
        far = torch.from_numpy(far_np[state.plan.remote_order]).to(q.device)
        o = LocalSegmentAttention.apply(q[rows], k[rows], v[rows], k[far], v[far], state, scale)
        out = out.index_add(0, rows, o)
    return out


def simulate_segment_ring(
    plan: Plan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel: SegmentKernel,
    *,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """The segment ring's calls (``paths.segment_ring.LocalSegmentRingAttention``) for every rank on
    global packed q ``[S, H, D]``, k, v ``[S, G, D]``; the block of step s is read from
    the global K and V as slot ``i - s``'s local rows (what the ring delivers), whatever
    the plan's comm mode. Returns the global output; differentiable end to end."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    layouts = [build_layout(plan, r) for r in range(plan.cp_size)]
    out = q.new_zeros(q.shape)
    for lay in layouts:
        if lay.group_index < 0:
            continue
        n = lay.num_ranks
        state = build_segment_ring_state(lay, kernel, ring_link(lay, None, None, CommCounter()), q.device)
        owners = [layouts[lay.group_ranks[(lay.slot - s) % n]] for s in range(n)]
        k_blocks = torch.stack([dispatch(o, k) for o in owners])
        v_blocks = torch.stack([dispatch(o, v) for o in owners])
        o = LocalSegmentRingAttention.apply(dispatch(lay, q), k_blocks, v_blocks, state, scale)
        out = out + undispatch(lay, o)
    return out
