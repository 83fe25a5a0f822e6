"""Strategy ``auto``: the (strategy, comm mode) with the least predicted step time.

Every candidate strategy is solved and measured under every exchange the runtime executes
(or only the request's ``comm_mode`` when it names one), each (strategy, mode) on its own
since a strategy's objective may follow the exchange (flashcp's does), with the request's
model, kernel and link profiles (core/step_time/). The least ``est_step_ms`` wins, ties
going to the earlier candidate (CANDIDATES order, then MODES order). ``p2p_ring`` is a
candidate mode where the runtime runs it as a ring (``step_time.RING_PATHS``: the PyTorch
kernel's ring, flash-attn's segment ring on its default flash path), unless the ring is too
large to model (``step_time.runs.MAX_RING_PAIRS``; recorded under ``skipped``). A
``compact_allgather`` candidate whose saving is 0 (its largest buffer is a whole rank's
tokens, so every rank sends as much as under ``full``: docs/strategies.md) is not a
choice unless the request names that mode: its prediction is listed with
``"saves_nothing": true``. The plan's info records the choice and every candidate's
prediction. Cost: one solve and one metrics
pass (O(shards + tiles); a ring: O(s log s + t log t) for t (shard, other holder of its
doc) pairs) per (strategy, mode).

With ``max_kv_tokens_per_rank`` (``solvers.kv_bound``) the candidates whose plan is over
the bound are left out, their predictions not recorded (flashcp holds the bound itself,
with its own candidates; the others' plans do not depend on it); if none is left,
``KvBoundError`` names the least figure among them, the least bound auto meets.

Under a mask that is not causal in every layer the candidates include ``contiguous_halo``
and each plan is measured under the mask (core/metrics.py): ``est_step_ms`` is then the
predicted time per layer averaged over the mask's groups, ``sum_g (count_g / L) est_g``
(L layers; est_g one layer of window g on the path the runtime runs it), and the least
wins as under causal attention, on every kernel (every path prices a windowed layer,
core/step_time/drivers.py ``windowed_model``). Each prediction under a mask also records
``weighted_imbalance`` and ``weighted_comm_tokens``.

The candidates are looked up with the ``lookup`` the caller passes (the registry's
``get_strategy``), so this module does not import the registry that lists it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from planner_service.core.build import Layout, build_plan
from planner_service.core.paths import RING_PATHS
from planner_service.core.plan import Metrics
from planner_service.core.profiles import get_kernel_profile
from planner_service.core.request import PlanRequest
from planner_service.core.step_time import execution_path, held_kv_mode
from planner_service.solvers.balance import declared
from planner_service.solvers.fcp_strategy import Intra
from planner_service.solvers.kv_bound import KvBoundError, kv_floor, plan_peak

HOW = "the least over its candidates, flashcp's being the least of its own candidate plans"
"""``KvBoundError.how`` of ``auto`` (module docstring)."""
CANDIDATES = ("flashcp", "per_doc", "llama3", "zigzag", "ring")
WINDOWED = ("contiguous_halo",)
"""Candidates added under a mask that is not causal."""
MODES = ("alltoallv", "compact_allgather", "full")
"""The gather exchanges the runtime executes (worker_runtime/layout.py COMM_MODES)."""


def candidate_modes(request: PlanRequest) -> tuple[str, ...]:
    """The request's ``comm_mode``, else MODES, plus ``p2p_ring`` where it runs as a ring."""
    if request.comm_mode:
        return (request.comm_mode,)
    ring = execution_path(get_kernel_profile(request.kernel), "p2p_ring") in RING_PATHS
    return (*MODES, "p2p_ring") if ring else MODES


def saves_nothing(metrics: Metrics) -> bool:
    """A compact all-gather plan whose exchange moves as much as the full one (its
    largest buffer is a whole rank's tokens), where the full one moves anything."""
    return (metrics.comm_mode == "compact_allgather" and metrics.full_comm_tokens > 0
            and metrics.compact_allgather_tokens >= metrics.full_comm_tokens)


def auto_layout(doc_lengths: Sequence[int], request: PlanRequest, *,
                lookup: Callable[[str], Intra]) -> Layout:
    """The least predicted (strategy, comm mode) layout (module docstring)."""
    modes = candidate_modes(request)
    skipped = []
    bound = request.max_kv_tokens_per_rank
    masked = not request.mask.is_causal
    best: tuple[tuple[float, ...], str, str, Layout, float] | None = None
    predictions = []
    least: int | None = None  # with a bound: the least figure of the candidates over it
    for name in CANDIDATES + (WINDOWED if masked else ()):
        for mode in modes:
            # Solved per exchange: a strategy's objective may follow comm_mode (flashcp's does).
            try:
                layout = lookup(name).solver(
                    doc_lengths, replace(request, strategy=name, comm_mode=mode, options={}))
            except KvBoundError as exc:  # flashcp: none of its candidates within the bound
                least = exc.least if least is None else min(least, exc.least)
                continue
            try:
                plan = build_plan(
                    layout,
                    strategy=name,
                    cp_size=request.cp_size,
                    doc_lengths=doc_lengths,
                    context_length=request.context_length,
                    comm_mode=mode,
                    model=request.model,
                    kernel=request.kernel,
                    link=request.link,
                    mask=request.mask,
                )
            except ValueError:
                if mode != "p2p_ring" or request.comm_mode:
                    raise
                skipped.append({"strategy": name, "comm_mode": mode, "why": "ring too large to model"})
                continue
            metrics = plan.metrics
            if bound is not None and plan_peak(plan) > bound:
                least = plan_peak(plan) if least is None else min(least, plan_peak(plan))
                continue
            prediction: dict[str, object] = {"strategy": name, "comm_mode": mode,
                                             "est_step_ms": metrics.est_step_ms}
            if masked:
                prediction.update(weighted_imbalance=metrics.imbalance,
                                  weighted_comm_tokens=metrics.comm_tokens)
            if saves_nothing(metrics) and not request.comm_mode:
                predictions.append({**prediction, "saves_nothing": True})
                continue
            predictions.append(prediction)
            key: tuple[float, ...] = (metrics.est_step_ms,)
            if best is None or key < best[0]:
                best = (key, name, mode, layout, metrics.imbalance)
    if best is None:
        assert bound is not None and least is not None
        raise KvBoundError(bound, least, HOW,
                           min(kv_floor(doc_lengths, request.cp_size, held_kv_mode(request.kernel, mode))
                               for mode in modes))
    _, name, mode, layout, reached = best
    # Under a mask the chosen plan's R is that of its weighted work (any candidate's).
    info = declared(layout.info, (reached,), request.imbalance_target) if masked \
        else layout.info
    return Layout(
        layout.groups,
        {
            **info,
            "chosen": name,
            "comm_mode": mode,
            "kernel_profile": request.kernel,
            "link_profile": request.link,
            "candidates": predictions,
            **({"skipped": skipped} if skipped else {}),
        },
    )

