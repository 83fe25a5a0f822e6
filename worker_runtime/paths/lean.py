"""The lean path (``ExecutionPath.LEAN``): the gather modes (full, compact all-gather,
all-to-all-v) on the PyTorch kernel, overlapped with the exchange.

Forward, per call: start the K/V exchange (async), run attention of every local query
against the keys this rank holds itself, wait for the exchange, keep one copy of the
remote keys the rank attends (per doc, the peers' tokens below the end of its last shard
of the doc: the distinct KV), run the queries that see any remote key against those, and
merge the two parts per query with their log-sum-exp (exact: ``lse = logaddexp(l1, l2)``,
``out = e^(l1 - lse) o1 + e^(l2 - lse) o2``). Queries of docs the rank holds whole, and
the first shard of a split doc, see only local keys: that work hides the exchange.

Backward mirrors it: the gradients of the remote keys are computed first and sent back
(async) while the local part's gradients are computed. Both parts use the merged output
and log-sum-exp, so their gradients add up exactly (the ring-attention identity).
``overlap=False`` waits for each exchange right after starting it (same arithmetic).

K/V memory per layer: the rank's own K and V (the caller's tensors, used in place) and one
copy of each remote token it attends, kept for backward; the receive buffer is freed once
that copy is made. Copies left before the kernel, and why:

- the send buffer (compact all-gather, all-to-all-v): a collective sends one contiguous
  buffer; ``full`` sends the local K and V as they are;
- the receive buffer: the collective's output;
- the remote copy (one ``index_select`` of K and one of V): the kernel reads each doc's keys
  in (doc, position) order, and the all-gather buffers hold peers' tokens nobody here
  needs (freed with the receive buffer), the all-to-all-v buffer orders them by sender.
  It is the one copy kept for backward.

K and V are exchanged as two collectives each way (no stacking copy). This path runs the
exact torch kernel (``kernels.attention_forward``), whose mask takes any (doc, position)
key set in one call. flash-attn's varlen format gives each query segment one contiguous
key segment, so the flash kernel runs the same structure as several calls instead
(``pieces.py``: per query shard, its doc's local pieces and remote gaps; merged by
log-sum-exp in ``segments.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from planner_service.core.seeing import rows_seeing
from worker_runtime.comm import Exchanger
from worker_runtime.kernels import (
    VarlenMeta,
    attention_backward,
    attention_forward,
    build_masked_meta,
    rows_in_window,
)
from worker_runtime.layout import CommMap, RankLayout
from worker_runtime.paths.base import PathContext, PlannedCall, PlannedTransfer
from worker_runtime.paths.merge import merge_rows_
from worker_runtime.sinks import merge_sink_, sink_grad
from worker_runtime.windows import window_exchanger


def remote_query_rows(layout: RankLayout, comm: CommMap, window: int | None = None) -> np.ndarray:
    """Local rows (real tokens, ascending) whose query sees at least one remote key: the
    rows of a doc at or after the doc's first remote token (``window``: with a remote key
    in the query's window). O((T + R) log R)."""
    r = layout.num_real
    if window is not None:
        return rows_in_window(layout.doc_ids[:r], layout.positions[:r], comm.remote_doc,
                              comm.remote_pos, window)
    return rows_seeing(layout.doc_ids[:r], layout.positions[:r], comm.remote_doc, comm.remote_pos)


def local_share(layout: RankLayout, comm: CommMap, window: int | None = None) -> tuple[int, int]:
    """(queries that see only local keys, real queries) of this rank: the queries whose
    attention is complete before any remote KV arrives."""
    return layout.num_real - len(remote_query_rows(layout, comm, window)), layout.num_real


class LeanState(NamedTuple):
    """Per-device index tensors and kernel metadata of one rank (built once)."""

    num_real: int
    local_meta: VarlenMeta
    remote_meta: VarlenMeta
    query_rows: torch.Tensor
    """Local rows that see a remote key (the remote part's queries)."""
    select: torch.Tensor
    """Rows of the exchange's buffers that form the remote copy."""
    recv_index: torch.Tensor
    """The same rows in the receive buffer (peers only): where dK/dV go back from."""
    exchanger: Exchanger


def build_lean_state(layout: RankLayout, exchanger: Exchanger, device: torch.device,
                     window: int | None = None) -> LeanState:
    """The lean path's state for ``exchanger``'s comm map; ``window``: a sliding-window
    layer's masks (the remote part's queries are those with a remote key in their window)."""
    comm, r = exchanger.comm, layout.num_real
    doc, pos = layout.doc_ids[:r], layout.positions[:r]
    rows = remote_query_rows(layout, comm, window)

    def tensor(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(device)

    return LeanState(
        num_real=r,
        local_meta=build_masked_meta(doc, pos, doc, pos, device, window=window),
        remote_meta=build_masked_meta(doc[rows], pos[rows], comm.remote_doc, comm.remote_pos, device,
                                      window=window),
        query_rows=tensor(rows),
        select=tensor(exchanger.gathered_row(comm.remote_index)),
        recv_index=tensor(comm.remote_index),
        exchanger=exchanger,
    )


class LeanAttention(torch.autograd.Function):
    """``out [T, H, D]`` of the local queries; see the module docstring. ``sink``: None or
    one logit per query head ``[H]`` (``sinks.py``), merged after the parts."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                state: LeanState, scale: float, overlap: bool,
                sink: torch.Tensor | None = None) -> torch.Tensor:
        ex, r = state.exchanger, state.num_real
        t, h, d = q.shape
        g = k.shape[1]
        pending = ex.start_forward(k, v)
        if not overlap:
            bufs = pending.wait()
        out, lse = attention_forward(q[:r], k[:r], v[:r], state.local_meta, scale)
        if overlap:
            bufs = pending.wait()
        k_far, v_far = (b.index_select(0, state.select) for b in bufs)
        del bufs  # the receive buffers go; the remote copy stays for backward
        ex.counter.hold(r + len(k_far))
        rows = state.query_rows
        if len(rows):
            out2, lse2 = attention_forward(q.index_select(0, rows), k_far, v_far,
                                           state.remote_meta, scale)
            merge_rows_(out, lse, rows, out2, lse2)
        merge_sink_(out.view(r, h, d), lse.view(r, h), sink)
        result = torch.cat((out.view(r, h, d).to(q.dtype), q.new_zeros((t - r, h, d))))
        ctx.save_for_backward(q, k, v, k_far, v_far, result, lse, sink)
        ctx.state, ctx.scale, ctx.overlap, ctx.groups = state, scale, overlap, g
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # type: ignore[override]
        q, k, v, k_far, v_far, result, lse, sink = ctx.saved_tensors
        state, scale, ex, r = ctx.state, ctx.scale, ctx.state.exchanger, ctx.state.num_real
        t, h, d = q.shape
        g = ctx.groups
        cd = lse.dtype
        do = dout[:r].reshape(r, g, h // g, d).to(cd)
        delta = (do * result[:r].view(r, g, h // g, d).to(cd)).sum(dim=-1)
        rows = state.query_rows
        dk_recv = k.new_zeros((ex.comm.recv_rows, *k.shape[1:]))
        dv_recv = v.new_zeros((ex.comm.recv_rows, *v.shape[1:]))
        if len(rows):
            dq2, dk_far, dv_far = attention_backward(
                do.index_select(0, rows), q.index_select(0, rows), k_far, v_far,
                lse.index_select(0, rows), delta.index_select(0, rows), state.remote_meta, scale)
            dk_recv.index_copy_(0, state.recv_index, dk_far.to(k.dtype))
            dv_recv.index_copy_(0, state.recv_index, dv_far.to(v.dtype))
        pending = ex.start_backward(dk_recv, dv_recv)
        if not ctx.overlap:
            returned = pending.wait()
        dq, dk_own, dv_own = attention_backward(do, q[:r], k[:r], v[:r], lse, delta,
                                                state.local_meta, scale)
        if len(rows):
            dq.index_add_(0, rows, dq2)
        dk = torch.cat((dk_own.to(k.dtype), k.new_zeros((t - r, *k.shape[1:]))))
        dv = torch.cat((dv_own.to(v.dtype), v.new_zeros((t - r, *v.shape[1:]))))
        if ctx.overlap:
            returned = pending.wait()
        if returned is not None:
            dk.index_add_(0, ex.send_index, returned[0])
            dv.index_add_(0, ex.send_index, returned[1])
        dq_full = torch.cat((dq.view(r, h, d).to(q.dtype), q.new_zeros((t - r, h, d))))
        d_sink = sink_grad(lse.view(r, h), delta.view(r, h), sink)
        return dq_full, dk, dv, None, None, None, d_sink


def build(ctx: PathContext) -> LeanState:
    """The lean path's state on ``ctx``'s device: the causal exchange, or a window's
    (``windows.window_exchanger``)."""
    ex = ctx.exchanger if ctx.window is None else window_exchanger(ctx)
    assert ex is not None, "the lean path runs over an exchange"
    return build_lean_state(ctx.layout, ex, ctx.device, ctx.window)


def run(state: LeanState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        overlap: bool, sink: torch.Tensor | None) -> torch.Tensor:
    return LeanAttention.apply(q, k, v, state, scale, overlap, sink)  # type: ignore[no-any-return]


def planned_calls(state: LeanState) -> tuple[PlannedCall, ...]:
    """The local call (own rows against own rows) and, where a query sees a remote key, the
    remote call (those queries against the remote copy)."""
    r, rows = state.num_real, len(state.query_rows)
    calls = [PlannedCall("torch", state.local_meta, "local", 0, r, 0, r)]
    if rows:
        calls.append(PlannedCall("torch", state.remote_meta, "remote", 0, rows, 0, len(state.select)))
    return tuple(calls)


def buffers(state: LeanState) -> dict[str, int]:
    return {"queries": state.num_real, "local": state.num_real, "remote": len(state.select)}


def planned_transfers(state: LeanState) -> tuple[PlannedTransfer, ...]:
    """The K/V collectives forward and the dK/dV ones backward (K and V apart)."""
    return (PlannedTransfer("split", state.exchanger.comm.recv_rows, 1),)
