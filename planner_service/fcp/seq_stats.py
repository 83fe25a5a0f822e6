"""What FCP's cost model needs of each sequence of a global batch (schedule.sequence_stats
computes it), and the LPT weight every packing step sorts by.

Under an attention mask that is not causal in every layer (core/mask.py) a document's
attention units are the layer mean of its windowed units: a layer of window W computes
``work_W(L) = sum_p min(p + 1, W)`` query-key pairs (core/window_work.py), and the causal
unit ``L^2 = 2 work_causal(L) - L`` generalises to ``2 work_W(L) - L``, so a window no
document fills gives the causal units exactly; the per-call terms (alpha2, beta1, the
exchange) are unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from planner_service.core.mask import AttentionMask
from planner_service.fcp.cost_model import FcpProfile


class SeqStats(NamedTuple):
    """Per-sequence figures the cost model needs (index = sequence id in the batch)."""

    tokens: np.ndarray
    """Tokens per sequence (int64)."""
    units: np.ndarray
    """Attention units W = (1 + eta) sum L^2 per sequence (float64)."""


def serial_cost(stats: SeqStats, profile: FcpProfile) -> np.ndarray:
    """Variable compute of each sequence on one rank (eq. 8 without beta1): LPT weights."""
    return profile.alpha1 * stats.units + profile.alpha2 * stats.tokens


def mask_units(lengths: np.ndarray, mask: AttentionMask) -> np.ndarray:
    """Per document length (float64 array), its attention units under ``mask``: the mean
    over layers of ``2 work_W(L) - L`` (module docstring). O(D G) for D documents and G
    windows."""
    total = float(sum(g.layers for g in mask.groups))
    units = np.zeros(len(lengths), dtype=np.float64)
    for group in mask.groups:
        if group.window is None:
            per = lengths * lengths
        else:
            w = float(group.window)
            inside = np.minimum(lengths, w)
            work = inside * (inside + 1.0) / 2.0 + (lengths - inside) * w
            per = 2.0 * work - lengths
        units += (group.layers / total) * per
    return units
