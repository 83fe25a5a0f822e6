"""FCP against the reference schedules on one global batch, on the FCP cost model.

Every method sees the same micro-batch splits (schedule.split_micro_batches) and picks
its own best count among the least that holds the batch and the next three, so a
baseline is not penalised by FCP's choice of count. Static: the best power-of-two degree
for the whole batch; greedy: the power-of-two hybrid-CP greedy (reference_schedules.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from planner_service.fcp.cost_model import DEFAULT_PROFILE, FcpProfile, get_profile
from planner_service.fcp.reference_schedules import best_static, pow2_greedy_schedule
from planner_service.fcp.requests import check_sequences
from planner_service.fcp.schedule import (
    MAX_EXTRA_MICRO_BATCHES,
    GlobalSchedule,
    plan_global_batch,
    sequence_stats,
    split_micro_batches,
)


class FcpComparison(NamedTuple):
    """Estimated makespans (sum over micro-batches, ms per layer fwd+bwd)."""

    fcp_ms: float
    fcp_micro_batches: int
    static_ms: float
    static_degree: int
    static_micro_batches: int
    greedy_ms: float
    greedy_micro_batches: int
    fcp: GlobalSchedule

    @property
    def speedup_vs_static(self) -> float:
        return self.static_ms / self.fcp_ms

    @property
    def speedup_vs_greedy(self) -> float:
        return self.greedy_ms / self.fcp_ms


def compare_with_references(
    sequences: Sequence[Sequence[int] | int],
    *,
    num_ranks: int,
    memory_tokens: int,
    profile: str | FcpProfile = DEFAULT_PROFILE,
    full_attention: Sequence[bool] = (),
    search: str = "portfolio",
) -> FcpComparison:
    """FCP (its own count choice) vs best static degree vs power-of-two greedy.

    Raises ValueError like ``plan_global_batch`` when the memory cannot hold a sequence.
    """
    seqs = check_sequences(sequences)
    prof = get_profile(profile)
    fcp = plan_global_batch(seqs, num_ranks=num_ranks, memory_tokens=memory_tokens,
                            profile=prof, full_attention=full_attention, search=search)
    stats = sequence_stats(seqs, full_attention, prof)
    capacity = num_ranks * memory_tokens
    least = -(-int(stats.tokens.sum()) // capacity)
    static: tuple[float, int, int] | None = None
    greedy: tuple[float, int] | None = None
    for count in range(least, min(len(seqs), least + MAX_EXTRA_MICRO_BATCHES) + 1):
        split = split_micro_batches(stats, count, capacity, prof)
        if split is None:
            continue
        degree, schedules = best_static(stats, split, num_ranks, memory_tokens, prof)
        total = sum(s.makespan_ms for s in schedules)
        if static is None or total < static[0]:
            static = (total, degree, len(split))
        total = sum(
            pow2_greedy_schedule(stats, mb, num_ranks, memory_tokens, prof).makespan_ms
            for mb in split
        )
        if greedy is None or total < greedy[0]:
            greedy = (total, len(split))
    assert static is not None and greedy is not None, "FCP found a split, so do the references"
    return FcpComparison(
        fcp_ms=fcp.makespan_ms, fcp_micro_batches=len(fcp.micro_batches),
        static_ms=static[0], static_degree=static[1], static_micro_batches=static[2],
        greedy_ms=greedy[0], greedy_micro_batches=greedy[1], fcp=fcp,
    )
