"""A held split: every micro-batch's grouping, chosen for the split as a whole.

``search="paper"``: the best of the paper's stage-1 groupings in every micro-batch.

``search="portfolio"`` (the default) also scores the groupings a static power-of-two
degree would run (grouping.static_family, degrees re-chosen by stage 2). They are there
for one promise, that FCP is never worse than the static baseline, and are used only when
that promise needs them (``keep_paper``): every micro-batch runs the paper's grouping
unless the split's total would then exceed ``bound``, the static baseline's total (the
best power-of-two degree for the whole batch, waves included: ``static_total``, the
figure reference_schedules.best_static and reference_comparison.py give); then
micro-batches switch to their least estimate over both families, largest saving first,
until the total is within it.

Why not the least estimate in every micro-batch: it arbitrates between groupings of
different shape whose estimates often lie a few percent apart (a static-8 and a static-4
grouping, or one of the paper's), so with every coefficient off by up to 20% about a
fifth of the sequences moved to another degree (79.8% kept; this rule keeps 97%, bench
section 4). The paper's grouping is built from token counts and moves little, and the
static bound is a whole batch away, so noise rarely crosses it. The price: where the
static family beats the paper's grouping without the batch losing to the baseline, its
lower estimate is not taken (bench section 1, the `least` column).

The bound is always reached when the baseline's best degree runs each micro-batch of its
best split in one wave: a micro-batch's least estimate is at most that degree's time
there, and plan_global_batch takes the count whose static-family least estimates sum
lowest. When waves make the bound unreachable, the least estimates are kept; bench
section 1 measures the outcome, and FCP against the power-of-two greedy baseline, which
is not part of the bound.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner_service.fcp.cost_model import FcpProfile
from planner_service.fcp.grouping import (
    Grouping,
    Scored,
    best,
    check_options,
    finish,
    memory_error,
    paper_groupings,
    score,
    static_degree,
    static_family,
)
from planner_service.fcp.reference_schedules import powers_of_two, static_schedule
from planner_service.fcp.seq_stats import SeqStats

Split = Sequence[Sequence[int]]
"""Micro-batches of a global batch: sequence ids of each."""


def score_paper(
    stats: SeqStats, split: Split, num_ranks: int, memory_tokens: int, profile: FcpProfile
) -> list[list[Scored]]:
    """The paper's stage-1 groupings of every micro-batch, scored by stage 2."""
    return [score(stats, paper_groupings(stats, mb, num_ranks, memory_tokens, profile),
                  num_ranks, memory_tokens, profile) for mb in split]


def score_static(
    stats: SeqStats, split: Split, num_ranks: int, memory_tokens: int, profile: FcpProfile
) -> list[list[Scored]]:
    """The static-degree groupings (and one group) of every micro-batch, scored by stage 2."""
    return [score(stats, static_family(stats, mb, num_ranks, memory_tokens, profile),
                  num_ranks, memory_tokens, profile) for mb in split]


def static_total(
    stats: SeqStats, split: Split, static: Sequence[Sequence[Scored]], num_ranks: int,
    memory_tokens: int, profile: FcpProfile,
) -> float:
    """The static baseline's total makespan on ``split``; inf if no degree holds it.

    The least over powers of two c that hold the longest sequence of the sum over
    micro-batches of c's makespan there: its ``static_family`` candidate's groups all at
    degree c when they fit one wave (``static``, already scored), else
    reference_schedules.static_schedule with its further waves. This is what
    reference_schedules.best_static returns, without packing the one-wave degrees again.
    """
    longest = max(int(stats.tokens[list(mb)].max()) for mb in split)
    totals = []
    for degree in powers_of_two(num_ranks):
        if degree * memory_tokens < longest:
            continue
        total = 0.0
        for mb, scored in zip(split, static, strict=True):
            one_wave = [c for c in scored if static_degree(c.name, num_ranks) == degree]
            if one_wave:
                total += float(one_wave[0].times.column(degree).max())
            else:
                found = static_schedule(stats, mb, num_ranks, memory_tokens, profile, degree)
                assert found is not None, "the degree holds the longest sequence"
                total += found.makespan_ms
        totals.append(total)
    return min(totals, default=float("inf"))


def keep_paper(
    paper: Sequence[Sequence[Scored]], static: Sequence[Sequence[Scored]], bound: float
) -> list[Scored]:
    """The portfolio rule (module docstring) for the micro-batches of one split.

    Each micro-batch starts on its best paper grouping (its least estimate if the paper
    has none); while the total exceeds ``bound``, the micro-batch that saves most by
    moving to its least estimate over both families moves.
    """
    least = [best([*p, *s]) for p, s in zip(paper, static, strict=True)]
    chosen = [best(p) if p else low for p, low in zip(paper, least, strict=True)]
    saving = [c.found.makespan_ms - low.found.makespan_ms
              for c, low in zip(chosen, least, strict=True)]
    total = sum(c.found.makespan_ms for c in chosen)
    for k in sorted(range(len(chosen)), key=lambda k: (-saving[k], k)):
        if total <= bound:
            break
        total -= saving[k]
        chosen[k] = least[k]
    return chosen


def choose_split(
    stats: SeqStats, split: Split, num_ranks: int, memory_tokens: int, profile: FcpProfile,
    *, search: str, static: Sequence[Sequence[Scored]] = (), bound: float | None = None,
) -> list[Scored]:
    """The chosen candidate of every micro-batch. For the portfolio, ``static`` holds the
    split's ``score_static`` (scored here if empty) and ``bound`` defaults to
    ``static_total`` of this split."""
    paper = score_paper(stats, split, num_ranks, memory_tokens, profile)
    if search == "paper":
        return [best(p) for p in paper]
    if not static:
        static = score_static(stats, split, num_ranks, memory_tokens, profile)
    if bound is None:
        bound = static_total(stats, split, static, num_ranks, memory_tokens, profile)
    return keep_paper(paper, static, bound)


def solve_split(
    stats: SeqStats, split: Split, num_ranks: int, memory_tokens: int, profile: FcpProfile,
    *, search: str = "portfolio", method: str = "dp", bound: float | None = None,
) -> list[Grouping]:
    """Stage 1 + stage 2 for every micro-batch of a split held as given (not re-chosen);
    the portfolio keeps the split within ``bound`` (None: the static baseline on it;
    0: the least estimate in every micro-batch).

    Raises ValueError (naming what is missing) if a micro-batch's tokens exceed ``N * E``,
    and for an unknown ``search`` or ``method``.
    """
    check_options(search, method)
    for k, mb in enumerate(split):
        total = int(stats.tokens[list(mb)].sum())
        if total > num_ranks * memory_tokens:
            raise memory_error(total, num_ranks, memory_tokens,
                               f"micro-batch {k} of {len(mb)} sequences")
    chosen = choose_split(stats, split, num_ranks, memory_tokens, profile, search=search,
                          bound=bound)
    return [finish(c, num_ranks, method) for c in chosen]


def solve_micro_batch(
    stats: SeqStats, items: Sequence[int], num_ranks: int, memory_tokens: int,
    profile: FcpProfile, *, search: str = "portfolio", method: str = "dp",
) -> Grouping:
    """``solve_split`` of the one micro-batch ``items`` (the bound: the best static degree
    on it). Raises ValueError like ``solve_split``."""
    return solve_split(stats, [items], num_ranks, memory_tokens, profile, search=search,
                       method=method)[0]
