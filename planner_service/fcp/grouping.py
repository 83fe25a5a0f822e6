"""One micro-batch: candidate atomic groupings (stage 1), degrees for each (stage 2).

Stage 1 follows the paper: long sequences (``d_min >= 2``) open bins of ``d_min * E``
tokens and short ones are best-fitted into their headroom (``bfd_headroom``). The paper
leaves open what happens to the short sequences that fit no headroom when there are more
of them than ranks; here they form a *pool* that is packed, cost-balanced, into r
one-rank bins, with r chosen by a first stage-2 pass in which the pool is one item whose
time on r ranks is the LPT bound ``beta1 + max(max_i c_i, sum_i c_i / r)``; a second
candidate first moves pool sequences into the *time* slack that integer degrees leave in
the long groups (headroom.py). A short sequence heavier than a fair share of the batch
(``c_i > sum c / N``) stays its own atomic group, so it can get a degree above one. If the
minimum degrees still exceed N, groups are merged (``merge_for_memory``): a plan exists
whenever the tokens fit ``N * E``.

The candidates of ``search="portfolio"`` (the default) also include the groupings a
static power-of-two degree would use (``static_family``, and one group of all N ranks;
stage 2 re-chooses their degrees too); which candidate a micro-batch runs is decided for
the whole split (portfolio.py). ``search="paper"`` keeps only the BFD groupings. Every
candidate is scored exactly by stage 2 on the entries of its time table that count
(``times.window_degrees``, the optimum ``dp.threshold_degrees`` finds on the whole table);
with ``method="dp"`` the paper's DP (``dp.dp_degrees``, O(K N^2)) re-derives the winner's
degrees as a check where K N^2 is within ``DP_CHECK_WORK``.

Complexity per micro-batch of K sequences on N ranks: stage 1 is O(K log K) (sorts, BFD
and LPT with heaps) plus one stage-2 pass for the pool's bin count; stage 2 per candidate
grouping of G groups is O(G + N) to start plus the entries it reads (``times.py``: about
O(G + N) on FCP's batches, at most O(G (N - sum d_min + 1))); the spare ranks O((G + N)
log N).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple

import numpy as np

from planner_service.core.errors import FieldError
from planner_service.fcp.bfd import bfd_bins, bfd_headroom, merge_for_memory, pack_balanced
from planner_service.fcp.cost_model import FcpProfile, time_table
from planner_service.fcp.dp import Degrees, dp_degrees
from planner_service.fcp.headroom import fill_time_headroom
from planner_service.fcp.reference_schedules import static_groupings
from planner_service.fcp.seq_stats import SeqStats, serial_cost
from planner_service.fcp.times import Pool, Times, fill_spare, window_degrees

SEARCHES = ("portfolio", "paper")
METHODS = ("dp", "threshold")
DP_CHECK_WORK = 1 << 26
"""K N^2 up to which ``method="dp"`` re-derives the winner's degrees by the paper's DP."""


class Grouping(NamedTuple):
    """FCP's answer for one micro-batch."""

    groups: tuple[tuple[int, ...], ...]
    """Sequence ids of each CP group, ascending; groups by degree descending."""
    degrees: tuple[int, ...]
    times_ms: tuple[float, ...]
    """Estimated per-layer time of each group at its degree (eq. 10)."""
    makespan_ms: float
    candidate: str
    """Which stage-1 grouping won: ``bfd``, ``bfd+pool<r>``, ``bfd+fill<r>``, ``bfd+merge``,
    ``static-<c>`` or ``one-group``."""


def group_table(
    stats: SeqStats, groups: Sequence[Sequence[int]], num_ranks: int, memory_tokens: int,
    profile: FcpProfile,
) -> np.ndarray:
    """The (K, N + 1) time table of the groups (sums of their sequences' tokens and units)."""
    if not groups:
        return np.zeros((0, num_ranks + 1))
    times = group_times(stats, groups, num_ranks, memory_tokens, profile)
    return time_table(times.tokens, times.units, num_ranks, memory_tokens, profile)


def group_times(
    stats: SeqStats, groups: Sequence[Sequence[int]], num_ranks: int, memory_tokens: int,
    profile: FcpProfile, pool: Pool | None = None,
) -> Times:
    """The groups' times (``times.Times``: sums of their sequences' tokens and units),
    with ``pool`` as a last row if given. O(sequences)."""
    if not groups:
        return Times(np.zeros(0), np.zeros(0), num_ranks, memory_tokens, profile, pool)
    flat = np.fromiter(chain.from_iterable(groups), dtype=np.int64)
    starts = np.cumsum([0] + [len(g) for g in groups[:-1]])
    tokens = np.add.reduceat(stats.tokens[flat], starts)
    units = np.add.reduceat(stats.units[flat], starts)
    return Times(tokens, units, num_ranks, memory_tokens, profile, pool)


def memory_error(total: int, num_ranks: int, memory_tokens: int, what: str,
                 field: str = "memory_tokens") -> FieldError:
    """The error for a batch or sequence that N ranks of E tokens cannot hold (about
    ``field``, the request's memory_tokens)."""
    need_ranks = -(-total // memory_tokens)
    need_memory = -(-total // num_ranks)
    return FieldError(
        field,
        f"{what} holds {total} tokens, more than num_ranks x memory_tokens = "
        f"{num_ranks} x {memory_tokens} = {num_ranks * memory_tokens}: it needs num_ranks >= "
        f"{need_ranks} ({need_ranks - num_ranks} missing) or memory_tokens >= {need_memory} "
        f"({need_memory - memory_tokens} tokens per rank missing)"
    )


def paper_groupings(
    stats: SeqStats, items: Sequence[int], num_ranks: int, memory_tokens: int,
    profile: FcpProfile,
) -> list[tuple[str, list[list[int]]]]:
    """Stage 1 (module docstring): BFD into long-sequence headroom, the rest pooled."""
    bins, leftovers = bfd_headroom(stats.tokens, memory_tokens, items)
    costs = serial_cost(stats, profile)
    fair = float(costs[list(items)].sum()) / num_ranks
    fixed = bins + [[i] for i in leftovers if costs[i] > fair]
    pool = [i for i in leftovers if costs[i] <= fair]
    if not pool:
        if window_degrees(group_times(stats, fixed, num_ranks, memory_tokens, profile)).degrees:
            return [("bfd", fixed)]
        return _merged(stats, fixed, num_ranks, memory_tokens)
    # The pool as one item: the LPT bound on r one-rank bins; inf below the token bound
    # (BFD by tokens stands in when the balanced packing does not fit, see pack_balanced).
    pooled = Pool(float(costs[pool].max()), float(costs[pool].sum()), len(pool),
                  int(stats.tokens[pool].sum()))
    times = group_times(stats, fixed, num_ranks, memory_tokens, profile, pooled)
    first = window_degrees(times)
    if first.degrees:
        out = []
        packed = pack_balanced(stats.tokens, costs, pool, first.degrees[-1], memory_tokens)
        if packed is not None:
            out.append((f"bfd+pool{len(packed)}", fixed + packed))
        # Time headroom: the long groups at their degrees take short sequences into the
        # slack that integer degrees leave; the rest go to all remaining ranks.
        degrees = first.degrees[:-1]
        bins_count = num_ranks - sum(degrees)
        filled, rest = fill_time_headroom(
            stats, fixed, degrees, times.at(np.arange(len(degrees)), np.asarray(degrees)).tolist(),
            pool,
            bins_count, memory_tokens, profile, costs,
        )
        if len(rest) < len(pool):
            packed = pack_balanced(stats.tokens, costs, rest, min(bins_count, len(rest)),
                                   memory_tokens) if rest else []
            if packed is not None:
                out.append((f"bfd+fill{len(packed)}", filled + packed))
        if out:
            return out
    pool_bins = bfd_bins(stats.tokens, memory_tokens, pool)
    if window_degrees(
        group_times(stats, fixed + pool_bins, num_ranks, memory_tokens, profile)
    ).degrees:
        return [(f"bfd+pool{len(pool_bins)}", fixed + pool_bins)]
    return _merged(stats, fixed + pool_bins, num_ranks, memory_tokens)


def _merged(
    stats: SeqStats, groups: list[list[int]], num_ranks: int, memory_tokens: int
) -> list[tuple[str, list[list[int]]]]:
    merged = merge_for_memory(groups, stats.tokens, memory_tokens, num_ranks)
    return [] if merged is None else [("bfd+merge", merged)]


def static_family(
    stats: SeqStats, items: Sequence[int], num_ranks: int, memory_tokens: int,
    profile: FcpProfile,
) -> list[tuple[str, list[list[int]]]]:
    """The groupings a static CP degree c would run (``reference_schedules.static_groupings``, the
    very function the static baseline uses) for every power of two c < N that fits them
    in one wave, plus one group of all N ranks."""
    out = [("one-group", [sorted(items)])]
    for degree, (groups, left) in static_groupings(
        stats, items, num_ranks, memory_tokens, profile
    ).items():
        if not left and degree < num_ranks:
            out.append((f"static-{degree}", [g for g in groups if g]))
    return out


def static_degree(name: str, num_ranks: int) -> int | None:
    """The CP degree c of a ``static_family`` candidate called ``name`` (``static-<c>``;
    ``one-group``: N), or None for one of the paper's."""
    if name == "one-group":
        return num_ranks
    if name.startswith("static-"):
        return int(name.removeprefix("static-"))
    return None


class Scored(NamedTuple):
    """A candidate grouping with its exact stage-2 optimum."""

    found: Degrees
    name: str
    groups: list[list[int]]
    times: Times


def score(
    stats: SeqStats, candidates: list[tuple[str, list[list[int]]]], num_ranks: int,
    memory_tokens: int, profile: FcpProfile,
) -> list[Scored]:
    """Stage 2 (``times.window_degrees``) for each candidate; infeasible ones are dropped."""
    if not candidates:
        return []
    # Every candidate's groups summed at once, then an exact score per slice.
    every = group_times(stats, [g for _, groups in candidates for g in groups], num_ranks,
                        memory_tokens, profile)
    out = []
    at = 0
    for name, groups in candidates:
        times = Times(every.tokens[at : at + len(groups)], every.units[at : at + len(groups)],
                      num_ranks, memory_tokens, profile)
        at += len(groups)
        found = window_degrees(times)
        if found.degrees:
            out.append(Scored(found, name, groups, times))
    return out


def best(scored: Sequence[Scored]) -> Scored:
    """The least makespan; the first on ties (paper candidates are listed first)."""
    assert scored, "merge_for_memory always yields a feasible grouping"
    return min(scored, key=lambda c: c.found.makespan_ms)


def check_options(search: str, method: str, prefix: str = "") -> None:
    """Raise FieldError (``search`` or ``method``, after ``prefix``) for an unknown one."""
    for name, value, allowed in (("search", search, SEARCHES), ("method", method, METHODS)):
        if value not in allowed:
            raise FieldError(prefix + name, f"{prefix}{name} must be one of "
                             f"{', '.join(allowed)}, got {value!r}")


def redo_with_dp(
    grouping: Grouping, stats: SeqStats, num_ranks: int, memory_tokens: int, profile: FcpProfile
) -> Grouping:
    """The same grouping with degrees from the paper's DP (after a threshold screening)."""
    groups = [list(g) for g in grouping.groups]
    times = group_times(stats, groups, num_ranks, memory_tokens, profile)
    found = window_degrees(times)
    return finish(Scored(found, grouping.candidate, groups, times), num_ranks, "dp")


def finish(chosen: Scored, num_ranks: int, method: str) -> Grouping:
    """The Grouping of a scored candidate: DP check (``method="dp"``, where K N^2 is within
    ``DP_CHECK_WORK``), spare ranks, order."""
    found, name, groups, times = chosen
    if method == "dp" and times.k * num_ranks * num_ranks <= DP_CHECK_WORK:
        exact = dp_degrees(times.dense())
        assert exact.makespan_ms == found.makespan_ms, "DP and threshold search disagree"
        assert exact.degrees == found.degrees, "DP and threshold search pick different degrees"
    degrees = fill_spare(times, found.degrees, num_ranks)
    order = sorted(range(len(groups)), key=lambda g: (-degrees[g], min(groups[g])))
    final = times.at(np.arange(len(groups)), np.asarray(degrees, dtype=np.int64)).tolist()
    return Grouping(
        groups=tuple(tuple(sorted(groups[g])) for g in order),
        degrees=tuple(degrees[g] for g in order),
        times_ms=tuple(final[g] for g in order),
        makespan_ms=found.makespan_ms,
        candidate=name,
    )
