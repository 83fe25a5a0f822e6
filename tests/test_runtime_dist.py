"""Distributed equivalence: every strategy x every comm mode on spawned gloo worlds of 2,
3, 4 and 8 ranks equals a single-process float64 reference with document masks, and every
collective moves exactly the bytes the plan says.

One spawned world per world size runs all cases (spawning costs seconds, a case
milliseconds). Plans are solved once in the parent and sent to the ranks as JSON.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np
import pytest
import torch
from timing import scaled

from planner_service.core.build import GroupLayout, Layout, build_plan
from planner_service.core.model import ModelSpec
from planner_service.core.plan import Plan, Shard
from planner_service.core.request import PlanRequest
from planner_service.core.validate import validate_plan
from planner_service.solvers.flashcp import flashcp_shards
from planner_service.solvers.registry import get_strategy, solve, strategy_names
from worker_runtime import (
    GATHER_MODES,
    ContextParallelAttention,
    planned_recv_tokens,
    reference_attention,
)
from worker_runtime.testing import run_distributed

pytestmark = pytest.mark.slow  # long: starts first under xdist (tests/conftest.py)

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
MODEL = ModelSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype_bytes=8)
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
KV_ROW_ELEMS = 2 * KV_HEADS * HEAD_DIM
MULTI_GROUPS = {3: [(2, 0), (1,)], 4: [(2, 0, 3), (1,)], 8: [(0, 1, 2, 3, 4), (7, 5)]}
"""Hand-made multi-group (FCP-like) layouts: unsorted rank sets, and rank 6 idle at N = 8."""


def random_doc_lengths(seed: int, num_ranks: int) -> list[int]:
    """Lengths divisible by nothing in particular, with 1-token docs and one long doc."""
    rng = np.random.default_rng(seed)
    lengths = [1, *rng.integers(1, 24, size=5).tolist(), 1, int(rng.integers(40, 70)), 2]
    lengths += rng.integers(1, 12, size=num_ranks).tolist()
    rng.shuffle(lengths)
    return [int(x) for x in lengths]


def multi_group_plan(doc_lengths: list[int], groups: list[tuple[int, ...]], cp_size: int) -> Plan:
    """Docs dealt round-robin to groups, each group sharded by FlashCP's heuristic."""
    layouts = []
    for g, ranks in enumerate(groups):
        docs = list(range(g, len(doc_lengths), len(groups)))
        shards, _ = flashcp_shards([doc_lengths[d] for d in docs], len(ranks), 1.05)
        layouts.append(GroupLayout(ranks, [[Shard(docs[s.doc], s.start, s.end) for s in r] for r in shards]))
    plan = build_plan(
        Layout(layouts, {}), strategy="multi_group_test", cp_size=cp_size, doc_lengths=doc_lengths,
        context_length=None, comm_mode="compact_allgather", model=MODEL, kernel="h100-fa3", link="nvlink",
    )
    validate_plan(plan)
    return plan


def fast_options(strategy: str) -> dict:
    """A short solver time limit where a strategy has one (ilp): the test is about the runtime."""
    return {"time_limit_s": 0.5} if "time_limit_s" in get_strategy(strategy).options else {}


def solve_any(lengths: list[int], cp_size: int, strategy: str, **profiles: str) -> Plan:
    """The strategy's plan; if it proves the default imbalance target unreachable (ilp),
    the plan for a loose target instead: the test is about executing plans. ``profiles``:
    the request's ``kernel`` and ``link`` where the plan's figures must be the runtime's."""
    request = PlanRequest(doc_lengths=lengths, cp_size=cp_size, strategy=strategy, model=MODEL,
                          options=fast_options(strategy), **profiles)
    try:
        return solve(request)
    except ValueError:
        return solve(replace(request, imbalance_target=100.0))


def world_plans(world_size: int) -> list[Plan]:
    lengths = random_doc_lengths(world_size, world_size)
    plans = [solve_any(lengths, world_size, name) for name in strategy_names()]
    if world_size in MULTI_GROUPS:
        plans.append(multi_group_plan(lengths, MULTI_GROUPS[world_size], world_size))
    return plans


def global_tensors(total: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(total, HEADS, HEAD_DIM), (total, KV_HEADS, HEAD_DIM), (total, KV_HEADS, HEAD_DIM),
              (total, HEADS, HEAD_DIM)]
    return tuple(torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes)


def max_abs(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


class Case(NamedTuple):
    """One plan's global inputs and its dense float64 reference."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    w: torch.Tensor
    """Weights of the loss ``sum(out * w)``."""
    ref: torch.Tensor
    ref_grads: tuple[torch.Tensor, ...]
    """dq, dk, dv of the reference."""


def reference_case(plan: Plan, seed: int) -> Case:
    q, k, v, w = global_tensors(sum(plan.doc_lengths), seed=seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*leaves, plan.doc_lengths)
    grads = torch.autograd.grad((ref * w).sum(), leaves)
    return Case(q, k, v, w, ref.detach(), grads)


def run_against_reference(attn: ContextParallelAttention, case: Case,
                          dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, list[float]]:
    """This rank's forward + backward of ``case`` in ``dtype``: (output, max errors of the
    output and of dq, dk, dv against the reference)."""
    local = [attn.dispatch(t.to(dtype)).requires_grad_() for t in (case.q, case.k, case.v)]
    out = attn(*local)
    (out * attn.dispatch(case.w.to(dtype))).sum().backward()
    errors = [max_abs(out - attn.dispatch(case.ref.to(dtype)))]
    errors += [max_abs(t.grad - attn.dispatch(g.to(dtype)))
               for t, g in zip(local, case.ref_grads, strict=True)]
    return out, errors


def group_rows(plan: Plan, group_index: int) -> torch.Tensor:
    """Global packed rows of one group's docs."""
    offsets = np.concatenate(([0], np.cumsum(plan.doc_lengths)))
    docs = plan.groups[group_index].docs
    return torch.from_numpy(np.concatenate([np.arange(offsets[d], offsets[d + 1]) for d in docs]))


def equivalence_worker(rank: int, world_size: int, plan_jsons: list[str]) -> dict:
    """Per case, mode and dtype: max errors of output and grads, and bytes received."""
    results = {}
    for ci, text in enumerate(plan_jsons):
        plan = Plan.from_json(text)
        case = reference_case(plan, ci)
        for mode in GATHER_MODES:
            attn = ContextParallelAttention(plan, comm_mode=mode)
            for dtype in (torch.float64, torch.float32):
                attn.counter.reset()
                out, errors = run_against_reference(attn, case, dtype)
                if dtype == torch.float64 and attn.layout.group_index >= 0:
                    # undispatch(gather=True) assembles the whole group's output.
                    gathered = attn.undispatch(out.detach(), gather=True)
                    rows = group_rows(plan, attn.layout.group_index)
                    errors.append(max_abs(gathered[rows] - case.ref[rows]))
                c = attn.counter
                results[(ci, mode, str(dtype))] = {
                    "errors": errors,
                    "bytes": (c.forward_bytes, c.backward_bytes),
                    "tokens": (c.forward_tokens, c.backward_tokens),
                    "calls": (c.forward_calls, c.backward_calls),
                }
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_runtime_matches_float64_reference_and_plan_bytes(world_size: int) -> None:
    plans = world_plans(world_size)
    per_rank = run_distributed(equivalence_worker, world_size, [p.to_json() for p in plans],
                               timeout_s=scaled(150.0))
    for ci, plan in enumerate(plans):
        for mode in GATHER_MODES:
            for dtype in (torch.float64, torch.float32):
                key = (ci, mode, str(dtype))
                itemsize = torch.empty(0, dtype=dtype).element_size()
                for rank, res in enumerate(per_rank):
                    where = f"{plan.strategy} {mode} {dtype} rank {rank}"
                    assert max(res[key]["errors"]) <= TOL[dtype], f"{where}: errors {res[key]['errors']}"
                    tokens = planned_recv_tokens(plan, rank, mode)
                    want = tokens * KV_ROW_ELEMS * itemsize
                    assert res[key]["bytes"] == (want, want), f"{where}: bytes {res[key]['bytes']} != {want}"
            # The critical-path figures of every group, as the planner reports them.
            for group in plan.groups:
                got = max(per_rank[r][(ci, mode, "torch.float64")]["tokens"][0] for r in group.ranks)
                want = {"full": group.metrics.full_comm_tokens,
                        "compact_allgather": group.metrics.compact_allgather_tokens,
                        "alltoallv": group.metrics.alltoallv_tokens}[mode]
                assert got == want, f"{plan.strategy} {mode}: critical-path tokens {got} != {want}"
        own_mode = "full" if plan.comm_mode == "p2p_ring" else plan.comm_mode
        got_bytes = max(res[(ci, own_mode, "torch.float64")]["bytes"][0] for res in per_rank)
        assert got_bytes == plan.metrics.comm_bytes, f"{plan.strategy}: {got_bytes} != plan comm_bytes"
