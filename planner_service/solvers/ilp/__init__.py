"""Strategy ``ilp``: exact block placement with OR-Tools CP-SAT (see :mod:`.strategy`).

Modules: :mod:`.strategy` (options, entry point ``ilp_layout``), :mod:`.bounded` (the
same held to ``max_kv_tokens_per_rank``: ``bounded_ilp_layout``, the registry's entry),
:mod:`.search` (the comm objective's steps), :mod:`.subproblems` (the smaller models it
solves), :mod:`.cpsat` (deterministic CP-SAT under a wall-clock guard), :mod:`.tuning`
(how the time limit is shared), and the models: :mod:`.blocks`, :mod:`.model`, :mod:`.relax`, :mod:`.ends`,
:mod:`.fill`, :mod:`.lns`.
"""

import importlib.util

if importlib.util.find_spec("ortools") is None:
    raise ImportError("strategy 'ilp' needs OR-Tools: pip install 'cp-planner[ilp]'")

from planner_service.solvers.ilp.bounded import bounded_ilp_layout
from planner_service.solvers.ilp.search import PROGRESS
from planner_service.solvers.ilp.strategy import (
    OPTIONS,
    IlpOptions,
    IlpResult,
    head_docs,
    ilp_layout,
    parse_options,
    solve_blocks,
    workload_cap,
)
from planner_service.solvers.ilp.tuning import TUNING, Tuning

__all__ = [
    "OPTIONS",
    "PROGRESS",
    "TUNING",
    "IlpOptions",
    "IlpResult",
    "Tuning",
    "bounded_ilp_layout",
    "head_docs",
    "ilp_layout",
    "parse_options",
    "solve_blocks",
    "workload_cap",
]
