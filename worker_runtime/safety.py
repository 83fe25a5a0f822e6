"""Checks that make every rank fail together instead of hanging or computing garbage.

A rank that finds a problem on its own (wrong tensor length, a plan it cannot run)
must not raise before the collective the others are waiting in: it would leave them
blocked until the process-group timeout. So every check here is itself collective: each
rank contributes its plan_id and its local problem (or None) to one small all-gather,
then every rank raises the same ``CollectiveCheckError`` naming every failing rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from planner_service.core.plan import Plan


class CollectiveCheckError(RuntimeError):
    """The ranks of a group disagree (plan_id) or one of them got bad input; raised on
    every rank of the group with the same message."""


def gather_status(group: Any, status: dict[str, Any]) -> list[dict[str, Any]]:
    """All-gather one small picklable dict per rank of ``group`` (rank order)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, status, group=group)
    return out


def agree(
    group: Any,
    *,
    rank: int,
    plan_id: str,
    problem: str | None,
    where: str,
    extra: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Collective check: all ranks of ``group`` hold ``plan_id`` and none has a problem.

    ``rank`` is how messages name this rank (its plan rank). ``extra`` entries (e.g.
    dtype, head counts) must also be equal on every rank.
    Returns the gathered statuses; raises CollectiveCheckError on every rank otherwise.
    Without torch.distributed initialised (a one-rank run) only the local problem counts.
    """
    status = {"rank": rank, "plan_id": plan_id, "problem": problem, **(extra or {})}
    statuses = gather_status(group, status) if dist.is_initialized() else [status]
    lines = []
    ids: dict[str, list[int]] = {}
    for s in statuses:
        ids.setdefault(s["plan_id"], []).append(s["rank"])
    if len(ids) > 1:
        parts = "; ".join(f"rank(s) {_ranks(r)} have plan_id {pid[:12]}" for pid, r in ids.items())
        lines.append(f"plan_id differs across ranks ({parts}); every rank must run the same plan "
                     "(fetch it on one rank and use worker_runtime.broadcast_plan)")
    # Every rank's keys: a rank may send a key the others lack (a window only where set).
    keys = {k for s in statuses for k in s} - {"rank", "plan_id", "problem"}
    for key in sorted(keys):
        values: dict[str, list[int]] = {}
        for s in statuses:
            values.setdefault(repr(s.get(key)), []).append(s["rank"])
        if len(values) > 1:
            parts = "; ".join(f"rank(s) {_ranks(r)}: {v}" for v, r in values.items())
            lines.append(f"{key} differs across ranks ({parts})")
    lines += [f"rank {s['rank']}: {s['problem']}" for s in statuses if s["problem"]]
    if lines:
        raise CollectiveCheckError(f"{where}: " + " | ".join(lines))
    return statuses


def local_input_problem(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_tokens: int, rank: int
) -> str | None:
    """What is wrong with this rank's attention inputs, as text, or None."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return (f"q, k, v must be [tokens, heads, head_dim], got shapes {tuple(q.shape)}, "
                f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != num_tokens or k.shape[0] != num_tokens or v.shape[0] != num_tokens:
        return (f"q/k/v have {q.shape[0]}/{k.shape[0]}/{v.shape[0]} tokens but the plan gives "
                f"rank {rank} {num_tokens} local tokens (shards plus padding; see layout.num_tokens)")
    if k.shape != v.shape:
        return f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}"
    if q.shape[2] != k.shape[2] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return (f"kv heads ({k.shape[1]}) must divide heads ({q.shape[1]}) and head dims match "
                f"({q.shape[2]} vs {k.shape[2]})")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        return f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    return None


def broadcast_plan(plan: Plan | None, group: Any = None, src: int = 0) -> Plan:
    """Send the plan held by rank ``src`` of ``group`` to every rank of it and return it.

    For jobs that fetch plans on one rank only; the other ranks pass ``None``.
    Raises ValueError on ``src`` if it has no plan (after the broadcast, so no rank hangs:
    the others then raise CollectiveCheckError).
    """
    me = dist.get_rank(group)
    payload = [plan.to_json() if (me == src and plan is not None) else None]
    dist.broadcast_object_list(payload, group=group, group_src=src)
    if payload[0] is None:
        if me == src:
            raise ValueError(f"broadcast_plan: rank {src} (src) has no plan to send")
        raise CollectiveCheckError(f"broadcast_plan: rank {src} (src) had no plan to send")
    return Plan.from_json(payload[0])


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
