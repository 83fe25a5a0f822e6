"""Side-by-side evaluation of strategies over one or many sequences (CLI, benchmarks)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from planner_service.core.plan import Plan
from planner_service.core.request import PlanRequest
from planner_service.solvers.registry import timed_solve

SolveFn = Callable[[PlanRequest], tuple[Plan, float]]
"""request -> (plan, solve_ms); local by default, a service call with ``--url``."""


def _local(request: PlanRequest) -> tuple[Plan, float]:
    solved = timed_solve(request, check=False)
    return solved.parsed(), solved.solve_ms


class StrategySummary(NamedTuple):
    """Figures of one strategy over a set of sequences (means unless named otherwise)."""

    strategy: str
    num_sequences: int
    imbalance_mean: float
    imbalance_p99: float
    saving: float
    """comm_saving in the strategy's own comm mode."""
    saving_allgather: float
    """Compact all-gather, padded, vs full exchange."""
    saving_alltoallv: float
    est_step_ms: float
    """Mean per-layer forward+backward estimate."""
    solve_ms_median: float
    solve_ms_p99: float


def summarize(
    strategy: str,
    sequences: Iterable[Sequence[int]],
    base: PlanRequest,
    *,
    on_plan: Callable[[int, object], None] | None = None,
    solve: SolveFn = _local,
) -> StrategySummary:
    """Plan every sequence with ``strategy`` (other fields from ``base``) and summarise."""
    imb, sav, sag, sa2, est, t = [], [], [], [], [], []
    for i, seq in enumerate(sequences):
        request = replace(base, doc_lengths=tuple(seq), strategy=strategy)
        plan, solve_ms = solve(request)
        m = plan.metrics
        imb.append(m.imbalance)
        sav.append(m.comm_saving)
        sag.append(m.comm_saving_allgather)
        sa2.append(m.comm_saving_alltoallv)
        est.append(m.est_step_ms)
        t.append(solve_ms)
        if on_plan is not None:
            on_plan(i, plan)
    return StrategySummary(
        strategy=strategy,
        num_sequences=len(imb),
        imbalance_mean=float(np.mean(imb)),
        imbalance_p99=float(np.percentile(imb, 99)),
        saving=float(np.mean(sav)),
        saving_allgather=float(np.mean(sag)),
        saving_alltoallv=float(np.mean(sa2)),
        est_step_ms=float(np.mean(est)),
        solve_ms_median=float(np.median(t)),
        solve_ms_p99=float(np.percentile(t, 99)),
    )


def summarize_strategies(
    strategies: Sequence[str],
    sequences: Sequence[Sequence[int]],
    base: PlanRequest,
    solve: SolveFn = _local,
) -> list[StrategySummary]:
    """One summary per strategy, the same sequences for each."""
    return [summarize(s, sequences, base, solve=solve) for s in strategies]
