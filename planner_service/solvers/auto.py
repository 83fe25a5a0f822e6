"""Strategy ``auto``: the (strategy, comm mode) with the least predicted step time.

Every candidate strategy is solved and measured under every exchange the runtime executes
(or only the request's ``comm_mode`` when it names one), each (strategy, mode) on its own
since a strategy's objective may follow the exchange (flashcp's does), with the request's
model, kernel and link profiles (core/step_time.py). The least ``est_step_ms`` wins, ties
going to the earlier candidate (CANDIDATES order, then MODES order). ``p2p_ring`` is not a
separate candidate: the step-time model prices it as the full all-gather. The plan's info
records the choice and every candidate's prediction. Cost: one solve and one metrics pass
(O(shards + tiles)) per (strategy, mode). The candidates are looked up with the ``lookup``
the caller passes (the registry's ``get_strategy``), so this module does not import the
registry that lists it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from planner_service.core.build import Layout, build_plan
from planner_service.core.request import PlanRequest
from planner_service.solvers.fcp_strategy import Intra

CANDIDATES = ("flashcp", "per_doc", "llama3", "zigzag", "ring")
MODES = ("alltoallv", "compact_allgather", "full")
"""The exchanges the runtime executes (worker_runtime/layout.py COMM_MODES)."""


def auto_layout(doc_lengths: Sequence[int], request: PlanRequest, *,
                lookup: Callable[[str], Intra]) -> Layout:
    """The least predicted (strategy, comm mode) layout (module docstring)."""
    modes = (request.comm_mode,) if request.comm_mode else MODES
    best: tuple[float, str, str, Layout] | None = None
    predictions = []
    for name in CANDIDATES:
        for mode in modes:
            # Solved per exchange: a strategy's objective may follow comm_mode (flashcp's does).
            layout = lookup(name).solver(
                doc_lengths, replace(request, strategy=name, comm_mode=mode, options={}))
            metrics = build_plan(
                layout,
                strategy=name,
                cp_size=request.cp_size,
                doc_lengths=doc_lengths,
                context_length=request.context_length,
                comm_mode=mode,
                model=request.model,
                kernel=request.kernel,
                link=request.link,
            ).metrics
            predictions.append({"strategy": name, "comm_mode": mode, "est_step_ms": metrics.est_step_ms})
            if best is None or metrics.est_step_ms < best[0]:
                best = (metrics.est_step_ms, name, mode, layout)
    assert best is not None
    _, name, mode, layout = best
    return Layout(
        layout.groups,
        {
            **layout.info,
            "chosen": name,
            "comm_mode": mode,
            "kernel_profile": request.kernel,
            "link_profile": request.link,
            "candidates": predictions,
        },
    )

