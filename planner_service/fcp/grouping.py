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
candidate is scored exactly by ``threshold_degrees``; the winner's degrees come from the
paper's DP (``method="dp"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple

import numpy as np

from planner_service.core.errors import FieldError
from planner_service.fcp.bfd import bfd_bins, bfd_headroom, merge_for_memory, pack_balanced
from planner_service.fcp.cost_model import FcpProfile, time_table
from planner_service.fcp.dp import Degrees, dp_degrees, fill_spare_ranks, threshold_degrees
from planner_service.fcp.headroom import fill_time_headroom
from planner_service.fcp.reference_schedules import static_groupings
from planner_service.fcp.seq_stats import SeqStats, serial_cost

SEARCHES = ("portfolio", "paper")
METHODS = ("dp", "threshold")


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
    flat = np.fromiter(chain.from_iterable(groups), dtype=np.int64)
    starts = np.cumsum([0] + [len(g) for g in groups[:-1]])
    tokens = np.add.reduceat(stats.tokens[flat], starts)
    units = np.add.reduceat(stats.units[flat], starts)
    return time_table(tokens, units, num_ranks, memory_tokens, profile)


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
        if threshold_degrees(group_table(stats, fixed, num_ranks, memory_tokens, profile)).degrees:
            return [("bfd", fixed)]
        return _merged(stats, fixed, num_ranks, memory_tokens)
    # The pool as one item: the LPT bound on r one-rank bins; inf below the token bound
    # (BFD by tokens stands in when the balanced packing does not fit, see pack_balanced).
    pool_tokens = int(stats.tokens[pool].sum())
    r = np.arange(num_ranks + 1, dtype=np.float64)
    r_use = np.minimum(np.maximum(r, 1.0), len(pool))
    bound = profile.beta1 + np.maximum(costs[pool].max(), costs[pool].sum() / r_use)
    bound[r * memory_tokens < pool_tokens] = np.inf
    table = np.vstack([group_table(stats, fixed, num_ranks, memory_tokens, profile), bound])
    first = threshold_degrees(table)
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
            stats, fixed, degrees, [table[g, d] for g, d in enumerate(degrees)], pool,
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
    if threshold_degrees(
        group_table(stats, fixed + pool_bins, num_ranks, memory_tokens, profile)
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
    table: np.ndarray


def score(
    stats: SeqStats, candidates: list[tuple[str, list[list[int]]]], num_ranks: int,
    memory_tokens: int, profile: FcpProfile,
) -> list[Scored]:
    """Stage 2 (threshold search) for each candidate; infeasible ones are dropped."""
    if not candidates:
        return []
    # One table for every candidate's groups, then an exact score per slice.
    tables = group_table(stats, [g for _, groups in candidates for g in groups], num_ranks,
                         memory_tokens, profile)
    out = []
    at = 0
    for name, groups in candidates:
        table = tables[at : at + len(groups)]
        at += len(groups)
        found = threshold_degrees(table)
        if found.degrees:
            out.append(Scored(found, name, groups, table))
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
    table = group_table(stats, groups, num_ranks, memory_tokens, profile)
    found = threshold_degrees(table)
    return finish(Scored(found, grouping.candidate, groups, table), num_ranks, "dp")


def finish(chosen: Scored, num_ranks: int, method: str) -> Grouping:
    """The Grouping of a scored candidate: DP check (``method="dp"``), spare ranks, order."""
    found, name, groups, table = chosen
    if method == "dp":
        exact = dp_degrees(table)
        assert exact.makespan_ms == found.makespan_ms, "DP and threshold search disagree"
        assert exact.degrees == found.degrees, "DP and threshold search pick different degrees"
    degrees = fill_spare_ranks(table, found.degrees, num_ranks)
    order = sorted(range(len(groups)), key=lambda g: (-degrees[g], min(groups[g])))
    return Grouping(
        groups=tuple(tuple(sorted(groups[g])) for g in order),
        degrees=tuple(degrees[g] for g in order),
        times_ms=tuple(float(table[g, degrees[g]]) for g in order),
        makespan_ms=found.makespan_ms,
        candidate=name,
    )
