"""Turn a solver's raw layout into a canonical, measured, content-hashed Plan."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from typing import Any, NamedTuple

import numpy as np

from planner_service.core.cost import (
    ShardArrays,
    held_docs,
    lex_order,
    per_rank_sums,
    shard_arrays,
)
from planner_service.core.mask import CAUSAL, AttentionMask
from planner_service.core.metrics import group_metrics_of, plan_metrics
from planner_service.core.model import ModelSpec
from planner_service.core.plan import (
    Group,
    MadeTexts,
    Plan,
    Shard,
    int_list_json,
    plan_hash,
    shards_json,
)

new_shard = tuple.__new__
"""``new_shard(Shard, (doc, start, end))``: a Shard without NamedTuple's Python-level
``__new__``."""
JSON_IN_NUMPY = 512
"""Shards of a group from which the JSON of its shards and docs is made in numpy
(``plan.shards_json``; fewer: Python's formatting is faster)."""


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


def canonical_group(
    shards_per_rank: Sequence[Sequence[Shard]],
) -> tuple[tuple[tuple[Shard, ...], ...], ShardArrays | None]:
    """``canonical_shards`` of every rank, and the result as ``ShardArrays`` (None where
    int64 could overflow: then rank by rank). O(s log s) for s shards, in numpy.

    Sorted by (rank, doc, start, end) with the empty shards dropped, a shard merges into
    the one before it when both are on one rank, of one doc, and the earlier ends where it
    starts; a run of merges ends at its last shard's end, as ``canonical_shards`` does."""
    raw = shard_arrays(shards_per_rank)
    if raw is None:
        return tuple(canonical_shards(rank) for rank in shards_per_rank), None
    n = len(shards_per_rank)
    kept = np.flatnonzero(raw.end > raw.start)
    rank, doc, start, end = raw.rank[kept], raw.doc[kept], raw.start[kept], raw.end[kept]
    order = lex_order((end, start, doc, rank))
    source = kept[order]  # each sorted shard's index among the input shards
    rank, doc, start, end = rank[order], doc[order], start[order], end[order]
    merges = np.zeros(len(rank), dtype=bool)
    if len(rank) > 1:
        merges[1:] = (rank[1:] == rank[:-1]) & (doc[1:] == doc[:-1]) & (end[:-1] == start[1:])
    heads = np.flatnonzero(~merges)
    lasts = np.append(heads[1:], len(rank))[: len(heads)] - 1
    rank, doc, start, end = rank[heads], doc[heads], start[heads], end[lasts]
    bounds = np.searchsorted(rank, np.arange(n + 1))
    # The input's own shard objects where nothing merged (as ``canonical_shards``: new
    # tuples cost time, mostly the garbage collector's), new ones for the merged runs.
    given = list(chain.from_iterable(shards_per_rank))
    flat = [given[i] for i in source[heads].tolist()]
    for j in np.flatnonzero(lasts != heads).tolist():
        flat[j] = new_shard(Shard, (int(doc[j]), int(start[j]), int(end[j])))
    cuts = bounds.tolist()
    shards = tuple(tuple(flat[cuts[i]:cuts[i + 1]]) for i in range(n))
    return shards, ShardArrays(rank, doc, start, end, bounds)


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
    mask: AttentionMask = CAUSAL,
) -> Plan:
    """Canonicalise shards, add explicit padding, compute metrics (under ``mask``:
    core/metrics.py) and the plan_id.

    Padding per rank = the group's largest token count minus the rank's own, so every
    rank of a group holds the same number of tokens.
    """
    groups = []
    measured = []
    made: list[tuple[str, str] | None] = []  # per group, the JSON of its docs and shards
    for g in layout.groups:
        shards, arrays = canonical_group(
            [rank if isinstance(rank, (list, tuple)) else list(rank) for rank in g.shards]
        )
        if arrays is None:
            tokens = [sum(s.end - s.start for s in rank) for rank in shards]
            docs = tuple(sorted({s.doc for rank in shards for s in rank}))
            made.append(None)
        else:
            tokens = per_rank_sums(arrays.end - arrays.start, arrays.bounds).tolist()
            held = held_docs(arrays.doc)
            docs = tuple(held.tolist())
            made.append((int_list_json(held),
                         shards_json(arrays.doc, arrays.start, arrays.end, arrays.bounds))
                        if len(arrays.doc) >= JSON_IN_NUMPY else None)
        most = max(tokens)
        padding = tuple([most - t for t in tokens])
        metrics, stats = group_metrics_of(
            arrays, shards, padding, comm_mode=comm_mode, model=model, kernel=kernel, link=link,
            mask=mask,
        )
        measured.append((metrics, stats))
        groups.append(
            Group(
                ranks=tuple(g.ranks),
                docs=docs,
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
        # Causal in every layer, whatever the layer count: the plan of a request without one.
        mask=CAUSAL if mask.is_causal else mask,
    )
    draft = Plan(**fields, plan_id="")
    texts = MadeTexts(fields["groups"], made) if any(m is not None for m in made) else None
    return Plan(**fields, plan_id=plan_hash(draft, made=made), made=texts)
