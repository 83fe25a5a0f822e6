"""Attention sinks: one learned logit per query head in every query's softmax denominator
(GPT-OSS ``s_aux``), merged exactly into the log-sum-exp every path keeps.

A sink is a virtual key with logit ``s_h`` (not scaled) and value 0, seen by every query
of head h. So once a path has merged all its parts into ``(out, lse)`` of a query:

    lse' = logaddexp(lse, s_h),   out' = out * exp(lse - lse')

and backward needs nothing new for q, k, v: the path's existing backward, given the merged
``out'`` and ``lse'``, is the gradient of the attention with the sink (flash-style
``dS = P (dP - D)`` with ``P = exp(S - lse')`` and ``D = rowsum(dO * O')``; the sink's own
row of P carries value 0, so it adds nothing to dV or dQ). The sink's gradient is

    d s_h = -sum_i exp(s_h - lse'_i) D_i

over this rank's queries: a partial gradient, which the training loop's gradient
all-reduce sums over the ranks like any other replicated parameter's.

Every path (``worker_runtime.paths``: lean, ring, segments, segment ring and the gathered
path's ``GatheredSinkAttention``) calls :func:`merge_sink_` once after its last merge and
:func:`sink_grad` once in backward, so segment kernels (``segment_kernels.SegmentKernel``)
need no sink support.

Shape legend: T query rows, H query heads, D head dim; ``lse_TH`` may be a transposed view
of a path's ``[H, T]`` accumulator.
"""

from __future__ import annotations

import torch


def check_sink(sink: torch.Tensor | None, num_heads: int) -> None:
    """Raise ValueError unless ``sink`` is None or a floating ``[num_heads]`` tensor."""
    if sink is None:
        return
    if sink.dim() != 1 or sink.shape[0] != num_heads or not sink.is_floating_point():
        raise ValueError(f"sink must be a floating tensor of shape [{num_heads}] (one logit per "
                         f"query head), got {tuple(sink.shape)} {sink.dtype}")


def merge_sink_(out_THD: torch.Tensor, lse_TH: torch.Tensor, sink_H: torch.Tensor | None) -> None:
    """Merge the sink into the accumulators in place: ``lse = logaddexp(lse, s)``,
    ``out *= exp(lse_old - lse)``. No-op for ``sink_H=None``."""
    if sink_H is None:
        return
    new = torch.logaddexp(lse_TH, sink_H.detach().to(lse_TH.dtype))
    out_THD.mul_(torch.exp(lse_TH - new).unsqueeze(-1).to(out_THD.dtype))
    lse_TH.copy_(new)


def row_delta(dout_THD: torch.Tensor, out_THD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``D = rowsum(dout * out)`` per (row, head), ``[T, H]`` in ``dtype``."""
    return (dout_THD.to(dtype) * out_THD.to(dtype)).sum(dim=-1)


def sink_grad(lse_TH: torch.Tensor, delta_TH: torch.Tensor,
              sink_H: torch.Tensor | None) -> torch.Tensor | None:
    """``d s_h = -sum_i exp(s_h - lse'_i) D_i`` over the rows given (merged ``lse'``), in
    the sink's dtype; None for ``sink_H=None``."""
    if sink_H is None:
        return None
    s = sink_H.detach().to(lse_TH.dtype)
    grad = -(torch.exp(s - lse_TH) * delta_TH.to(lse_TH.dtype)).sum(dim=0)
    return grad.to(sink_H.dtype)
