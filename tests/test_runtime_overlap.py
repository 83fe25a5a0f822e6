"""Overlap off, ring execution and the KV-memory counter on spawned gloo worlds of 3, 5 and
8 ranks: float64 results equal the dense reference, bytes equal the plan's figures (per
ring step too), and the KV tokens a rank holds equal the plan's ``kv_tokens_peak``.

(Overlap on, the default, runs in test_runtime_dist for every strategy and comm mode.)
One spawned world per world size runs every case.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_runtime_dist import (
    KV_ROW_ELEMS,
    MULTI_GROUPS,
    multi_group_plan,
    random_doc_lengths,
    reference_case,
    run_against_reference,
    solve_any,
)
from timing import scaled

from planner_service.core.plan import Plan
from worker_runtime import (
    GATHER_MODES,
    ContextParallelAttention,
    build_comm_map,
    build_layout,
    planned_kv_tokens_peak,
    planned_recv_tokens,
)
from worker_runtime.overlap import local_share
from worker_runtime.testing import run_distributed

pytestmark = pytest.mark.slow  # long: starts first under xdist (tests/conftest.py)

TOL = 1e-10
STRATEGIES = ("flashcp", "per_doc", "zigzag", "fcp")
CASES = [(mode, False) for mode in GATHER_MODES] + [("p2p_ring", True), ("p2p_ring", False)]
"""(comm mode, overlap): the gather modes with overlap off, the ring with it on and off."""


def plans_for(world_size: int) -> list[Plan]:
    lengths = random_doc_lengths(100 + world_size, world_size)
    # Planned for the kernel these worlds run (the PyTorch kernel runs p2p_ring as a ring,
    # so the plan's own kv_tokens_peak is the ring's).
    plans = [solve_any(lengths, world_size, s, kernel="cpu-torch", link="gloo-local")
             for s in STRATEGIES]
    if world_size in MULTI_GROUPS:
        plans.append(multi_group_plan(lengths, MULTI_GROUPS[world_size], world_size))
    return plans


def worker(rank: int, world_size: int, plan_jsons: list[str]) -> dict:
    results = {}
    for ci, text in enumerate(plan_jsons):
        plan = Plan.from_json(text)
        case = reference_case(plan, ci)
        for mode, overlap in CASES:
            attn = ContextParallelAttention(plan, comm_mode=mode, overlap=overlap)
            _, errors = run_against_reference(attn, case)
            c = attn.counter
            results[(ci, mode, overlap)] = {
                "errors": errors, "bytes": (c.forward_bytes, c.backward_bytes),
                "history": list(c.history), "peak": c.kv_tokens_peak,
                "tokens": attn.num_tokens, "in_group": attn.layout.group_index >= 0,
            }
    return results


@pytest.mark.parametrize("world_size", [3, 5, 8])
def test_overlap_off_and_ring_are_exact_with_plan_bytes_and_kv_peak(world_size: int) -> None:
    plans = plans_for(world_size)
    per_rank = run_distributed(worker, world_size, [p.to_json() for p in plans], timeout_s=scaled(240.0))
    row_bytes = KV_ROW_ELEMS * 8
    for ci, plan in enumerate(plans):
        for mode, overlap in CASES:
            for rank, res in enumerate(per_rank):
                got = res[(ci, mode, overlap)]
                where = f"{plan.strategy} {mode} overlap={overlap} rank {rank}"
                assert max(got["errors"]) <= TOL, f"{where}: errors {got['errors']}"
                assert got["peak"] == planned_kv_tokens_peak(plan, rank, mode), where
                if mode == "p2p_ring":
                    want = planned_recv_tokens(plan, rank, "full") * row_bytes
                    assert got["bytes"] == (want, 2 * want), f"{where}: {got['bytes']} != {want}"
                    steps = [b for d, b in got["history"] if d == "forward"]
                    assert all(b == got["tokens"] * row_bytes for b in steps), f"{where}: {steps}"
                    size = len(next((g.ranks for g in plan.groups if rank in g.ranks), ()))
                    assert len(steps) == max(size - 1, 0), where
                else:
                    want = planned_recv_tokens(plan, rank, mode) * row_bytes
                    assert got["bytes"] == (want, want), f"{where}: {got['bytes']} != {want}"
        # The plan's own figure: what the runtime holds in the plan's own mode.
        for group in plan.groups:
            for slot, rank in enumerate(group.ranks):
                got = per_rank[rank][(ci, plan.comm_mode, False)]["peak"]
                assert got == group.rank_stats.kv_tokens_peak[slot], f"{plan.strategy} rank {rank}"


def test_kv_peak_is_the_distinct_kv_and_local_share_matches_brute_force() -> None:
    """Gather modes hold, per doc, the prefix up to the rank's last shard end once (never
    more than the per-shard gathered keys); a query is local iff every key it sees is."""
    for world_size in (3, 5, 8):
        for plan in plans_for(world_size):
            for group in plan.groups:
                for slot, rank in enumerate(group.ranks):
                    shards = group.shards[slot]
                    ends: dict[int, int] = {}
                    for d, _, e in shards:
                        ends[d] = max(ends.get(d, 0), e)
                    peak = planned_kv_tokens_peak(plan, rank, "alltoallv")
                    assert peak == sum(ends.values()) <= sum(e for _, _, e in shards)
                    lay = build_layout(plan, rank)
                    held = {(d, p) for d, s, e in shards for p in range(s, e)}
                    local = sum(all((d, j) in held for j in range(p + 1))
                                for d, s, e in shards for p in range(s, e))
                    for mode in GATHER_MODES:
                        comm = build_comm_map(lay, mode)
                        assert local_share(lay, comm) == (local, lay.num_real)
                        assert len(comm.remote_index) == peak - lay.num_real
                        assert np.all(np.diff(comm.remote_doc * 10**6 + comm.remote_pos) > 0)
