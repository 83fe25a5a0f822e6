"""The segments path (``ExecutionPath.SEGMENTS``): a rank's attention as the varlen calls of
``pieces.py``, merged by log-sum-exp, with the exchange overlapped; any segment kernel
(``segment_kernels.py``; the calls' state and loops: ``piece_calls.py``).

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

A sliding-window layer on a kernel with positional masks (``window_pieces.py``) runs the
same loops on the window's exchange: gaps cut to their halos on the halo maps, every call
on its windowed mask, calls with no key in any window dropped (flash kernels take the
gathered form instead, ``paths.windowed_path``).

``LocalSegmentAttention`` runs the same calls on buffers given directly (no exchange):
``simulate.simulate_segments`` checks whole plans in one process with it.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_runtime.paths.base import PathContext, PlannedCall, PlannedTransfer
from worker_runtime.paths.piece_calls import (
    SegmentState,
    backward_calls,
    build_segment_state,
    forward_local,
    forward_remote,
    from_buffer,
    to_buffer,
)
from worker_runtime.paths.pieces import build_segment_plan
from worker_runtime.paths.window_pieces import windowed_state
from worker_runtime.sinks import merge_sink_, row_delta, sink_grad
from worker_runtime.windows import HALO_MODES, window_exchanger


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


def build(ctx: PathContext) -> SegmentState:
    """The piece calls on the causal exchange; a window layer (a kernel with positional
    masks): on the window's exchange (``windows.window_exchanger``), the gaps cut to their
    halos on the halo maps, every call on its windowed mask (``window_pieces.py``)."""
    assert ctx.kernel is not None, "the segments path runs a segment kernel"
    if ctx.window is None:
        return build_segment_state(ctx.layout, ctx.comm_map, ctx.kernel, ctx.device, ctx.exchanger)
    ex = window_exchanger(ctx)
    halo = ctx.window if ctx.gather_mode in HALO_MODES else None
    plan = build_segment_plan(ctx.layout, ex.comm, halo)
    state = build_segment_state(ctx.layout, ex.comm, ctx.kernel, ctx.device, ex, plan=plan)
    return windowed_state(state, ctx.layout, ex.comm, ctx.window, ctx.device)


def run(state: SegmentState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        overlap: bool, sink: torch.Tensor | None) -> torch.Tensor:
    return SegmentAttention.apply(q, k, v, state, scale, overlap, sink)  # type: ignore[no-any-return]


def planned_calls(state: SegmentState) -> tuple[PlannedCall, ...]:
    """Every piece call: local calls on the local buffer, remote calls on the remote buffer."""
    return tuple(PlannedCall("segment", meta, "remote" if c.remote else "local", c.q_lo, c.q_hi,
                             c.k_lo, c.k_hi)
                 for c, meta in zip(state.plan.calls, state.metas, strict=True))


def buffers(state: SegmentState) -> dict[str, int]:
    return {"queries": state.num_real, "local": state.num_real, "remote": len(state.select)}


def planned_transfers(state: SegmentState) -> tuple[PlannedTransfer, ...]:
    """The K/V collectives forward and the dK/dV ones backward (K and V apart)."""
    assert state.exchanger is not None
    return (PlannedTransfer("split", state.exchanger.comm.recv_rows, 1),)
