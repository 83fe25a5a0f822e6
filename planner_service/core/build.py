"""Turn a solver's raw layout into a canonical, measured, content-hashed Plan."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from planner_service.core.metrics import group_metrics, plan_metrics
from planner_service.core.model import ModelSpec
from planner_service.core.plan import Group, Plan, Shard, content_hash


class GroupLayout(NamedTuple):
    """A solver's answer for one CP group: shards per rank, in any order."""

    ranks: tuple[int, ...]
    shards: Sequence[Iterable[Shard]]


class Layout(NamedTuple):
    """A solver's whole answer: its groups and JSON-able extras for the plan's info."""

    groups: Sequence[GroupLayout]
    info: Mapping[str, Any]


def canonical_shards(shards: Iterable[Shard]) -> tuple[Shard, ...]:
    """Sort by (doc, start), drop empty shards and merge touching shards of one doc."""
    out: list[Shard] = []
    for s in sorted(s for s in shards if s.end > s.start):
        if out and out[-1].doc == s.doc and out[-1].end == s.start:
            out[-1] = Shard(doc=s.doc, start=out[-1].start, end=s.end)
        else:
            out.append(s)
    return tuple(out)


def build_plan(
    layout: Layout,
    *,
    strategy: str,
    cp_size: int,
    doc_lengths: Sequence[int],
    context_length: int | None,
    comm_mode: str,
    model: ModelSpec,
    kernel: str,
    link: str,
) -> Plan:
    """Canonicalise shards, add explicit padding, compute metrics and the plan_id.

    Padding per rank = the group's largest token count minus the rank's own, so every
    rank of a group holds the same number of tokens.
    """
    groups = []
    measured = []
    for g in layout.groups:
        shards = tuple(canonical_shards(rank) for rank in g.shards)
        tokens = [sum(s.end - s.start for s in rank) for rank in shards]
        padding = tuple(max(tokens) - t for t in tokens)
        metrics, stats = group_metrics(
            shards, padding, comm_mode=comm_mode, model=model, kernel=kernel, link=link
        )
        measured.append((metrics, stats))
        groups.append(
            Group(
                ranks=tuple(g.ranks),
                docs=tuple(sorted({s.doc for rank in shards for s in rank})),
                shards=shards,
                padding=padding,
                metrics=metrics,
                rank_stats=stats,
            )
        )
    fields: dict[str, Any] = dict(
        strategy=strategy,
        cp_size=cp_size,
        doc_lengths=tuple(doc_lengths),
        context_length=context_length,
        comm_mode=comm_mode,
        model=model,
        kernel=kernel,
        link=link,
        groups=tuple(groups),
        metrics=plan_metrics(measured, comm_mode),
        info=dict(sorted(layout.info.items())),
    )
    draft = Plan(**fields, plan_id="")
    return Plan(**fields, plan_id=content_hash(draft.body_dict()))
