"""Reference schedules FCP is compared with (reference_comparison.py), and which its
portfolio also tries as candidates: the same micro-batches, the same cost model.

* ``static_schedule`` / ``best_static``: one CP degree c (a power of two) for the whole
  global batch, as DeepSpeed-Ulysses or Megatron-LM would be tuned: N // c groups of c
  ranks; sequences go to groups cost-balanced (packing.balanced_pack, LPT quality: far
  better than a dataloader's order) within each group's memory ``c * E``; what fits
  nowhere runs in a further wave.
* ``pow2_greedy_schedule``: dynamic power-of-two degrees like Megatron-LM's hybrid CP
  scheduler (``BalancedCPScheduler``, Megatron-LM PR #2282): each sequence gets the
  smallest power of two >= its memory minimum (or N), longest first; it opens a new
  group while enough ranks are free, else joins the least-loaded group of its size that
  has memory left; sequences that fit nowhere wait for the next wave; free ranks finally
  double the slowest group that doubling speeds up (Megatron doubles the smallest).

Each wave is a set of disjoint groups; a schedule's makespan is the sum of its waves'.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

from planner_service.fcp.bfd import min_degrees
from planner_service.fcp.cost_model import FcpProfile, group_time
from planner_service.fcp.packing import balanced_pack, descending
from planner_service.fcp.seq_stats import SeqStats, serial_cost


class Wave(NamedTuple):
    """Groups that run at the same time: (member sequence ids, degree) each."""

    groups: tuple[tuple[tuple[int, ...], int], ...]
    makespan_ms: float


class ReferenceSchedule(NamedTuple):
    name: str
    waves: tuple[Wave, ...]

    @property
    def makespan_ms(self) -> float:
        return sum(w.makespan_ms for w in self.waves)


def _time(stats: SeqStats, members: Sequence[int], degree: int, profile: FcpProfile) -> float:
    idx = list(members)
    return group_time(float(stats.tokens[idx].sum()), float(stats.units[idx].sum()), degree,
                      profile).total_ms


def _wave(stats: SeqStats, groups: list[tuple[list[int], int]], profile: FcpProfile) -> Wave:
    groups = [(sorted(m), d) for m, d in groups if m]
    groups.sort(key=lambda g: (-g[1], g[0]))
    times = [_time(stats, m, d, profile) for m, d in groups]
    return Wave(tuple((tuple(m), d) for m, d in groups), max(times, default=0.0))


def powers_of_two(num_ranks: int) -> list[int]:
    return [1 << p for p in range(num_ranks.bit_length()) if 1 << p <= num_ranks]


def static_groupings(
    stats: SeqStats, items: Sequence[int], num_ranks: int, memory_tokens: int,
    profile: FcpProfile, degrees: Sequence[int] | None = None,
) -> dict[int, tuple[list[list[int]], list[int]]]:
    """For every power of two c <= N (or in ``degrees``) that holds the longest sequence:
    N // c cost-balanced groups of ``items`` (LPT) within ``c * E`` tokens each, and the
    items left for a later wave. (Pairing the groups of c into those of 2c would save
    passes but balances worse than packing each degree directly: measured 1-4% slower
    static schedules.)
    """
    if not items:
        return {}
    costs = serial_cost(stats, profile)
    order = descending(costs, items)
    longest = int(stats.tokens[list(items)].max())
    return {
        degree: balanced_pack(order, costs, stats.tokens, num_ranks // degree,
                              degree * memory_tokens)
        for degree in (powers_of_two(num_ranks) if degrees is None else degrees)
        if degree * memory_tokens >= longest
    }


def static_schedule(
    stats: SeqStats, items: Sequence[int], num_ranks: int, memory_tokens: int,
    profile: FcpProfile, degree: int,
) -> ReferenceSchedule | None:
    """Static degree ``degree``: waves of N // degree balanced groups (static_groupings);
    None if a sequence needs more than ``degree`` ranks of memory."""
    if any(int(stats.tokens[i]) > degree * memory_tokens for i in items):
        return None
    waves = []
    left = list(items)
    while left:
        members, left = static_groupings(stats, left, num_ranks, memory_tokens, profile,
                                         (degree,))[degree]
        waves.append(_wave(stats, [(m, degree) for m in members], profile))
    return ReferenceSchedule(f"static-{degree}", tuple(waves))


def best_static(
    stats: SeqStats, micro_batches: Sequence[Sequence[int]], num_ranks: int,
    memory_tokens: int, profile: FcpProfile,
) -> tuple[int, list[ReferenceSchedule]]:
    """The power-of-two degree with the least total makespan over all micro-batches.

    Raises ValueError if no power of two <= N holds the longest sequence.
    """
    best: tuple[float, int, list[ReferenceSchedule]] | None = None
    for degree in powers_of_two(num_ranks):
        schedules = [
            static_schedule(stats, mb, num_ranks, memory_tokens, profile, degree)
            for mb in micro_batches
        ]
        if any(s is None for s in schedules):
            continue
        done = [s for s in schedules if s is not None]
        total = sum(s.makespan_ms for s in done)
        if best is None or total < best[0]:
            best = (total, degree, done)
    if best is None:
        raise ValueError(
            f"no power-of-two CP degree <= num_ranks {num_ranks} holds the longest sequence "
            f"with memory_tokens {memory_tokens}"
        )
    return best[1], best[2]


def _pow2_at_least(value: int, num_ranks: int) -> int:
    p = 1 << max(0, int(value - 1).bit_length())
    return p if p <= num_ranks else num_ranks


def pow2_greedy_schedule(
    stats: SeqStats, items: Sequence[int], num_ranks: int, memory_tokens: int,
    profile: FcpProfile,
) -> ReferenceSchedule:
    """Megatron-style hybrid CP greedy (module docstring). Raises ValueError if a sequence
    needs more than N ranks of memory."""
    need = min_degrees(stats.tokens, memory_tokens)
    if any(int(need[i]) > num_ranks for i in items):
        raise ValueError("a sequence needs more than num_ranks ranks of memory")
    size = {i: _pow2_at_least(int(need[i]), num_ranks) for i in items}
    alone = {i: _time(stats, [i], size[i], profile) for i in items}
    waves = []
    left = list(items)
    while left:
        order = sorted(left, key=lambda i: (-alone[i], i))
        groups: list[list[int]] = []
        degree: list[int] = []
        tokens: list[int] = []
        by_size: dict[int, list[tuple[float, int]]] = {}
        free = num_ranks
        left = []
        for i in order:
            d, s = size[i], int(stats.tokens[i])
            if free >= d:
                g = len(groups)
                groups.append([i])
                degree.append(d)
                tokens.append(s)
                free -= d
                heapq.heappush(by_size.setdefault(d, []), (alone[i], g))
                continue
            heap = by_size.get(d, [])
            skipped = []
            while heap and tokens[heap[0][1]] + s > d * memory_tokens:
                skipped.append(heapq.heappop(heap))
            if heap:
                _, g = heapq.heappop(heap)
                groups[g].append(i)
                tokens[g] += s
                heapq.heappush(heap, (_time(stats, groups[g], d, profile), g))
            else:
                left.append(i)
            for entry in skipped:
                heapq.heappush(heap, entry)
        # Spread free ranks: double the slowest group while doubling helps and fits.
        while free > 0:
            options = [
                (_time(stats, groups[g], degree[g], profile), g)
                for g in range(len(groups))
                if degree[g] <= free
                and 2 * degree[g] <= num_ranks
                and _time(stats, groups[g], 2 * degree[g], profile)
                < _time(stats, groups[g], degree[g], profile)
            ]
            if not options:
                break
            _, g = max(options)
            free -= degree[g]
            degree[g] *= 2
        waves.append(_wave(stats, list(zip(groups, degree, strict=True)), profile))
    return ReferenceSchedule("pow2-greedy", tuple(waves))
