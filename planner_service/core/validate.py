"""The one plan validator, used by every test and by the solvers' self-check."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from planner_service.core.cost import held_docs, per_rank_sums, shard_arrays, stable_lexsort
from planner_service.core.metrics import group_metrics, plan_metrics
from planner_service.core.paths import COMM_MODES
from planner_service.core.plan import Metrics, Plan, content_hash

REL_TOL = 1e-9
"""Float metrics are recomputed by the same code; only JSON round trips may differ."""
FAST_SHARDS = 2048
"""Shards from which ``validate_plan`` checks the structure in numpy first
(``structure_holds``), the reference (``structure_problems``) then only naming what is
wrong; fewer: the reference alone is as fast."""


class PlanError(ValueError):
    """A plan breaks an invariant; the message lists every problem found."""


def validate_plan(plan: Plan, *, metrics: bool = True) -> None:
    """Check a plan's invariants; raise PlanError saying what is wrong.

    Every token of every doc is placed exactly once, shards lie inside their doc,
    every rank of a group holds the same tokens after padding, ranks are disjoint and
    inside [0, cp_size), every metric equals its recomputation from the shards (under the
    plan's mask: the layer-weighted and per-window figures, core/metrics.py), and
    plan_id is the content hash.

    Args:
        plan: the plan to check (parsed from JSON or just built).
        metrics: recompute the metrics from the shards and compare (the step-time model
            runs again: about what ``build_plan`` spent on them). False: take the
            metrics as given, for a plan ``build_plan`` has just measured from these
            same shards (the service's solve); every other invariant is still checked.

    Complexity: O(s log s) for s shards, plus the metrics' recomputation if asked.
    """
    shards = sum(len(rank) for group in plan.groups for rank in group.shards)
    problems = [] if shards >= FAST_SHARDS and structure_holds(plan) else \
        structure_problems(plan)
    if not problems:
        if metrics:
            problems += _metric_problems(plan)
        if content_hash(plan.body_dict()) != plan.plan_id:
            problems.append("plan_id is not the content hash of the plan")
    if problems:
        shown = "; ".join(problems[:20])
        more = f" (+{len(problems) - 20} more)" if len(problems) > 20 else ""
        raise PlanError(f"invalid plan: {shown}{more}")


def structure_problems(plan: Plan) -> list[str]:
    """Every broken invariant of the plan's structure (all but its metrics and plan_id),
    shard by shard: the reference ``structure_holds`` is checked against. O(s log s)."""
    problems: list[str] = []
    num_docs = len(plan.doc_lengths)
    if plan.comm_mode not in COMM_MODES:
        problems.append(f"comm_mode {plan.comm_mode!r} is not one of {COMM_MODES}")
    seen_ranks: set[int] = set()
    covered: dict[int, list[tuple[int, int, int]]] = {}
    doc_group: dict[int, int] = {}
    for gi, group in enumerate(plan.groups):
        where = f"groups[{gi}]"
        if not group.ranks:
            problems.append(f"{where} has no ranks")
            continue
        if len(group.shards) != len(group.ranks) or len(group.padding) != len(group.ranks):
            problems.append(f"{where}: shards and padding need one entry per rank")
            continue
        for r in group.ranks:
            if not 0 <= r < plan.cp_size:
                problems.append(f"{where}: rank {r} outside [0, {plan.cp_size})")
            if r in seen_ranks:
                problems.append(f"{where}: rank {r} is in more than one group")
            seen_ranks.add(r)
        held = []
        for ri, shards in enumerate(group.shards):
            if list(shards) != sorted(shards):
                problems.append(
                    f"{where} rank {group.ranks[ri]}: shards not sorted by (doc, start)"
                )
            for s in shards:
                if not 0 <= s.doc < num_docs:
                    problems.append(f"{where}: shard doc {s.doc} outside [0, {num_docs})")
                    continue
                if not 0 <= s.start < s.end <= plan.doc_lengths[s.doc]:
                    problems.append(
                        f"{where}: shard {s} outside doc {s.doc} of length {plan.doc_lengths[s.doc]}"
                    )
                if doc_group.setdefault(s.doc, gi) != gi:
                    problems.append(
                        f"doc {s.doc} is split across groups {doc_group[s.doc]} and {gi}"
                    )
                covered.setdefault(s.doc, []).append((s.start, s.end, group.ranks[ri]))
            held.append(sum(s.end - s.start for s in shards))
            if group.padding[ri] < 0:
                problems.append(f"{where} rank {group.ranks[ri]}: negative padding")
        totals = {t + p for t, p in zip(held, group.padding, strict=True)}
        if len(totals) > 1:
            problems.append(f"{where}: tokens + padding differ across ranks: {sorted(totals)}")
        docs = tuple(sorted({s.doc for shards in group.shards for s in shards}))
        if docs != tuple(group.docs):
            problems.append(f"{where}: docs {list(group.docs)} != docs of its shards {list(docs)}")
    for doc, length in enumerate(plan.doc_lengths):
        spans = sorted(covered.get(doc, []))
        pos = 0
        for start, end, rank in spans:
            if start != pos:
                kind = "placed twice" if start < pos else "missing"
                lo, hi = sorted((start, pos))
                problems.append(f"doc {doc}: tokens [{lo}, {hi}) {kind} (rank {rank})")
            pos = max(pos, end)
        if pos != length:
            problems.append(f"doc {doc}: tokens [{pos}, {length}) missing")
    return problems


def structure_holds(plan: Plan) -> bool:
    """Whether ``structure_problems(plan)`` is empty, in numpy (False also where a figure
    does not fit the arrays: the reference then decides). O(s log s) for s shards."""
    if plan.comm_mode not in COMM_MODES:
        return False
    try:
        lengths = np.asarray(plan.doc_lengths, dtype=np.int64)
        paddings = [np.asarray(group.padding, dtype=np.int64) for group in plan.groups]
    except (OverflowError, TypeError, ValueError):
        return False
    ranks: set[int] = set()
    parts = []
    for group, padding in zip(plan.groups, paddings, strict=True):
        n = len(group.ranks)
        if not n or len(group.shards) != n or len(padding) != n:
            return False
        for r in group.ranks:
            if not 0 <= r < plan.cp_size or r in ranks:
                return False
            ranks.add(r)
        a = shard_arrays(group.shards)  # docs, starts and ends in [0, 2^31), end >= start
        if a is None:
            return False
        if len(a.doc):
            if int(a.doc.max()) >= len(lengths) or not (
                    (a.start < a.end) & (a.end <= lengths[a.doc])).all():
                return False
            # Each rank's shards in (doc, start, end) order.
            later = (a.doc[1:] > a.doc[:-1]) | ((a.doc[1:] == a.doc[:-1]) & (
                (a.start[1:] > a.start[:-1])
                | ((a.start[1:] == a.start[:-1]) & (a.end[1:] >= a.end[:-1]))))
            if not (later | (a.rank[1:] != a.rank[:-1])).all():
                return False
        padded = per_rank_sums(a.end - a.start, a.bounds) + padding
        docs = held_docs(a.doc)
        if (padding < 0).any() or (padded != padded[0]).any() \
                or docs.tolist() != list(group.docs):
            return False
        parts.append((docs, a.doc, a.start, a.end))
    if not parts:
        return not len(lengths) or not lengths.any()
    doc, start, end = (np.concatenate([p[i] for p in parts]) for i in (1, 2, 3))
    groups = np.bincount(np.concatenate([p[0] for p in parts]), minlength=len(lengths))
    if len(groups) != len(lengths) or not (groups == 1).all():
        return False  # a doc in two groups, or one without shards (the reference names it)
    # Every doc's shards, in start order, tile [0, length): each starts where the one
    # before ends.
    order = stable_lexsort((start, doc))
    d, s, e = doc[order], start[order], end[order]
    first = np.ones(len(d), dtype=bool)
    first[1:] = d[1:] != d[:-1]
    before = np.zeros(len(d), dtype=np.int64)
    before[1:] = e[:-1]
    last = np.append(first[1:], True)
    return bool((s == np.where(first, 0, before)).all() and (e[last] == lengths[d[last]]).all())


def _metric_problems(plan: Plan) -> list[str]:
    problems = []
    measured = []
    for gi, group in enumerate(plan.groups):
        metrics, stats = group_metrics(
            group.shards,
            group.padding,
            comm_mode=plan.comm_mode,
            model=plan.model,
            kernel=plan.kernel,
            link=plan.link,
            mask=plan.mask,
        )
        measured.append((metrics, stats))
        problems += _diff(f"groups[{gi}].metrics", group.metrics, metrics)
        if stats != group.rank_stats:
            problems.append(f"groups[{gi}].rank_stats differ from the recomputation {stats}")
    problems += _diff("metrics", plan.metrics, plan_metrics(measured, plan.comm_mode))
    return problems


def _diff(where: str, reported: Metrics, recomputed: Metrics) -> list[str]:
    out = []
    given = reported.to_dict()
    for name, want in recomputed.to_dict().items():
        got: Any = given.get(name)
        if not _same(got, want):
            out.append(f"{where}.{name} = {got!r}, recomputed {want!r}")
    out += [f"{where}.{name} is reported but not recomputed (a mask's layers without "
            "the mask?)" for name in sorted(set(given) - set(recomputed.to_dict()))]
    return out


def _same(got: Any, want: Any) -> bool:
    """Equal, floats within REL_TOL, lists and dicts (the per-window ``layers``) entry by
    entry."""
    if isinstance(want, float):
        return isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=REL_TOL,
                                                              abs_tol=1e-12)
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(
            _same(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(
            _same(g, w) for g, w in zip(got, want, strict=True))
    return bool(got == want)
