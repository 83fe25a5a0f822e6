"""Slow references for tests on tiny inputs: exhaustive degrees and exhaustive groupings.

* ``brute_degrees``: every degree vector (d_i >= 1, sum <= N) of fixed atomic groups;
  what stage 2 (the DP) must match exactly.
* ``brute_optimum``: every partition of the sequences into groups and every degree
  vector of each partition; the true optimum of the FCP problem (eq. 2-6), which the
  two-stage heuristic approximates.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from planner_service.fcp.cost_model import FcpProfile
from planner_service.fcp.dp import Degrees
from planner_service.fcp.grouping import group_table
from planner_service.fcp.seq_stats import SeqStats


def brute_degrees(table: np.ndarray) -> Degrees:
    """Least makespan over all degree vectors of the (K, N + 1) table (inf if none)."""
    k, n = table.shape[0], table.shape[1] - 1
    best = Degrees((), float("inf"))
    for degrees in itertools.product(range(1, n + 1), repeat=k):
        if sum(degrees) > n:
            continue
        makespan = max((float(table[i, d]) for i, d in enumerate(degrees)), default=0.0)
        if makespan < best.makespan_ms:
            best = Degrees(degrees, makespan)
    return best


def set_partitions(items: Sequence[int]) -> Iterator[list[list[int]]]:
    """Every partition of ``items`` into non-empty blocks (Bell number many)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        for i in range(len(partition)):
            yield partition[:i] + [[first, *partition[i]]] + partition[i + 1 :]
        yield [[first], *partition]


class Optimum(NamedTuple):
    groups: tuple[tuple[int, ...], ...]
    degrees: tuple[int, ...]
    makespan_ms: float


def brute_optimum(
    stats: SeqStats, items: Sequence[int], num_ranks: int, memory_tokens: int,
    profile: FcpProfile,
) -> Optimum:
    """The optimal grouping and degrees of one micro-batch, by exhaustion."""
    best = Optimum((), (), float("inf"))
    for partition in set_partitions(list(items)):
        if len(partition) > num_ranks:
            continue
        found = brute_degrees(group_table(stats, partition, num_ranks, memory_tokens, profile))
        if found.makespan_ms < best.makespan_ms:
            best = Optimum(tuple(tuple(g) for g in partition), found.degrees, found.makespan_ms)
    return best
