"""The FCP scheduling request and result (what ``POST /v1/schedule`` exchanges)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from planner_service.core.model import ModelSpec
from planner_service.core.plan import Plan
from planner_service.core.profiles import get_kernel_profile, get_link_profile
from planner_service.core.request import (
    DEFAULT_IMBALANCE_TARGET,
    MAX_CP_SIZE,
    MAX_TOKENS,
    check_doc_lengths,
    check_int,
)
from planner_service.fcp.cost_model import DEFAULT_PROFILE, FcpProfile, get_profile
from planner_service.fcp.grouping import METHODS, SEARCHES

MAX_SEQUENCES = 1 << 16
"""Sequences per request: a global batch, not a dataset."""


def check_sequences(value: Any) -> tuple[tuple[int, ...], ...]:
    """Sequences as tuples of doc lengths; an int is one unpacked sample of that length.

    Raises ValueError naming ``sequences[i]`` for a bad entry.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError("sequences must be a non-empty list of doc-length lists (or lengths)")
    if not 1 <= len(value) <= MAX_SEQUENCES:
        raise ValueError(f"sequences must hold 1 to {MAX_SEQUENCES} sequences, got {len(value)}")
    out: list[tuple[int, ...]] = []
    for i, seq in enumerate(value):
        # Fast path for plain ints (the common case); check_doc_lengths words the errors.
        if type(seq) is int and 1 <= seq <= MAX_TOKENS:
            out.append((seq,))
        elif type(seq) in (list, tuple) and seq and all(
            type(x) is int and 1 <= x <= MAX_TOKENS for x in seq
        ):
            out.append(tuple(seq))
        else:
            if not isinstance(seq, bool) and hasattr(seq, "__index__"):
                seq = (seq,)
            out.append(check_doc_lengths(seq, f"sequences[{i}]"))
    total = sum(sum(s) for s in out)
    if total > MAX_TOKENS:
        raise ValueError(f"sequences sum to {total} tokens, above the limit {MAX_TOKENS}")
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleRequest:
    """A batch of sequences to schedule on ``num_ranks`` model replicas (FCP).

    Raises ValueError naming the field for any invalid value.
    """

    sequences: tuple[tuple[int, ...], ...]
    """Doc lengths of each sequence (an int for a one-doc, unpacked sample)."""
    num_ranks: int
    """N: model replicas (one CP rank each), 1 to 1024."""
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
    kernel: str = "h100-fa3"
    link: str = "nvlink"
    imbalance_target: float = DEFAULT_IMBALANCE_TARGET
    """Target R of the intra-group strategy (flashcp)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sequences", check_sequences(self.sequences))
        check_int(self.num_ranks, "num_ranks", 1, MAX_CP_SIZE)
        check_int(self.memory_tokens, "memory_tokens", 1, MAX_TOKENS)
        from planner_service.solvers.registry import get_strategy

        if not isinstance(self.strategy, str) or self.strategy == "fcp":
            raise ValueError(f"strategy must be an intra-group strategy name (not fcp), got {self.strategy!r}")
        get_strategy(self.strategy)
        try:
            get_profile(self.profile)
        except ValueError as exc:
            raise ValueError(f"profile: {exc}") from None
        flags = self.full_attention
        if isinstance(flags, (str, bytes)) or not isinstance(flags, Sequence):
            raise ValueError("full_attention must be a list of true/false, one per sequence")
        if flags and len(flags) != len(self.sequences):
            raise ValueError(
                f"full_attention must be empty or have one entry per sequence "
                f"({len(self.sequences)}), got {len(flags)}"
            )
        if any(not isinstance(f, bool) for f in flags):
            raise ValueError("full_attention entries must be true or false")
        object.__setattr__(self, "full_attention", tuple(flags))
        if self.search not in SEARCHES:
            raise ValueError(f"search must be one of {', '.join(SEARCHES)}, got {self.search!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.micro_batches is not None:
            check_int(self.micro_batches, "micro_batches", 1, len(self.sequences))
        if not isinstance(self.build_plans, bool):
            raise ValueError(f"build_plans must be true or false, got {self.build_plans!r}")
        if not isinstance(self.model, ModelSpec):
            raise ValueError("model must be a ModelSpec")
        get_kernel_profile(self.kernel)
        get_link_profile(self.link)
        r = self.imbalance_target
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not 1 <= r <= 100:
            raise ValueError(f"imbalance_target must be a number in [1, 100], got {r!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduledGroup:
    """One CP group of a micro-batch."""

    ranks: tuple[int, ...]
    """Contiguous global ranks."""
    sequence_ids: tuple[int, ...]
    """Indices into the request's sequences."""
    tokens: int
    est_ms: float
    """FCP cost-model time of the group at its degree (eq. 10), per layer fwd+bwd."""

    @property
    def degree(self) -> int:
        return len(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": list(self.ranks), "degree": self.degree,
            "sequence_ids": list(self.sequence_ids), "tokens": self.tokens, "est_ms": self.est_ms,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchSchedule:
    """One micro-batch: its sequences, groups, estimate and (optionally) its plan."""

    index: int
    sequence_ids: tuple[int, ...]
    """Ascending; the plan's doc_lengths are these sequences' docs in this order."""
    groups: tuple[ScheduledGroup, ...]
    est_makespan_ms: float
    candidate: str
    """The stage-1 grouping that won (see grouping.py)."""
    plan: Plan | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "sequence_ids": list(self.sequence_ids),
            "groups": [g.to_dict() for g in self.groups],
            "degrees": [g.degree for g in self.groups],
            "est_makespan_ms": self.est_makespan_ms,
            "candidate": self.candidate,
            "plan": None if self.plan is None else self.plan.to_dict(),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class FcpResult:
    """FCP's schedule of a (global) batch: one entry per micro-batch."""

    micro_batches: tuple[MicroBatchSchedule, ...]
    degrees: tuple[int, ...]
    """CP degree of each request sequence (the degree of the group that holds it)."""
    est_makespan_ms: float
    """Sum over micro-batches of their makespans (they run one after another)."""
    profile: str
    strategy: str
    """Intra-group strategy of the plans."""
    solve_ms: float
    """Wall time of splitting, stage 1 and stage 2 (no plan building)."""
    plan_ms: float
    """Wall time of building and validating the intra-group plans."""

    @property
    def plans(self) -> tuple[Plan, ...]:
        return tuple(mb.plan for mb in self.micro_batches if mb.plan is not None)

    def to_dict(self) -> dict[str, Any]:
        """JSON form: plain lists, numbers and strings (plans in their own JSON form)."""
        return {
            "micro_batches": [mb.to_dict() for mb in self.micro_batches],
            "degrees": list(self.degrees),
            "est_makespan_ms": self.est_makespan_ms,
            "profile": self.profile,
            "strategy": self.strategy,
            "solve_ms": self.solve_ms,
            "plan_ms": self.plan_ms,
        }
