"""The gathered path (one varlen call on every shard's gathered keys) with the exact
reference segment kernel on spawned gloo worlds of 3 and 5 ranks, every gather mode and a
ring plan's bytes as ``full``: float64 results equal the dense reference and the stacked
exchange moves the plan's bytes each way. Its planned call and transfer, one process.
"""

from __future__ import annotations

import pytest
from runtime_cases import (
    KV_ROW_ELEMS,
    overlap_plans,
    rank_path_state,
    reference_case,
    run_against_reference,
)
from timing import scaled

from planner_service.core.plan import Plan
from worker_runtime import GATHER_MODES, ContextParallelAttention, build_layout, planned_recv_tokens
from worker_runtime.paths import PATHS
from worker_runtime.paths.segment_kernels import ReferenceSegments
from worker_runtime.testing import run_distributed

TOL = 1e-10
MODES = (*GATHER_MODES, "p2p_ring")


def worker(rank: int, world_size: int, plan_jsons: list[str]) -> dict:
    results = {}
    kernel = ReferenceSegments()
    for ci, text in enumerate(plan_jsons):
        plan = Plan.from_json(text)
        case = reference_case(plan, ci)
        for mode in MODES:
            attn = ContextParallelAttention(plan, comm_mode=mode)
            attn.execution_path = lambda q: ("gathered", kernel)  # type: ignore[method-assign]
            _, errors = run_against_reference(attn, case)
            c = attn.counter
            results[(ci, mode)] = {"errors": errors, "bytes": (c.forward_bytes, c.backward_bytes)}
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 5])
def test_gathered_path_is_exact_with_plan_bytes(world_size: int) -> None:
    plans = overlap_plans(world_size)
    per_rank = run_distributed(worker, world_size, [p.to_json() for p in plans], timeout_s=scaled(240.0))
    row_bytes = KV_ROW_ELEMS * 8
    for ci, plan in enumerate(plans):
        for mode in MODES:
            for rank, res in enumerate(per_rank):
                got = res[(ci, mode)]
                where = f"{plan.strategy} {mode} rank {rank}"
                assert max(got["errors"]) <= TOL, f"{where}: errors {got['errors']}"
                gather = "full" if mode == "p2p_ring" else mode
                want = planned_recv_tokens(plan, rank, gather) * row_bytes
                assert got["bytes"] == (want, want), f"{where}: {got['bytes']} != {want}"


@pytest.mark.parametrize("kernel", [ReferenceSegments(), None], ids=["segment", "varlen"])
def test_planned_call_is_every_query_against_its_gathered_keys(kernel) -> None:
    for plan in overlap_plans(3):
        for mode in GATHER_MODES:
            for rank in range(plan.cp_size):
                lay = build_layout(plan, rank)
                if lay.group_index < 0:
                    continue
                state = rank_path_state(plan, rank, "gathered", mode, kernel)
                calls = PATHS["gathered"].planned_calls(state)
                keys = int(lay.cu_seqlens_k[-1])
                want = [("segment" if kernel is not None else "varlen", "gathered", 0, lay.num_real, 0, keys)]
                assert [(c.kind, *c[2:]) for c in calls] == (want if lay.num_real else [])
                assert PATHS["gathered"].buffers(state) == {"queries": lay.num_real, "gathered": keys}
                transfers = PATHS["gathered"].planned_transfers(state)
                assert [tuple(t) for t in transfers] == [("stacked", state.exchanger.comm.recv_rows, 1)]
