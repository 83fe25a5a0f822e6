"""One table from strategy name to solver (``STRATEGIES``), and the entry point ``solve``.

Every strategy has the same signature ``(doc_lengths, request) -> Layout``: a pure
function of the (already truncated) lengths and the request's options. The fast
strategies (baselines, flashcp, flashcp_paper) are imported with this module; the slow
ones (ilp, fcp, auto) import their modules, and with them OR-Tools and pandas, on first
use (``prepare`` does it ahead of a timed solve).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from planner_service.core.build import Layout, build_plan
from planner_service.core.errors import FieldError
from planner_service.core.plan import Plan
from planner_service.core.request import PlanRequest
from planner_service.core.solved import SolvedPlan
from planner_service.core.validate import validate_plan
from planner_service.solvers.baselines import llama3_layout, per_doc_layout, ring_layout
from planner_service.solvers.contiguous_halo import contiguous_halo_layout
from planner_service.solvers.flashcp import paper_layout
from planner_service.solvers.flashcp_bounded import bounded_flashcp_layout
from planner_service.solvers.flashcp_masked import redeclared
from planner_service.solvers.gc_pause import paused_gc
from planner_service.solvers.kv_bound import FIELD as KV_FIELD
from planner_service.solvers.kv_bound import check_plan, listed

Solver = Callable[[Sequence[int], PlanRequest], Layout]

CAUSAL_BALANCERS = frozenset({"flashcp_paper"})
"""Strategies that take R but balance causal work: under a mask their plan's balance
declaration is recomputed from the layer-weighted work (``flashcp_masked.redeclared``);
flashcp, ilp, fcp and auto declare it themselves."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    name: str
    description: str
    solver: Solver
    comm_mode: str
    """The exchange this strategy's runtime uses unless the request overrides it."""
    options: Mapping[str, str] = field(default_factory=dict)
    """Strategy-specific request options: name -> description."""
    complexity: str = "search"
    """How its solve time grows: ``linear`` (fixed chunks, O(documents + ranks) on any
    input), ``heuristic`` (milliseconds on small inputs) or ``search`` (up to seconds: a
    solver, a portfolio or a search over other strategies)."""
    load: Callable[[], object] | None = None
    """Imports a slow strategy's module (``prepare``); None: imported with the registry."""


class _LazyOptions(Mapping[str, str]):
    """A slow strategy's options, read from its module on first use (so listing or
    checking options of another strategy never imports OR-Tools or pandas)."""

    def __init__(self, load: Callable[[], Mapping[str, str]]) -> None:
        self._load = load
        self._options: Mapping[str, str] | None = None

    def _get(self) -> Mapping[str, str]:
        if self._options is None:
            self._options = self._load()
        return self._options

    def __getitem__(self, key: str) -> str:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


# The slow strategies import their modules (OR-Tools, pandas) only when they solve.


def _ilp_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    from planner_service.solvers.ilp import bounded_ilp_layout

    return bounded_ilp_layout(doc_lengths, request)


def _ilp_options() -> Mapping[str, str]:
    from planner_service.solvers.ilp import OPTIONS

    return OPTIONS


def _fcp_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    from planner_service.solvers.fcp_strategy import fcp_layout

    return fcp_layout(doc_lengths, request, lookup=get_strategy)


def _fcp_options() -> Mapping[str, str]:
    from planner_service.solvers.fcp_strategy import OPTIONS

    return OPTIONS


def _auto_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    from planner_service.solvers.auto import auto_layout

    return auto_layout(doc_lengths, request, lookup=get_strategy)


def _auto_load() -> object:
    from planner_service.solvers import auto

    return auto


STRATEGIES: Mapping[str, Strategy] = {s.name: s for s in (
    Strategy(
        name="llama3",
        description="Llama 3 CP: packed sequence in 2N equal chunks, chunk i and 2N-1-i on rank i; "
        "full all-gather",
        solver=llama3_layout,
        comm_mode="full",
        complexity="linear",
    ),
    Strategy(
        name="per_doc",
        description="Per-Doc CP (WLB-LLM): every doc in 2N chunks, zigzag per doc; full all-gather",
        solver=per_doc_layout,
        comm_mode="full",
        complexity="heuristic",
    ),
    Strategy(
        name="ring",
        description="Ring attention: packed sequence in N contiguous chunks; P2P ring exchange",
        solver=ring_layout,
        comm_mode="p2p_ring",
        complexity="linear",
    ),
    Strategy(
        name="contiguous_halo",
        description="Contiguous halo (the baseline for sliding-window models): packed sequence "
        "in N contiguous equal-token ranges; all-to-all-v (the halo of W - 1 keys per cut)",
        solver=contiguous_halo_layout,
        comm_mode="alltoallv",
        complexity="linear",
    ),
    Strategy(
        name="zigzag",
        description="Zigzag ring attention (ring-flash-attention varlen): per-doc zigzag; P2P ring "
        "exchange",
        solver=per_doc_layout,
        comm_mode="p2p_ring",
        complexity="heuristic",
    ),
    Strategy(
        name="flashcp",
        description="FlashCP: balanced whole-doc passes, zigzag or nested cuts for the docs no rank "
        "can hold, token-neutral refinement; least critical-path volume of the request's exchange "
        "at imbalance <= R (default all-to-all-v)",
        solver=bounded_flashcp_layout,
        comm_mode="alltoallv",
        complexity="heuristic",
    ),
    Strategy(
        name="flashcp_paper",
        description="FlashCP Algorithm 1 as published: LPT whole docs, adaptive Whole-Doc splits, "
        "Per-Doc for the longest docs until imbalance <= R; compact all-gather",
        solver=paper_layout,
        comm_mode="compact_allgather",
        complexity="heuristic",
    ),
    Strategy(
        name="ilp",
        description="OR-Tools CP-SAT block placement: min critical-path KV at imbalance <= R (or "
        "min max workload), flashcp as hint and fallback; status, bound and gap in the plan info",
        solver=_ilp_layout,
        comm_mode="alltoallv",
        options=_LazyOptions(_ilp_options),
        load=_ilp_options,
    ),
    Strategy(
        name="fcp",
        description="FCP: each doc a sequence; BFD into atomic groups, 2D DP over any-integer CP "
        "degrees on a profiled cost model, flashcp inside each group",
        solver=_fcp_layout,
        comm_mode="alltoallv",
        options=_LazyOptions(_fcp_options),
        load=_fcp_options,
    ),
    Strategy(
        name="auto",
        description="The strategy among flashcp, per_doc, llama3, zigzag and ring, and the "
        "exchange, with the least predicted step time under the request's profiles",
        solver=_auto_layout,
        comm_mode="alltoallv",
        load=_auto_load,
    ),
)}
"""Every strategy, by name: one explicit table."""


def add_test_strategy(strategy: Strategy) -> None:
    """Add a strategy the table lacks, in this process only: for the service's test hooks
    (``PLANNER_TEST_HOOKS``), never for a product strategy. Raises for a name in use."""
    if strategy.name in STRATEGIES:
        raise ValueError(f"strategy {strategy.name!r} is already in the registry")
    STRATEGIES[strategy.name] = strategy  # type: ignore[index]


def checked_strategy(request: PlanRequest) -> Strategy:
    """The request's strategy, after checking that it exists and declares every option the
    request sets (the one place this is checked: the library, the service's edges and the
    client's fallback all come here). Raises FieldError (``strategy`` or ``options``)."""
    strategy = get_strategy(request.strategy)
    unknown = sorted(set(request.options) - set(strategy.options))
    if unknown:
        raise FieldError("options", f"options {unknown} are not options of strategy "
                         f"{strategy.name!r}; valid: {sorted(strategy.options) or 'none'}")
    return strategy


def compared_options(names: Sequence[str], options: Mapping[str, Any]
                     ) -> dict[str, dict[str, Any]]:
    """For a comparison of ``names`` on one request: each strategy's share of ``options``
    (those it declares), in the order given. The one check of a comparison (the service's
    edges and the client's embedded back end come here): raises FieldError
    (``strategies``) for no, repeated or unknown names, and (``options``) for an option
    none of them declares."""
    if not names:
        raise FieldError("strategies", "strategies must not be empty")
    if len(set(names)) != len(names):
        raise FieldError("strategies", f"strategies has duplicates: {list(names)}")
    for name in names:
        if name not in STRATEGIES:
            raise FieldError("strategies", f"strategies: strategy {name!r} is unknown; valid: "
                             f"{', '.join(sorted(STRATEGIES))}")
    declared = {o for n in names for o in STRATEGIES[n].options}
    unknown = sorted(set(options) - declared)
    if unknown:
        raise FieldError("options", f"options {unknown} are not options of any of the "
                         f"strategies {list(names)}")
    return {n: {k: v for k, v in options.items() if k in STRATEGIES[n].options}
            for n in names}


def get_strategy(name: str) -> Strategy:
    """Look up a strategy; raises FieldError (``strategy``) listing the valid names."""
    try:
        return STRATEGIES[name]
    except (KeyError, TypeError):
        raise FieldError("strategy", f"strategy {name!r} is unknown; valid: "
                         f"{', '.join(sorted(STRATEGIES))}") from None


def strategy_names() -> list[str]:
    return sorted(STRATEGIES)


def strategies_of_complexity(*kinds: str) -> frozenset[str]:
    """The names of the strategies whose ``complexity`` is one of ``kinds``."""
    return frozenset(s.name for s in STRATEGIES.values() if s.complexity in kinds)


def prepare(name: str) -> None:
    """Import a strategy's module now (the slow ones load on first use), so a timed solve
    that follows measures the solve, not the imports. Unknown names are left to ``solve``."""
    strategy = STRATEGIES.get(name)
    if strategy is not None and strategy.load is not None:
        strategy.load()


def solve(request: PlanRequest, *, check: bool = True, admitted: bool = False) -> Plan:
    """Plan one request: truncate explicitly if asked, run the strategy, measure, validate.

    With ``max_kv_tokens_per_rank`` set, the plan's info records it, and a plan over it is
    refused here whatever the strategy (``kv_bound.check_plan``: the baselines' plans do
    not depend on the bound; flashcp, ilp, fcp and auto hold it themselves).

    Args:
        request: the request (its fields checked by PlanRequest itself).
        check: validate the plan (``validate_plan``) before returning it.
        admitted: the caller has run ``checked_strategy`` on this request already (the
            service's edge, before admission), so the strategy is looked up, not checked
            again; and the self-check takes the metrics ``build_plan`` just computed
            (``validate_plan(metrics=False)``), so the step-time model runs once per
            solve. False (the library): both checked here, the metrics recomputed.

    Returns:
        The plan (canonical, measured, content-hashed).

    Raises FieldError for bad input (unknown strategy, bad options, a KV bound below what
    the strategy can meet: ``kv_bound.KvBoundError``) and PlanError if the strategy
    produced an invalid plan (a bug; ``check=False`` skips that self-check).
    """
    with paused_gc():  # the solve's garbage goes by reference counting (gc_pause.py)
        return _solve(request, check, admitted)


def _solve(request: PlanRequest, check: bool, admitted: bool) -> Plan:
    strategy = get_strategy(request.strategy) if admitted else checked_strategy(request)
    doc_lengths, truncated = request.packed()
    layout = strategy.solver(doc_lengths, request)
    if not request.mask.is_causal and strategy.name in CAUSAL_BALANCERS:
        layout = redeclared(listed(layout), request)
    if truncated:
        layout = Layout(layout.groups, {**layout.info, "truncated_tokens": truncated})
    if request.max_kv_tokens_per_rank is not None:
        layout = Layout(layout.groups, {**layout.info, KV_FIELD: request.max_kv_tokens_per_rank})
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
        mask=request.mask,
    )
    check_plan(plan, request.max_kv_tokens_per_rank)
    if check:
        validate_plan(plan, metrics=not admitted)
    return plan


def timed_solve(request: PlanRequest, *, check: bool = True, admitted: bool = False
                ) -> SolvedPlan:
    """``solve`` (the same arguments) and its wall time (ms, kept outside the plan so
    plans stay byte-identical); the result holds the plan and its canonical JSON."""
    start = time.perf_counter()
    plan = solve(request, check=check, admitted=admitted)
    return SolvedPlan.of(plan, (time.perf_counter() - start) * 1e3)

