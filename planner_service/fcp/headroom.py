"""Time headroom: short sequences into the slack of long groups at their chosen degree.

The paper's BFD fills a long sequence's *memory* headroom (``d_min * E`` minus its
tokens). Once stage 2 has given a long group d ranks, it usually also has *time*
headroom: it finishes before the one-rank bins of short sequences, because degrees are
integers. Moving short sequences into that slack shortens the bins. This module finds the
level T at which long groups and bins balance (water filling in cost units) and fills each
long group, Best-Fit-Decreasing, up to the tokens that keep it at or under T (the exact
eq. 10 time, solved in closed form for an average short sequence) and within ``d E``.
Stage 2 then re-scores the result exactly; this step only proposes a grouping.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner_service.fcp.cost_model import FcpProfile
from planner_service.fcp.packing import descending, fit_into_rooms
from planner_service.fcp.seq_stats import SeqStats


def water_level(times: np.ndarray, degrees: np.ndarray, bins: int, work: float, fixed: float) -> float:
    """T with ``bins (T - fixed) + sum_i d_i max(0, T - t_i) = work`` (cost units)."""
    order = np.argsort(times)
    ranks = float(bins)
    filled = work + bins * fixed
    level = filled / ranks
    for i in order.tolist():
        if times[i] >= level:
            break
        ranks += degrees[i]
        filled += degrees[i] * times[i]
        level = filled / ranks
    return level


def token_room(
    tokens: np.ndarray, units: np.ndarray, degrees: np.ndarray, level: float,
    unit_density: float, memory_tokens: int, profile: FcpProfile,
) -> np.ndarray:
    """Tokens x each group can take (with ``unit_density`` units per token) and stay at or
    under ``level`` ms (eq. 10) and under ``d E`` tokens.

    T(x) = lin(x) + beta1 + beta2 [d > 1] + max(attn(x), wire(x)) is a maximum of two
    lines in x, so the room is the smaller of the two lines' crossings with ``level``.
    """
    d = degrees.astype(np.float64)
    lin0, lin1 = profile.alpha2 * tokens / d, profile.alpha2 / d
    attn0, attn1 = profile.alpha1 * units / d, profile.alpha1 * unit_density / d
    bw = np.where(degrees <= profile.ranks_per_node, profile.bandwidth_gbps,
                  profile.inter_node_bandwidth_gbps) * 1e6
    share = np.where(degrees > 1, profile.alpha3 * (d - 1) / d / bw, 0.0)
    wire0, wire1 = share * tokens, share
    base = profile.beta1 + np.where(degrees > 1, profile.beta2, 0.0)
    room_attn = (level - base - lin0 - attn0) / (lin1 + attn1)
    room_wire = (level - base - lin0 - wire0) / (lin1 + wire1)
    room = np.minimum(room_attn, room_wire)
    return np.clip(np.minimum(room, degrees * memory_tokens - tokens), 0.0, None)


def fill_time_headroom(
    stats: SeqStats, groups: Sequence[Sequence[int]], degrees: Sequence[int],
    times: Sequence[float], pool: Sequence[int], bins: int, memory_tokens: int,
    profile: FcpProfile, costs: np.ndarray,
) -> tuple[list[list[int]], list[int]]:
    """Move pool sequences into the time slack of ``groups`` at ``degrees`` (module docstring).

    Returns (groups with the moved sequences, the pool sequences left for the ``bins``
    one-rank bins). Nothing moves if the groups have no slack at the balance level.
    """
    out = [list(g) for g in groups]
    if not pool or not groups or bins < 1:
        return out, list(pool)
    deg = np.asarray(degrees, dtype=np.int64)
    tokens = np.array([float(stats.tokens[g].sum()) for g in groups])
    units = np.array([float(stats.units[g].sum()) for g in groups])
    pool_tokens = float(stats.tokens[list(pool)].sum())
    level = water_level(np.asarray(times, dtype=np.float64), deg, bins,
                        float(costs[list(pool)].sum()), profile.beta1)
    room = token_room(tokens, units, deg, level, float(stats.units[list(pool)].sum()) / pool_tokens,
                      memory_tokens, profile)
    # Best-Fit-Decreasing of pool sequences (by tokens) into the rooms.
    rooms = sorted((int(r), g) for g, r in enumerate(room.tolist()) if r >= 1)
    order = descending(stats.tokens, pool)
    left = fit_into_rooms(order, stats.tokens[order].tolist(), rooms, out)
    return out, left
