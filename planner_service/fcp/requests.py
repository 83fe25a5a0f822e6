"""FCP's batch of sequences (``check_sequences``) and its scheduling result (what ``POST
/v1/schedule`` returns); the request with its intra-group strategy is
``planner_service.solvers.fcp_schedule.ScheduleRequest``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from planner_service.core.errors import FieldError
from planner_service.core.mask import CAUSAL, AttentionMask
from planner_service.core.plan import Plan
from planner_service.core.request import MAX_TOKENS, check_doc_lengths

MAX_SEQUENCES = 1 << 16
"""Sequences per request: a global batch, not a dataset."""


def check_sequences(value: Any) -> tuple[tuple[int, ...], ...]:
    """Sequences as tuples of doc lengths; an int is one unpacked sample of that length.

    Raises FieldError (``sequences`` or ``sequences.i``, ``sequences.i.j``) for a bad entry.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise FieldError("sequences", "sequences must be a non-empty list of doc-length lists "
                         "(or lengths)")
    if not 1 <= len(value) <= MAX_SEQUENCES:
        raise FieldError("sequences", f"sequences must hold 1 to {MAX_SEQUENCES} sequences, "
                         f"got {len(value)}")
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
            out.append(check_doc_lengths(seq, f"sequences[{i}]", f"sequences.{i}"))
    total = sum(sum(s) for s in out)
    if total > MAX_TOKENS:
        raise FieldError("sequences", f"sequences sum to {total} tokens, above the limit "
                         f"{MAX_TOKENS}")
    return tuple(out)


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
    mask: AttentionMask = CAUSAL
    """The attention mask it was scheduled for (JSON ``mask``, the ``layers`` shape, only
    when not causal, as in a plan: a schedule without plans still names it)."""

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
            **({} if self.mask.is_causal else {"mask": self.mask.to_list()}),
        }
