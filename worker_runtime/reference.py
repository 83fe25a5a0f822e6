"""The slow, obvious reference: dense attention over the whole packed sequence with a
document mask (causal inside each doc, or a sliding window of W keys ending at the query's
own, nothing across docs). Tests and the GPU check
compare the distributed runtime against it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def document_mask(doc_lengths: Sequence[int], device: torch.device | str = "cpu",
                  window: int | None = None) -> torch.Tensor:
    """``[S, S]`` bool: query i may see key j iff same doc and j <= i (and ``j > i - window``
    under a sliding window: transformers' ``sliding_window_overlay``)."""
    lengths = torch.as_tensor(list(doc_lengths), device=device)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    pos = torch.arange(len(doc), device=device)
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    return mask


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_lengths: Sequence[int],
    softmax_scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Dense document-masked attention on global ``[S, H, D]`` q and ``[S, G, D]`` k, v
    (``window``: sliding window W, None: causal).

    GQA: query head h uses KV head h // (H // G). Differentiable; O(S^2) memory.
    Raises ValueError if the lengths do not sum to S or G does not divide H.
    """
    s, h, d = q.shape
    g = k.shape[1]
    if sum(doc_lengths) != s or h % g:
        raise ValueError(f"doc_lengths must sum to q.shape[0]={s} and kv heads {g} divide heads {h}")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    k_full = k.repeat_interleave(h // g, dim=1)
    v_full = v.repeat_interleave(h // g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k_full) * scale
    scores = scores.masked_fill(~document_mask(doc_lengths, q.device, window), -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v_full)
