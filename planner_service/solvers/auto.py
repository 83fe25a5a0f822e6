"""Strategy ``auto``: the candidate layout with the lowest estimated step time.

Candidates are compared under one exchange, the exact all-to-all-v (the runtime runs it
for any layout), so the choice reflects the layout alone: balance, the KV its shards
need and kernel efficiency. Ties go to the earlier candidate. The candidates are looked up with the ``lookup`` the
caller passes (the registry's ``get_strategy``), so this module does not import the
registry that lists it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from planner_service.core.build import Layout, build_plan
from planner_service.core.request import PlanRequest
from planner_service.solvers.fcp_strategy import Intra

CANDIDATES = ("flashcp", "per_doc", "llama3")


def auto_layout(doc_lengths: Sequence[int], request: PlanRequest, *,
                lookup: Callable[[str], Intra]) -> Layout:
    """The candidate layout with the lowest estimated step time (module docstring)."""
    best: tuple[float, str, Layout] | None = None
    for name in CANDIDATES:
        layout = lookup(name).solver(doc_lengths, replace(request, strategy=name, options={}))
        plan = build_plan(
            layout,
            strategy=name,
            cp_size=request.cp_size,
            doc_lengths=doc_lengths,
            context_length=request.context_length,
            comm_mode=request.comm_mode or "alltoallv",
            model=request.model,
            kernel=request.kernel,
            link=request.link,
        )
        if best is None or plan.metrics.est_step_ms < best[0]:
            best = (plan.metrics.est_step_ms, name, layout)
    assert best is not None
    return Layout(
        best[2].groups, {**best[2].info, "chosen": best[1], "candidates": list(CANDIDATES)}
    )


DESCRIPTION = ("The layout among flashcp, per_doc and llama3 with the lowest estimated step "
               "time (compared under all-to-all-v)")
COMM_MODE = "alltoallv"
