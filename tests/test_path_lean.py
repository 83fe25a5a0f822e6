"""The lean path (the PyTorch kernel on the gather modes) with overlap off, and its KV
memory: on spawned gloo worlds of 3, 5 and 8 ranks float64 results equal the dense
reference, bytes equal the plan's figures, and the KV tokens a rank holds equal the plan's
``kv_tokens_peak``; the distinct KV and the local query share against brute force.

(Overlap on, the default, runs in test_runtime_dist for every strategy and comm mode; the
ring's worlds in test_path_ring.) One spawned world per world size runs every case.
"""

from __future__ import annotations

import numpy as np
import pytest
from runtime_cases import check_overlap_world, overlap_plans, rank_path_state

from worker_runtime import (
    GATHER_MODES,
    build_comm_map,
    build_layout,
    planned_kv_tokens_peak,
)
from worker_runtime.paths import PATHS
from worker_runtime.paths.lean import local_share

pytestmark = pytest.mark.slow  # long: starts first under xdist (tests/conftest.py)

CASES = [(mode, False) for mode in GATHER_MODES]
"""(comm mode, overlap): the gather modes with overlap off."""


@pytest.mark.parametrize("world_size", [3, 5, 8])
def test_overlap_off_is_exact_with_plan_bytes_and_kv_peak(world_size: int) -> None:
    check_overlap_world(world_size, CASES)


def test_kv_peak_is_the_distinct_kv_and_local_share_matches_brute_force() -> None:
    """Gather modes hold, per doc, the prefix up to the rank's last shard end once (never
    more than the per-shard gathered keys); a query is local iff every key it sees is."""
    for world_size in (3, 5, 8):
        for plan in overlap_plans(world_size):
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


def test_planned_calls_are_the_local_and_remote_parts() -> None:
    """The local call (own rows against own rows), the remote call where a query sees a
    remote key (those queries against the distinct remote KV), the split exchange."""
    for plan in overlap_plans(5):
        for rank in range(plan.cp_size):
            lay = build_layout(plan, rank)
            if lay.group_index < 0:
                continue
            for mode in GATHER_MODES:
                comm = build_comm_map(lay, mode)
                state = rank_path_state(plan, rank, "lean", mode)
                r = lay.num_real
                local, real = local_share(lay, comm)
                want = [("local", 0, r, 0, r)]
                if real - local:
                    want.append(("remote", 0, real - local, 0, len(comm.remote_index)))
                assert [c[2:] for c in PATHS["lean"].planned_calls(state)] == want
                transfers = PATHS["lean"].planned_transfers(state)
                assert [tuple(t) for t in transfers] == [("split", comm.recv_rows, 1)]
