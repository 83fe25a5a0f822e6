"""FCP's intra-group plans, one solve per group, in worker processes where there are cores.

``solve_groups`` runs the intra strategy's solver on every group's request and returns the
layouts (or the group's ``KvBoundError``) in group order, so the result is the same
whatever the number of workers: each group's solve is deterministic and depends only on
its own request. Worker processes (forked, so they start in milliseconds and share the
imported code) are used only where they can pay off: more than one core, a batch of at
least ``PARALLEL_GROUPS`` groups and ``PARALLEL_TOKENS`` tokens, and a process allowed to
have children (the service's solver processes are daemons and solve their groups in
turn; the service runs requests in parallel already). Cost: the solves themselves, split
over the workers, plus pickling each group's request and shards, O(docs + shards).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor

from planner_service.core.build import Layout
from planner_service.core.request import PlanRequest
from planner_service.core.step_time import held_kv_mode
from planner_service.solvers.kv_bound import FIXED, KvBoundError, kv_floor, layout_peak, listed

Solver = Callable[[Sequence[int], PlanRequest], Layout]

MAX_WORKERS = 8
"""Worker processes at most (fewer on fewer cores)."""
PARALLEL_GROUPS = 64
"""Groups from which the solves go to worker processes."""
PARALLEL_TOKENS = 1 << 20
"""Tokens of the batch from which the solves go to worker processes."""


def group_plan(solver: Solver, request: PlanRequest, comm_mode: str | None) -> Layout | KvBoundError:
    """One group's layout, held to the request's KV bound in ``comm_mode`` (a layout over
    it, from a strategy whose plan does not depend on the bound, is that strategy's
    refusal, its peak the figure), or the refusal."""
    bound = request.max_kv_tokens_per_rank
    try:
        solved = solver(request.doc_lengths, request)
        if bound is not None:
            solved = listed(solved)
            assert comm_mode is not None, "a KV bound is measured in the plan's exchange"
            peak = layout_peak(solved, held_kv_mode(request.kernel, comm_mode))
            if peak > bound:
                raise KvBoundError(bound, peak, FIXED,
                                   kv_floor(request.doc_lengths, request.cp_size,
                                            held_kv_mode(request.kernel, comm_mode)))
    except KvBoundError as exc:
        return exc
    return solved


def default_workers(requests: Sequence[PlanRequest]) -> int:
    """Worker processes for these solves (module docstring): 1 where they would not pay."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if (not cores or cores < 2 or len(requests) < PARALLEL_GROUPS
            or multiprocessing.current_process().daemon
            or "fork" not in multiprocessing.get_all_start_methods()):
        return 1
    if sum(sum(r.doc_lengths) for r in requests) < PARALLEL_TOKENS:
        return 1
    return min(cores, MAX_WORKERS)


def _solve_chunk(solver: Solver, requests: Sequence[PlanRequest],
                 comm_mode: str | None) -> list[Layout | KvBoundError]:
    return [group_plan(solver, r, comm_mode) for r in requests]


def solve_groups(solver: Solver, requests: Sequence[PlanRequest], comm_mode: str | None,
                 workers: int | None = None) -> list[Layout | KvBoundError]:
    """``group_plan`` of every request, in order; on ``workers`` processes (None:
    ``default_workers``). The result does not depend on ``workers``."""
    count = default_workers(requests) if workers is None else max(1, workers)
    if count == 1 or len(requests) < 2:
        return _solve_chunk(solver, requests, comm_mode)
    # Contiguous chunks, a few per worker (groups differ in size), gathered in order.
    chunks = min(len(requests), 4 * count)
    bounds = [len(requests) * i // chunks for i in range(chunks + 1)]
    parts = [requests[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=count, mp_context=context) as pool:
        done = pool.map(_solve_chunk, [solver] * len(parts), parts, [comm_mode] * len(parts))
        return [layout for part in done for layout in part]
