"""What FCP's cost model needs of each sequence of a global batch (schedule.sequence_stats
computes it), and the LPT weight every packing step sorts by."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

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
