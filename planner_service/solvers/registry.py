"""One mapping from strategy name to solver, and the entry point ``solve``.

Every strategy has the same signature ``(doc_lengths, request) -> Layout``: a pure
function of the (already truncated) lengths and the request's options.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from planner_service.core.build import Layout, build_plan
from planner_service.core.plan import Plan
from planner_service.core.request import PlanRequest
from planner_service.core.validate import validate_plan
from planner_service.solvers.baselines import llama3_layout, per_doc_layout, ring_layout
from planner_service.solvers.flashcp import flashcp_layout

Solver = Callable[[Sequence[int], PlanRequest], Layout]


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    name: str
    description: str
    solver: Solver
    comm_mode: str
    """The exchange this strategy's runtime uses unless the request overrides it."""
    options: Mapping[str, str] = field(default_factory=dict)
    """Strategy-specific request options: name -> description."""


STRATEGIES: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Add a strategy; names are unique."""
    assert strategy.name not in STRATEGIES, f"strategy {strategy.name} registered twice"
    STRATEGIES[strategy.name] = strategy
    return strategy


def get_strategy(name: str) -> Strategy:
    """Look up a strategy; raises ValueError listing the valid names."""
    _load_optional()
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"strategy {name!r} is unknown; valid: {', '.join(sorted(STRATEGIES))}"
        ) from None


def strategy_names() -> list[str]:
    _load_optional()
    return sorted(STRATEGIES)


def solve(request: PlanRequest, *, check: bool = True) -> Plan:
    """Plan one request: truncate explicitly if asked, run the strategy, measure, validate.

    Raises ValueError for bad input (unknown strategy, bad options) and PlanError if the
    strategy produced an invalid plan (a bug; ``check=False`` skips that self-check).
    """
    strategy = get_strategy(request.strategy)
    unknown = set(request.options) - set(strategy.options)
    if unknown:
        raise ValueError(
            f"options {sorted(unknown)} are not options of strategy {strategy.name!r}; "
            f"valid: {sorted(strategy.options) or 'none'}"
        )
    doc_lengths, truncated = request.packed()
    layout = strategy.solver(doc_lengths, request)
    if truncated:
        layout = Layout(layout.groups, {**layout.info, "truncated_tokens": truncated})
    plan = build_plan(
        layout,
        strategy=strategy.name,
        cp_size=request.cp_size,
        doc_lengths=doc_lengths,
        context_length=request.context_length,
        # A solver that chooses the exchange itself (auto) names it in its info.
        comm_mode=request.comm_mode or layout.info.get("comm_mode") or strategy.comm_mode,
        model=request.model,
        kernel=request.kernel,
        link=request.link,
    )
    if check:
        validate_plan(plan)
    return plan


class Solved(NamedTuple):
    plan: Plan
    solve_ms: float
    """Wall time of ``solve``; kept outside the plan so plans stay byte-identical."""


def timed_solve(request: PlanRequest, *, check: bool = True) -> Solved:
    start = time.perf_counter()
    plan = solve(request, check=check)
    return Solved(plan, (time.perf_counter() - start) * 1e3)


def _load_optional() -> None:
    """Import strategy modules that register themselves (ilp, fcp, auto) if present."""
    import importlib

    for module in (
        "planner_service.solvers.ilp",
        "planner_service.solvers.fcp_strategy",
        "planner_service.solvers.auto",
    ):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


register(
    Strategy(
        name="llama3",
        description="Llama 3 CP: packed sequence in 2N equal chunks, chunk i and 2N-1-i on rank i; full all-gather",
        solver=llama3_layout,
        comm_mode="full",
    )
)
register(
    Strategy(
        name="per_doc",
        description="Per-Doc CP (WLB-LLM): every doc in 2N chunks, zigzag per doc; full all-gather",
        solver=per_doc_layout,
        comm_mode="full",
    )
)
register(
    Strategy(
        name="ring",
        description="Ring attention: packed sequence in N contiguous chunks; P2P ring exchange",
        solver=ring_layout,
        comm_mode="p2p_ring",
    )
)
register(
    Strategy(
        name="zigzag",
        description="Zigzag ring attention (ring-flash-attention varlen): per-doc zigzag; P2P ring exchange",
        solver=per_doc_layout,
        comm_mode="p2p_ring",
    )
)
register(
    Strategy(
        name="flashcp",
        description="FlashCP Algorithm 1: LPT whole docs, adaptive Whole-Doc splits, Per-Doc for the "
        "longest docs until imbalance <= R; compact exchange",
        solver=flashcp_layout,
        comm_mode="alltoallv",
    )
)
