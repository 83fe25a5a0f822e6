"""Stage 2: a CP degree for every atomic group, sum at most N, minimising the makespan.

Two exact solvers of the same problem (min over degree vectors of max_i T(G_i, d_i)):

* ``dp_degrees``: the paper's 2D dynamic program (FCP, arXiv:2602.21788, eq. 11 and
  Algorithm 1 in appendix B), ``DP[k][j]`` = the least makespan of the first k groups on
  exactly j ranks, with backtracking. O(K N^2); the inner loop over degrees is one numpy
  expression per group.
* ``threshold_degrees``: the problem separates per group, so a makespan T is reachable iff
  the least degrees meeting it sum to at most N. With ``m_i(d) = min_{d' <= d} T_i(d')``,
  group i needs ``N + 1 - #{d : m_i(d) <= T}`` ranks, so the optimum is the
  ``K (N + 1) - N``-th smallest entry of m: one ``np.partition``, O(K N). Used to screen
  candidate groupings; tests check it against the DP and a brute force.

Both return the least degrees that meet the optimal makespan (ties broken the same way);
``fill_spare_ranks`` then hands unused ranks to the slowest groups that get faster.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np


class Degrees(NamedTuple):
    """Degrees per atomic group and the makespan they give (inf if infeasible)."""

    degrees: tuple[int, ...]
    makespan_ms: float


def _check_table(table: np.ndarray) -> tuple[int, int]:
    assert table.ndim == 2 and table.shape[1] >= 2, "table must be (K, N + 1)"
    return table.shape[0], table.shape[1] - 1


def least_degrees(table: np.ndarray, makespan: float) -> tuple[int, ...]:
    """For each group the smallest degree whose time is at most ``makespan``."""
    ok = table[:, 1:] <= makespan
    assert ok.any(axis=1).all(), "makespan not reachable by every group"
    return tuple((ok.argmax(axis=1) + 1).tolist())


def threshold_degrees(table: np.ndarray) -> Degrees:
    """Exact min-makespan degrees by order statistics (module docstring)."""
    k, n = _check_table(table)
    if k == 0:
        return Degrees((), 0.0)
    if k > n:
        return Degrees((), float("inf"))
    best = np.minimum.accumulate(table[:, 1:], axis=1)
    rank = k * (n + 1) - n  # 1-indexed order statistic
    flat = best.ravel()
    makespan = float(np.partition(flat, rank - 1)[rank - 1])
    if not np.isfinite(makespan):
        return Degrees((), float("inf"))
    return Degrees(least_degrees(table, makespan), makespan)


def dp_degrees(table: np.ndarray) -> Degrees:
    """The paper's 2D DP (Algorithm 1) over the (K, N + 1) time table.

    ``DP[k][j] = min_d max(DP[k-1][j-d], T(G_k, d))``; degrees below a group's memory
    minimum are inf in the table, so the paper's explicit ranges
    (``d >= d_min``, reserve ``sum d_min`` for the remaining groups) fall out of the inf
    entries. The best final j <= N is taken (the paper reads ``DP[K'][N]``, the same when
    more ranks never hurt), then the path is backtracked; degrees are finally lowered to
    the least that meet the makespan found (``least_degrees``).
    """
    k, n = _check_table(table)
    if k == 0:
        return Degrees((), 0.0)
    dp = np.full((k + 1, n + 1), np.inf)
    dp[0, 0] = 0.0
    path = np.zeros((k + 1, n + 1), dtype=np.int64)
    padded = np.full(2 * n + 1, np.inf)
    # shifted[j, d] = padded[n + j - d] = DP[i-1][j-d] (inf for d > j): a reversed sliding
    # window over ``padded``, a view, so refilling ``padded`` updates it without copies.
    shifted = np.lib.stride_tricks.sliding_window_view(padded, n + 1)[:, ::-1]
    rows = np.arange(n + 1)
    for i in range(1, k + 1):
        padded[n:] = dp[i - 1]
        # cand[j, d] = max(DP[i-1][j-d], T(G_i, d)): the inner loop of line 6, vectorised.
        cand = np.maximum(shifted, table[i - 1][None, :])
        path[i] = cand.argmin(axis=1)
        dp[i] = cand[rows, path[i]]
    last = int(np.argmin(dp[k]))
    makespan = float(dp[k, last])
    if not np.isfinite(makespan):
        return Degrees((), float("inf"))
    degrees = []
    for i in range(k, 0, -1):  # backtracking (Algorithm 1, lines 11-14)
        degrees.append(int(path[i, last]))
        last -= degrees[-1]
    degrees.reverse()
    assert max(t[dd] for t, dd in zip(table, degrees, strict=True)) == makespan
    return Degrees(least_degrees(table, makespan), makespan)


def fill_spare_ranks(table: np.ndarray, degrees: tuple[int, ...], num_ranks: int) -> tuple[int, ...]:
    """Give ranks left over after the optimum, one at a time, to the slowest group that one
    more rank makes strictly faster. The makespan cannot rise (no group gets slower);
    it spreads work off the near-critical groups, which makes the plan less sensitive to
    cost-model error than leaving the ranks idle."""
    spare = num_ranks - sum(degrees)
    out = list(degrees)
    heap = [(-float(table[i, d]), i) for i, d in enumerate(out)]
    heapq.heapify(heap)
    while spare > 0 and heap:
        neg, i = heapq.heappop(heap)
        d = out[i]
        if d + 1 <= num_ranks and table[i, d + 1] < -neg:
            out[i] = d + 1
            spare -= 1
            heapq.heappush(heap, (-float(table[i, d + 1]), i))
    return tuple(out)
