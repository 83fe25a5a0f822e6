"""The flash path: a rank's attention as the varlen calls of ``segments.py``, merged by
log-sum-exp, with the exchange overlapped; any segment kernel (``segkernels.py``).

Forward, per call of ``SegmentAttention``: start the K/V exchange (async); take the local
buffer (the caller's q, k, v rows in place when every document has one shard here, else
one ``index_select`` each into (piece, doc) order); run every local call ``A(j, i)`` (own
keys only) while the exchange is in flight; wait; copy the distinct remote keys once into
the remote buffer (one ``index_select`` of K and one of V, in (gap, doc, position) order;
the receive buffers are then freed); run the remote calls ``B(j, i)``; each call's output
merges into its query rows by log-sum-exp (``lse = logaddexp(lse, l)``,
``out = e^(lse_old - lse) out + e^(l - lse) o``). The first call of every query group is
its causal diagonal ``A(j, j)``, which covers the whole group, so the accumulators start
from it. Backward mirrors it: the remote calls' gradients first, their dK/dV return
started (async), then the local calls' gradients while it is in flight. Every call's
backward takes the merged output and log-sum-exp, so the parts' gradients add up (the
ring-attention identity). ``overlap=False`` waits for each exchange right after starting
it (same arithmetic).

Accumulators (output, log-sum-exp, dQ, dK, dV) are float32 (float64 for float64 inputs);
each call's parts are added into them. K/V kept for backward: the local buffer (own
tokens; the caller's K/V when in place) and the remote buffer (the distinct remote KV), so
the counter's ``kv_tokens_peak`` is own tokens plus distinct remote KV, the plan's
``rank_stats.kv_tokens_peak`` for the gather modes.

Copies before the kernel, and why:

- the exchange's send and receive buffers (``comm.Exchanger.start_forward``);
- the remote buffer (one ``index_select`` of K and of V): the calls read each gap as one
  contiguous key segment; it is the one remote copy kept for backward;
- the local buffer, only when some document has several shards here (one
  ``index_select`` of q, k and v): a query group and a key piece list the documents in
  one order, which the plan's (doc, start) row order is not; the K/V copy replaces the
  caller's K/V in what backward keeps. Output, dQ, dK and dV go back to the caller's rows
  with one ``index_copy`` each.

``LocalSegmentAttention`` runs the same calls on buffers given directly (no exchange):
``simulate.simulate_segments`` checks whole plans in one process with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from worker_runtime.comm import Exchanger
from worker_runtime.layout import CommMap, RankLayout
from worker_runtime.segkernels import SegmentKernel, SegmentMeta
from worker_runtime.segments import SegmentCall, SegmentPlan, build_segment_plan
from worker_runtime.sinks import merge_sink_, row_delta, sink_grad


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


Part = tuple[SegmentCall, SegmentMeta, torch.Tensor | None]
"""One call with its kernel metadata and its hollow query rows (relative; None if none)."""


def call_parts(kernel: SegmentKernel, calls: tuple[SegmentCall, ...],
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


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lo: torch.Tensor,
           empty: torch.Tensor | None) -> None:
    """Merge a part (``o [n, H, D]``, ``lo [H, n]``) into ``out``, ``lse`` (views) in place."""
    lo, o = lo.to(lse.dtype), o.to(out.dtype)
    if empty is not None:
        lo, o = lo.index_fill(1, empty, -math.inf), o.index_fill(0, empty, 0.0)
    new = torch.logaddexp(lse, lo)
    out.mul_(torch.exp(lse - new).t().unsqueeze(-1)).add_(o * torch.exp(lo - new).t().unsqueeze(-1))
    lse.copy_(new)


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
            _merge(out[c.q_lo : c.q_hi], lse[:, c.q_lo : c.q_hi], o, lo, empty)


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


class SegmentAttention(torch.autograd.Function):
    """``out [T, H, D]`` of the local queries over the exchange; see the module docstring.
    ``sink``: None or one logit per query head ``[H]`` (``sinks.py``), merged after the
    remote calls."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                state: SegmentState, scale: float, overlap: bool,
                sink: torch.Tensor | None = None) -> torch.Tensor:
        ex = state.exchanger
        assert ex is not None
        pending = ex.start_forward(k, v)
        bufs = None if overlap else pending.wait()
        q_loc, k_loc, v_loc = (to_buffer(x, state) for x in (q, k, v))
        out, lse = forward_local(state, q_loc, k_loc, v_loc, scale)
        if bufs is None:
            bufs = pending.wait()
        k_far, v_far = (b.index_select(0, state.select) for b in bufs)
        del bufs  # the receive buffers go; the remote buffer stays for backward
        ex.counter.hold(state.num_real + len(k_far))
        forward_remote(state, q_loc, k_far, v_far, out, lse, scale)
        merge_sink_(out, lse.t(), sink)
        result = from_buffer(out, state, q.shape[0], q.dtype)
        ctx.save_for_backward(q_loc, k_loc, v_loc, k_far, v_far, result, lse, sink)
        ctx.state, ctx.scale, ctx.overlap = state, scale, overlap
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # type: ignore[override]
        q_loc, k_loc, v_loc, k_far, v_far, result, lse, sink = ctx.saved_tensors
        state, scale = ctx.state, ctx.scale
        ex = state.exchanger
        t = result.shape[0]
        acc = lse.dtype
        do_loc = to_buffer(dout, state).contiguous()
        out_loc = to_buffer(result, state)
        dq = torch.zeros(q_loc.shape, dtype=acc, device=q_loc.device)
        dk_far = torch.zeros(k_far.shape, dtype=acc, device=k_far.device)
        dv_far = torch.zeros_like(dk_far)
        backward_calls(state, True, do_loc, q_loc, k_far, v_far, out_loc, lse, scale, dq, dk_far, dv_far)
        row = (ex.comm.recv_rows, *k_loc.shape[1:])
        dk_recv = k_loc.new_zeros(row).index_copy_(0, state.recv_index, dk_far.to(k_loc.dtype))
        dv_recv = v_loc.new_zeros(row).index_copy_(0, state.recv_index, dv_far.to(v_loc.dtype))
        del dk_far, dv_far
        pending = ex.start_backward(dk_recv, dv_recv)
        returned = None if ctx.overlap else pending.wait()
        dk_loc = torch.zeros(k_loc.shape, dtype=acc, device=k_loc.device)
        dv_loc = torch.zeros_like(dk_loc)
        backward_calls(state, False, do_loc, q_loc, k_loc, v_loc, out_loc, lse, scale, dq, dk_loc, dv_loc)
        dq_full = from_buffer(dq, state, t, q_loc.dtype)
        dk = from_buffer(dk_loc, state, t, k_loc.dtype)
        dv = from_buffer(dv_loc, state, t, v_loc.dtype)
        if ctx.overlap:
            returned = pending.wait()
        if returned is not None:
            dk.index_add_(0, ex.send_index, returned[0])
            dv.index_add_(0, ex.send_index, returned[1])
        d_sink = sink_grad(lse.t(), row_delta(do_loc, out_loc, acc), sink)
        return dq_full, dk, dv, None, None, None, d_sink


class LocalSegmentAttention(torch.autograd.Function):
    """The same calls on buffers given directly: ``out [r, H, D]`` (buffer order) of
    ``q_loc`` against ``k_loc``/``v_loc`` (local buffer) and ``k_far``/``v_far`` (remote
    buffer); differentiable in all five. No exchange (one-process simulation)."""

    @staticmethod
    def forward(ctx: Any, q_loc: torch.Tensor, k_loc: torch.Tensor, v_loc: torch.Tensor,  # type: ignore[override]
                k_far: torch.Tensor, v_far: torch.Tensor, state: SegmentState,
                scale: float) -> torch.Tensor:
        out, lse = forward_local(state, q_loc, k_loc, v_loc, scale)
        forward_remote(state, q_loc, k_far, v_far, out, lse, scale)
        result = out.to(q_loc.dtype)
        ctx.save_for_backward(q_loc, k_loc, v_loc, k_far, v_far, result, lse)
        ctx.state, ctx.scale = state, scale
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # type: ignore[override]
        q_loc, k_loc, v_loc, k_far, v_far, result, lse = ctx.saved_tensors
        state, scale, acc = ctx.state, ctx.scale, lse.dtype
        do_loc = dout.contiguous()
        dq = torch.zeros(q_loc.shape, dtype=acc, device=q_loc.device)
        grads = [torch.zeros(x.shape, dtype=acc, device=x.device) for x in (k_loc, v_loc, k_far, v_far)]
        backward_calls(state, True, do_loc, q_loc, k_far, v_far, result, lse, scale, dq, grads[2], grads[3])
        backward_calls(state, False, do_loc, q_loc, k_loc, v_loc, result, lse, scale, dq, grads[0], grads[1])
        return (dq.to(q_loc.dtype), *(g.to(x.dtype) for g, x in zip(grads, (k_loc, v_loc, k_far, v_far),
                                                                      strict=True)), None, None)
