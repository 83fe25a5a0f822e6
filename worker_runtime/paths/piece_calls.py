"""A rank's piece calls (``pieces.py``) on one device with one segment kernel: their state,
running them forward (merged by log-sum-exp into float32 accumulators) and backward, and
the local buffer's copies. Shared by the segments path (``segments.py``) and the segment
ring (``segment_ring.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from worker_runtime.comm import Exchanger
from worker_runtime.layout import CommMap, RankLayout
from worker_runtime.paths.merge import merge_
from worker_runtime.paths.pieces import PieceCall, SegmentPlan, build_segment_plan
from worker_runtime.paths.segment_kernels import SegmentKernel, SegmentMeta


class SegmentState(NamedTuple):
    """One rank's calls on one device with one kernel (built once per plan)."""

    plan: SegmentPlan
    kernel: SegmentKernel
    metas: tuple[SegmentMeta, ...]
    """Per call of ``plan.calls``."""
    empty: tuple[torch.Tensor | None, ...]
    """Per call: query rows (relative) with an empty key segment, or None."""
    local_rows: torch.Tensor | None
    """Caller rows of the local buffer; None when in place."""
    num_real: int
    exchanger: Exchanger | None
    select: torch.Tensor
    """Rows of the exchange's buffers that form the remote buffer."""
    recv_index: torch.Tensor
    """The same rows in the receive buffer (peers only): where dK/dV go back from."""


Part = tuple[PieceCall, SegmentMeta, torch.Tensor | None]
"""One call with its kernel metadata and its hollow query rows (relative; None if none)."""


def call_parts(kernel: SegmentKernel, calls: tuple[PieceCall, ...],
               device: torch.device) -> tuple[Part, ...]:
    """Each call's kernel metadata and hollow rows on ``device`` (O(rows) per call)."""
    return tuple(
        (c, kernel.meta(c.cu_q, c.cu_k, c.causal, device),
         torch.from_numpy(c.empty.astype(np.int64)).to(device) if len(c.empty) else None)
        for c in calls)


def build_segment_state(layout: RankLayout, comm: CommMap | None, kernel: SegmentKernel,
                        device: torch.device, exchanger: Exchanger | None = None,
                        plan: SegmentPlan | None = None) -> SegmentState:
    """One rank's state; ``comm=None``: the local calls alone (``plan``: the rank's
    ``build_segment_plan(layout, comm)`` when already built)."""
    plan = build_segment_plan(layout, comm) if plan is None else plan

    def tensor(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(device)

    remote_rows = comm.remote_index[plan.remote_order] if comm is not None else plan.remote_order
    select = exchanger.gathered_row(remote_rows) if exchanger is not None else remote_rows
    parts = call_parts(kernel, plan.calls, device)
    return SegmentState(
        plan=plan, kernel=kernel, metas=tuple(m for _, m, _ in parts),
        empty=tuple(e for _, _, e in parts),
        local_rows=None if plan.in_place else tensor(plan.local_rows),
        num_real=layout.num_real, exchanger=exchanger, select=tensor(select),
        recv_index=tensor(remote_rows),
    )


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _calls(state: SegmentState, remote: bool) -> list[Part]:
    return [(c, m, e) for c, m, e in zip(state.plan.calls, state.metas, state.empty, strict=True)
            if c.remote == remote]


def forward_parts(kernel: SegmentKernel, parts: Sequence[Part], q_loc: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  scale: float) -> None:
    """Run ``parts`` on queries ``q_loc`` (local buffer) and one key buffer; a causal
    call's result sets its rows of ``out``, ``lse`` (``A(j, j)``: the group's first call,
    over all of its rows), every other call's merges into them by log-sum-exp."""
    for c, meta, empty in parts:
        o, lo = kernel.forward(q_loc[c.q_lo : c.q_hi], keys[c.k_lo : c.k_hi],
                               values[c.k_lo : c.k_hi], meta, scale)
        if c.causal:
            out[c.q_lo : c.q_hi] = o
            lse[:, c.q_lo : c.q_hi] = lo
        else:
            merge_(out[c.q_lo : c.q_hi], lse[:, c.q_lo : c.q_hi].t(), o, lo.t(), empty)


def forward_local(state: SegmentState, q_loc: torch.Tensor, k_loc: torch.Tensor,
                  v_loc: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The local calls: ``(out [r, H, D], lse [H, r])`` accumulators (buffer order)."""
    r, h, d = q_loc.shape
    acc = accumulator_dtype(q_loc.dtype)
    out = q_loc.new_zeros((r, h, d), dtype=acc)
    lse = q_loc.new_zeros((h, r), dtype=acc)
    forward_parts(state.kernel, _calls(state, remote=False), q_loc, k_loc, v_loc, out, lse, scale)
    return out, lse


def forward_remote(state: SegmentState, q_loc: torch.Tensor, k_far: torch.Tensor,
                   v_far: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float) -> None:
    """The remote calls, merged into ``out`` and ``lse`` in place."""
    forward_parts(state.kernel, _calls(state, remote=True), q_loc, k_far, v_far, out, lse, scale)


def backward_parts(kernel: SegmentKernel, parts: Sequence[Part], do_loc: torch.Tensor,
                   q_loc: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   out_loc: torch.Tensor, lse: torch.Tensor, scale: float, dq: torch.Tensor,
                   dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Gradients of ``parts`` (given the merged ``out_loc``, ``lse``), added into ``dq``
    (buffer order, hollow rows' undefined parts dropped) and the key buffer's ``dk``,
    ``dv`` (rows ``[k_lo, k_hi)`` of each call)."""
    for c, meta, empty in parts:
        q0, q1, k0, k1 = c.q_lo, c.q_hi, c.k_lo, c.k_hi
        gq, gk, gv = kernel.backward(do_loc[q0:q1], q_loc[q0:q1], keys[k0:k1], values[k0:k1],
                                     out_loc[q0:q1], lse[:, q0:q1], meta, scale)
        if empty is not None:
            gq = gq.index_fill(0, empty, 0.0)
        dq[q0:q1] += gq
        dk[k0:k1] += gk
        dv[k0:k1] += gv


def backward_calls(state: SegmentState, remote: bool, do_loc: torch.Tensor, q_loc: torch.Tensor,
                   keys: torch.Tensor, values: torch.Tensor, out_loc: torch.Tensor,
                   lse: torch.Tensor, scale: float, dq: torch.Tensor, dk: torch.Tensor,
                   dv: torch.Tensor) -> None:
    """Gradients of the local or remote calls, added into ``dq`` (buffer order) and the key
    buffer's ``dk``, ``dv``."""
    backward_parts(state.kernel, _calls(state, remote), do_loc, q_loc, keys, values, out_loc,
                   lse, scale, dq, dk, dv)


def to_buffer(x: torch.Tensor, state: SegmentState) -> torch.Tensor:
    """The local buffer's rows of a caller tensor (a view when in place)."""
    r = state.num_real
    return x[:r] if state.local_rows is None else x.index_select(0, state.local_rows)


def from_buffer(x_loc: torch.Tensor, state: SegmentState, num_tokens: int,
                dtype: torch.dtype) -> torch.Tensor:
    """A caller-shaped tensor (``num_tokens`` rows, zero padding) from local-buffer rows."""
    out = x_loc.new_zeros((num_tokens, *x_loc.shape[1:]), dtype=dtype)
    if state.local_rows is None:
        out[: state.num_real] = x_loc
    else:
        out.index_copy_(0, state.local_rows, x_loc.to(dtype))
    return out
