"""The names the planner and the runtime share for how a plan runs: its exchange (``CommMode``)
and the runtime path that executes it (``ExecutionPath``), with the one rule that picks a path.

The step-time model prices a plan on the path the runtime will take, so both ask
``execution_path`` here instead of keeping a copy of the rule. The members are ``str``
enums: they compare equal to their values and serialise as them, so plans, requests and
JSON answers read the same as plain strings.
"""

from __future__ import annotations

from enum import StrEnum


class CommMode(StrEnum):
    """How a rank receives the KV its queries need (docs/strategies.md)."""

    FULL = "full"
    COMPACT_ALLGATHER = "compact_allgather"
    ALLTOALLV = "alltoallv"
    P2P_RING = "p2p_ring"


COMM_MODES: tuple[str, ...] = tuple(m.value for m in CommMode)
"""Every exchange a request or plan may name, in the contract's order."""

GATHER_MODES: tuple[str, ...] = (CommMode.FULL.value, CommMode.COMPACT_ALLGATHER.value,
                                 CommMode.ALLTOALLV.value)
"""The exchanges with a comm map (one collective before attention); ``p2p_ring`` instead
runs as a ring, or as ``full`` where the path has no ring."""


class ExecutionPath(StrEnum):
    """The five ways the runtime executes attention over a plan (docs/runtime.md)."""

    SEGMENTS = "segments"
    """Flash kernels: one varlen call per (query piece, key piece) pair, merged by LSE."""
    GATHERED = "gathered"
    """Flash kernels: one varlen call on per-shard gathered keys."""
    LEAN = "lean"
    """The PyTorch kernel on gathered exchanges, overlapped with the transfer."""
    RING = "ring"
    """The PyTorch kernel on a ``p2p_ring`` plan: KV passed round the ranks."""
    SEGMENT_RING = "segment_ring"
    """Flash kernels on a ``p2p_ring`` plan: the segments path's calls per ring step."""


PATHS: tuple[str, ...] = tuple(p.value for p in ExecutionPath)
RING_PATHS: tuple[str, ...] = (ExecutionPath.RING.value, ExecutionPath.SEGMENT_RING.value)
"""The paths that run a ``p2p_ring`` plan as a ring (the others run it as ``full``)."""

FLASH_PATHS: tuple[str, ...] = (ExecutionPath.SEGMENTS.value, ExecutionPath.GATHERED.value)
"""How flash kernels run (``ContextParallelAttention(flash_path=...)``)."""

RUNTIME_FLASH_PATH = ExecutionPath.SEGMENTS.value
"""The runtime's default flash path; ``gathered`` runs on opt-out or when no segment kernel
passes the runtime's probe."""

TILINGS = ("segment", "packed")
"""A kernel's tiling: ``segment`` for flash kernels (one call per piece pair), ``packed`` for
the PyTorch kernel (one masked call on packed rows)."""


def execution_path(tiling: str, comm_mode: str, flash_path: str = RUNTIME_FLASH_PATH) -> ExecutionPath:
    """The path a kernel of ``tiling`` takes for ``comm_mode``: flash kernels (``segment``)
    run ``flash_path``, a ``p2p_ring`` plan on the segments flash path as ``segment_ring``;
    the PyTorch kernel (``packed``) runs a ring for ``p2p_ring`` and the lean path otherwise.
    O(1). ValueError for an unknown ``tiling`` or ``flash_path``."""
    if flash_path not in FLASH_PATHS:
        raise ValueError(f"flash_path must be one of {', '.join(FLASH_PATHS)}, got {flash_path!r}")
    if tiling not in TILINGS:
        raise ValueError(f"tiling must be one of {', '.join(TILINGS)}, got {tiling!r}")
    ring = comm_mode == CommMode.P2P_RING
    if tiling == "segment":
        if ring and flash_path == ExecutionPath.SEGMENTS:
            return ExecutionPath.SEGMENT_RING
        return ExecutionPath(flash_path)
    return ExecutionPath.RING if ring else ExecutionPath.LEAN
