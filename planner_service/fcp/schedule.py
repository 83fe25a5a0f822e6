"""FCP's global-batch planner: micro-batches, groups and degrees (no plans).

``plan_global_batch`` splits a global batch into micro-batches of at most ``N * E``
tokens (the paper's micro-batch planner) and runs stage 1 + stage 2 on each;
``planner_service.solvers.fcp_schedule.schedule`` adds rank ranges and one validated Plan
per micro-batch.

Splitting: cost-balanced packing (LPT, packing.balanced_pack) into micro-batches of
``N * E`` tokens, so long sequences spread over the micro-batches. The count is chosen
among the least that holds the tokens and the next two (a micro-batch filled to the last
token leaves stage 1 no slack, and one dominant sequence may want a micro-batch with
fewer others). ``search="paper"``: every count is solved, the least total wins.
``search="portfolio"``: every count is screened by the least estimates of its
static-degree groupings and one group, only the best count is solved (latency;
portfolio.choose_split), and the bound it keeps within is the static baseline's total on
its own best count, as reference_comparison.py measures it.

Complexity, K sequences on N ranks: per micro-batch count tried (at most
``MAX_EXTRA_MICRO_BATCHES + 1``), the split O(K log K) (LPT with a heap), then per
micro-batch stage 1 O(K log K) per candidate grouping and stage 2 O((G + N) log N) per
candidate of G groups (``grouping.py``, ``times.py``); the paper's DP check O(G N^2) only
where G N^2 is within ``grouping.DP_CHECK_WORK``. No dense (K, N) table is built above
``times.DENSE_LIMIT`` entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from planner_service.core.mask import CAUSAL, AttentionMask
from planner_service.core.request import MAX_FCP_RANKS, MAX_TOKENS, check_int
from planner_service.fcp.cost_model import DEFAULT_PROFILE, FcpProfile, get_profile
from planner_service.fcp.grouping import (
    Grouping,
    Scored,
    best,
    check_options,
    finish,
    memory_error,
    redo_with_dp,
)
from planner_service.fcp.packing import balanced_pack, descending
from planner_service.fcp.portfolio import choose_split, score_static, static_total
from planner_service.fcp.requests import check_sequences
from planner_service.fcp.seq_stats import SeqStats, mask_units, serial_cost

MAX_EXTRA_MICRO_BATCHES = 2
"""Micro-batch counts tried: the least that holds the tokens and the next two."""


def sequence_stats(
    sequences: Sequence[Sequence[int]], full_attention: Sequence[bool], profile: FcpProfile,
    mask: AttentionMask = CAUSAL,
) -> SeqStats:
    """Tokens and attention units (eq. 8: ``(1 + eta) sum L^2``; under a ``mask`` not
    causal, the layer mean of the windowed units, ``seq_stats.mask_units``) of every
    sequence. Raises ValueError for ``full_attention`` with such a mask."""
    lengths = np.fromiter((x for s in sequences for x in s), dtype=np.float64)
    starts = np.cumsum([0] + [len(s) for s in sequences[:-1]])
    tokens = np.add.reduceat(lengths, starts).astype(np.int64)
    if not mask.is_causal:
        if any(full_attention):
            raise ValueError("full_attention: not supported with a sliding-window mask")
        return SeqStats(tokens, np.add.reduceat(mask_units(lengths, mask), starts))
    units = np.add.reduceat(lengths * lengths, starts)
    if any(full_attention):
        units = units * (1.0 + profile.eta_full * np.asarray(full_attention, dtype=np.float64))
    return SeqStats(tokens, units)


def split_micro_batches(
    stats: SeqStats, count: int, capacity: int, profile: FcpProfile
) -> list[list[int]] | None:
    """LPT by cost into ``count`` micro-batches of ``capacity`` tokens; None if one does
    not fit. Micro-batches hold ascending sequence ids; empty ones are dropped."""
    costs = serial_cost(stats, profile)
    bins, left = balanced_pack(descending(costs, range(len(costs))), costs, stats.tokens,
                               count, capacity)
    if left:
        return None
    return [sorted(mb) for mb in bins if mb]


class GlobalSchedule(NamedTuple):
    """FCP's groups and degrees for every micro-batch of a global batch."""

    micro_batches: tuple[tuple[int, ...], ...]
    groupings: tuple[Grouping, ...]

    @property
    def makespan_ms(self) -> float:
        return sum(g.makespan_ms for g in self.groupings)


def plan_global_batch(
    sequences: Sequence[Sequence[int] | int],
    *,
    num_ranks: int,
    memory_tokens: int,
    profile: str | FcpProfile = DEFAULT_PROFILE,
    full_attention: Sequence[bool] = (),
    search: str = "portfolio",
    method: str = "dp",
    micro_batches: int | None = None,
    mask: AttentionMask = CAUSAL,
) -> GlobalSchedule:
    """Split into micro-batches that fit ``N * E`` tokens and schedule each (no plans).

    ``micro_batches`` fixes the count; None picks it (module docstring). ``mask``: the
    attention units are the layer-weighted windowed ones (``sequence_stats``). Raises
    ValueError saying how many ranks or how much memory is missing if a sequence exceeds
    ``N * E`` or the fixed count cannot hold the batch, for a bad search or method, and
    (FieldError) for ``num_ranks`` outside 1 .. ``MAX_FCP_RANKS`` or ``memory_tokens``
    outside 1 .. ``MAX_TOKENS``.
    """
    check_int(num_ranks, "num_ranks", 1, MAX_FCP_RANKS)
    check_int(memory_tokens, "memory_tokens", 1, MAX_TOKENS)
    return plan_checked(
        check_sequences(sequences), num_ranks=num_ranks, memory_tokens=memory_tokens,
        profile=get_profile(profile), full_attention=full_attention, search=search,
        method=method, micro_batches=micro_batches, mask=mask,
    )


def plan_checked(
    seqs: tuple[tuple[int, ...], ...],
    *,
    num_ranks: int,
    memory_tokens: int,
    profile: FcpProfile,
    full_attention: Sequence[bool],
    search: str,
    method: str,
    micro_batches: int | None,
    mask: AttentionMask = CAUSAL,
) -> GlobalSchedule:
    """``plan_global_batch`` for sequences already checked (a ScheduleRequest's)."""
    check_options(search, method)
    prof = profile
    stats = sequence_stats(seqs, full_attention, prof, mask)
    capacity = num_ranks * memory_tokens
    longest = int(np.argmax(stats.tokens))
    if stats.tokens[longest] > capacity:
        raise memory_error(int(stats.tokens[longest]), num_ranks, memory_tokens, f"sequences[{longest}]")
    total = int(stats.tokens.sum())
    least = -(-total // capacity)
    if micro_batches is not None:
        counts = [micro_batches]
    else:
        counts = list(range(least, min(len(seqs), least + MAX_EXTRA_MICRO_BATCHES) + 1))
    splits = {}
    for count in counts:
        split = split_micro_batches(stats, count, capacity, prof)
        if split is not None:
            splits[count] = split
    if not splits and micro_batches is None:
        # Bin packing may need more micro-batches than the token bound: one more each time.
        count = counts[-1] + 1
        while count not in splits:
            split = split_micro_batches(stats, count, capacity, prof)
            if split is not None:
                splits[count] = split
            count += 1
    if not splits:
        assert micro_batches is not None, "the fallback loop always finds a split"
        raise memory_error(total, num_ranks * micro_batches, memory_tokens,
                           f"the batch split into micro_batches={micro_batches}")

    def solve(count: int, static: Sequence[Sequence[Scored]] = (),
              bound: float | None = None) -> list[Grouping]:
        chosen = choose_split(stats, splits[count], num_ranks, memory_tokens, prof,
                              search=search, static=static, bound=bound)
        return [finish(c, num_ranks, "threshold") for c in chosen]

    if search == "paper":
        solved = {count: solve(count) for count in splits}
    else:
        static = {count: score_static(stats, split, num_ranks, memory_tokens, prof)
                  for count, split in splits.items()}
        screen = {count: sum(best(s).found.makespan_ms for s in static[count])
                  for count in splits}
        count = min(splits, key=lambda c: (screen[c], c))
        # The static reference picks its own best count (reference_comparison.py), so the
        # bound does too.
        bound = min(static_total(stats, splits[c], static[c], num_ranks, memory_tokens, prof)
                    for c in splits)
        solved = {count: solve(count, static=static[count], bound=bound)}
    chosen = min(solved, key=lambda c: (sum(g.makespan_ms for g in solved[c]), c))
    found = GlobalSchedule(tuple(tuple(mb) for mb in splits[chosen]), tuple(solved[chosen]))
    if method == "threshold":
        return found
    return found._replace(groupings=tuple(
        redo_with_dp(g, stats, num_ranks, memory_tokens, prof) for g in found.groupings
    ))
