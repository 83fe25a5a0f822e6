"""FCP scheduling with intra-group plans: ``schedule(ScheduleRequest) -> FcpResult``.

``planner_service.fcp.plan_global_batch`` finds the micro-batches, groups and degrees;
this module adds rank ranges and one validated Plan per micro-batch, each group's shards
from an intra-group strategy of the registry (flashcp by default). Under the request's
``mask`` both stages and every group's plan work on the layer-weighted windowed work.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from planner_service.core.build import Layout, build_plan
from planner_service.core.errors import FieldError
from planner_service.core.mask import CAUSAL, AttentionMask
from planner_service.core.model import ModelSpec
from planner_service.core.plan import Plan
from planner_service.core.profiles import default_kernel_name
from planner_service.core.request import (
    DEFAULT_IMBALANCE_TARGET,
    MAX_FCP_RANKS,
    MAX_TOKENS,
    PlanRequest,
    check_imbalance_target,
    check_int,
    check_profile_names,
)
from planner_service.core.validate import validate_plan
from planner_service.fcp.cost_model import DEFAULT_PROFILE, FcpProfile, get_profile
from planner_service.fcp.grouping import check_options
from planner_service.fcp.placement import place_groups
from planner_service.fcp.requests import (
    FcpResult,
    MicroBatchSchedule,
    ScheduledGroup,
    check_sequences,
)
from planner_service.fcp.schedule import plan_checked
from planner_service.solvers.balance import declared
from planner_service.solvers.fcp_strategy import Intra, group_layouts
from planner_service.solvers.flashcp_masked import redeclared
from planner_service.solvers.kv_bound import listed
from planner_service.solvers.registry import get_strategy


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleRequest:
    """A batch of sequences to schedule on ``num_ranks`` model replicas (FCP).

    Raises FieldError (a ValueError) naming the field for any invalid value.
    """

    sequences: tuple[tuple[int, ...], ...]
    """Doc lengths of each sequence (an int for a one-doc, unpacked sample)."""
    num_ranks: int
    """N: model replicas (one CP rank each), 1 to ``MAX_FCP_RANKS`` (16,384)."""
    memory_tokens: int
    """E: activation memory per rank, in tokens; a group of degree d holds d * E tokens."""
    strategy: str = "flashcp"
    """Intra-group shard strategy (registry name, not ``fcp``); ``zigzag`` is the paper's ring."""
    profile: str | FcpProfile = DEFAULT_PROFILE
    """FCP cost profile: a name from cost_model.PROFILES, ``file:PATH`` or a profile object."""
    full_attention: tuple[bool, ...] = ()
    """Per sequence, True for full (bidirectional) attention; empty means all causal."""
    search: str = "portfolio"
    """``portfolio``: the paper's BFD groupings unless the batch would lose to the static
    baseline, then static-degree groupings too (fcp/portfolio.py); ``paper``: BFD only."""
    method: str = "dp"
    """Stage-2 solver for the chosen grouping: ``dp`` (paper Algorithm 1) or ``threshold``."""
    micro_batches: int | None = None
    """Micro-batches to split into; None picks the count with the least total makespan."""
    build_plans: bool = True
    """False returns groups and degrees only (no intra-group shard plans)."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """Model shape for the plans' metrics (the FCP profile has its own coefficients)."""
    kernel: str = field(default_factory=default_kernel_name)
    link: str = "nvlink"
    imbalance_target: float = DEFAULT_IMBALANCE_TARGET
    """Target R of the intra-group strategy (flashcp)."""
    mask: AttentionMask = CAUSAL
    """The model's attention (core/mask.py): FCP's attention units are its layer-weighted
    windowed work, every group's intra plan is planned for it and the micro-batch plans
    carry it, their balance declared from the weighted work. Not with ``full_attention``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sequences", check_sequences(self.sequences))
        check_int(self.num_ranks, "num_ranks", 1, MAX_FCP_RANKS)
        check_int(self.memory_tokens, "memory_tokens", 1, MAX_TOKENS)
        if not isinstance(self.strategy, str) or self.strategy == "fcp":
            raise FieldError("strategy", f"strategy must be an intra-group strategy name "
                             f"(not fcp), got {self.strategy!r}")
        get_strategy(self.strategy)  # FieldError naming the valid strategies
        try:
            get_profile(self.profile)
        except ValueError as exc:
            raise FieldError("profile", f"profile: {exc}") from None
        flags = self.full_attention
        if isinstance(flags, (str, bytes)) or not isinstance(flags, Sequence):
            raise FieldError("full_attention",
                             "full_attention must be a list of true/false, one per sequence")
        if flags and len(flags) != len(self.sequences):
            raise FieldError("full_attention", f"full_attention must be empty or have one entry "
                             f"per sequence ({len(self.sequences)}), got {len(flags)}")
        for i, flag in enumerate(flags):
            if not isinstance(flag, bool):
                raise FieldError(f"full_attention.{i}",
                                 f"full_attention[{i}] must be true or false, got {flag!r}")
        object.__setattr__(self, "full_attention", tuple(flags))
        if not isinstance(self.mask, AttentionMask):
            raise FieldError("mask", f"mask must be an AttentionMask, got {self.mask!r}")
        if not self.mask.is_causal and any(flags):
            raise FieldError("full_attention", "full_attention is not supported with a "
                             "sliding-window mask (window / layers)")
        check_options(self.search, self.method)
        if self.micro_batches is not None:
            check_int(self.micro_batches, "micro_batches", 1, len(self.sequences))
        if not isinstance(self.build_plans, bool):
            raise FieldError("build_plans",
                             f"build_plans must be true or false, got {self.build_plans!r}")
        if not isinstance(self.model, ModelSpec):
            raise FieldError("model", "model must be a ModelSpec")
        check_profile_names(self.kernel, self.link)
        check_imbalance_target(self.imbalance_target)


def micro_batch_plan(
    sequences: Sequence[Sequence[int]],
    groups: Sequence[Sequence[int]],
    starts: Sequence[int],
    degrees: Sequence[int],
    *,
    num_ranks: int,
    intra: Intra,
    model: ModelSpec,
    kernel: str,
    link: str,
    imbalance_target: float,
    info: dict[str, Any],
    mask: AttentionMask = CAUSAL,
) -> Plan:
    """The validated plan of one micro-batch; PlanError only on an internal bug.

    ``sequences`` are this micro-batch's sequences (doc lengths) in plan order and
    ``groups`` index into them. The plan's doc_lengths are all their docs in that order;
    ``info["sequences"]`` records ``[first_doc, num_docs]`` of each.

    ``mask``: every group's intra request carries it, the plan's metrics are measured
    under it, and (not causal) the balance is declared from each group's layer-weighted
    imbalance (``flashcp_masked.redeclared``, as strategy ``fcp`` does), O(G s log s).
    """
    plans = group_layouts(
        sequences, groups, starts, degrees, intra=intra, model=model, kernel=kernel,
        link=link, imbalance_target=imbalance_target, mask=mask,
    )
    first_doc = 0
    spans = []
    for seq in sequences:
        spans.append([first_doc, len(seq)])
        first_doc += len(seq)
    doc_lengths = [length for seq in sequences for length in seq]
    layout = Layout(groups=plans.layouts,
                    info=declared({**info, "sequences": spans}, plans.missed, imbalance_target))
    if not mask.is_causal:  # the weighing reads the mask and R only; cp_size: widest group
        weighed = PlanRequest(doc_lengths=tuple(doc_lengths), cp_size=max(degrees),
                              strategy="fcp", model=model, kernel=kernel, link=link,
                              imbalance_target=imbalance_target, mask=mask)
        layout = redeclared(listed(layout), weighed)
    plan = build_plan(
        layout,
        strategy="fcp",
        cp_size=num_ranks,
        doc_lengths=doc_lengths,
        context_length=None,
        comm_mode=intra.comm_mode,
        model=model,
        kernel=kernel,
        link=link,
        mask=mask,
    )
    validate_plan(plan)
    return plan


def schedule(request: ScheduleRequest) -> FcpResult:
    """Schedule a batch: micro-batches, CP groups, degrees and (if asked) one Plan each.

    Raises ValueError (naming what is missing) when the memory cannot hold a sequence;
    PlanError only on an internal bug (every plan is validated).
    """
    profile = get_profile(request.profile)
    intra = get_strategy(request.strategy)
    started = time.perf_counter()
    found = plan_checked(
        request.sequences, num_ranks=request.num_ranks, memory_tokens=request.memory_tokens,
        profile=profile, full_attention=request.full_attention, search=request.search,
        method=request.method, micro_batches=request.micro_batches, mask=request.mask,
    )
    solved = time.perf_counter()
    degrees = [0] * len(request.sequences)
    out = []
    for index, (ids, grouping) in enumerate(zip(found.micro_batches, found.groupings, strict=True)):
        starts = place_groups(grouping.degrees, request.num_ranks, profile.ranks_per_node)
        groups = []
        for members, start, degree, est in zip(
            grouping.groups, starts, grouping.degrees, grouping.times_ms, strict=True
        ):
            for i in members:
                degrees[i] = degree
            groups.append(ScheduledGroup(
                ranks=tuple(range(start, start + degree)), sequence_ids=members,
                tokens=sum(sum(request.sequences[i]) for i in members), est_ms=est,
            ))
        plan = None
        if request.build_plans:
            position = {seq: p for p, seq in enumerate(ids)}
            plan = micro_batch_plan(
                [request.sequences[i] for i in ids],
                [[position[i] for i in g] for g in grouping.groups],
                starts, grouping.degrees,
                num_ranks=request.num_ranks, intra=intra, model=request.model,
                kernel=request.kernel, link=request.link,
                imbalance_target=float(request.imbalance_target), mask=request.mask,
                info={
                    "fcp_micro_batch": [index, len(found.micro_batches)],
                    "sequence_ids": list(ids),
                    "group_sequences": [[position[i] for i in g] for g in grouping.groups],
                    "group_ranks": [[s, d] for s, d in zip(starts, grouping.degrees, strict=True)],
                    "group_est_ms": list(grouping.times_ms),
                    "est_makespan_ms": grouping.makespan_ms,
                    "fcp_candidate": grouping.candidate,
                    "fcp_profile": profile.name,
                    "intra_strategy": request.strategy,
                    "memory_tokens": request.memory_tokens,
                },
            )
        out.append(MicroBatchSchedule(
            index=index, sequence_ids=ids, groups=tuple(groups),
            est_makespan_ms=grouping.makespan_ms, candidate=grouping.candidate, plan=plan,
        ))
    done = time.perf_counter()
    return FcpResult(
        micro_batches=tuple(out), degrees=tuple(degrees), est_makespan_ms=found.makespan_ms,
        profile=profile.name, strategy=request.strategy,
        solve_ms=(solved - started) * 1e3, plan_ms=(done - solved) * 1e3,
        mask=CAUSAL if request.mask.is_causal else request.mask,
    )
