"""Distributed equivalence: every strategy x every comm mode on spawned gloo worlds of 2,
3, 4 and 8 ranks equals a single-process float64 reference with document masks, and every
collective moves exactly the bytes the plan says.

One spawned world per world size runs all cases (spawning costs seconds, a case
milliseconds). Plans are solved once in the parent and sent to the ranks as JSON.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_cases import (
    KV_ROW_ELEMS,
    MULTI_GROUPS,
    max_abs,
    multi_group_plan,
    random_doc_lengths,
    reference_case,
    run_against_reference,
    solve_any,
)
from timing import scaled

from planner_service.core.plan import Plan
from planner_service.solvers.registry import strategy_names
from worker_runtime import (
    GATHER_MODES,
    ContextParallelAttention,
    planned_recv_tokens,
)
from worker_runtime.testing import run_distributed

pytestmark = pytest.mark.slow  # long: starts first under xdist (tests/conftest.py)

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def world_plans(world_size: int) -> list[Plan]:
    lengths = random_doc_lengths(world_size, world_size)
    plans = [solve_any(lengths, world_size, name) for name in strategy_names()]
    if world_size in MULTI_GROUPS:
        plans.append(multi_group_plan(lengths, MULTI_GROUPS[world_size], world_size))
    return plans


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
