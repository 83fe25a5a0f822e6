"""The shared names of comm modes and execution paths (``core.paths``) and the path rule."""

from __future__ import annotations

import json

import pytest

from planner_service.core.paths import (
    COMM_MODES,
    FLASH_PATHS,
    GATHER_MODES,
    PATHS,
    RING_PATHS,
    CommMode,
    ExecutionPath,
    execution_path,
)


def test_names_are_their_values_in_json_and_comparisons():
    assert json.dumps([CommMode.P2P_RING, ExecutionPath.SEGMENT_RING]) == '["p2p_ring", "segment_ring"]'
    assert ExecutionPath.LEAN == "lean" and f"{CommMode.FULL}" == "full"
    assert COMM_MODES == ("full", "compact_allgather", "alltoallv", "p2p_ring")
    assert GATHER_MODES == COMM_MODES[:3] and set(RING_PATHS) | set(FLASH_PATHS) < set(PATHS)


@pytest.mark.parametrize("mode", COMM_MODES)
def test_the_rule_picks_one_path_per_tiling_mode_and_flash_path(mode):
    ring = mode == "p2p_ring"
    assert execution_path("packed", mode) == ("ring" if ring else "lean")
    assert execution_path("segment", mode) == ("segment_ring" if ring else "segments")
    assert execution_path("segment", mode, "gathered") == "gathered"
    assert all(isinstance(execution_path(t, mode), ExecutionPath) for t in ("packed", "segment"))


def test_unknown_tiling_or_flash_path_is_refused():
    with pytest.raises(ValueError, match="flash_path must be one of segments, gathered"):
        execution_path("segment", "full", "dense")
    with pytest.raises(ValueError, match="tiling must be one of"):
        execution_path("tiles", "full")
