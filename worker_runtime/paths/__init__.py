"""The runtime's execution paths, one module per ``core.paths.ExecutionPath`` member, and
the table ``ContextParallelAttention`` runs them from (docs/paths.md).

- ``segments.py``: flash kernels, the piece calls of ``pieces.py`` merged by log-sum-exp
  around an overlapped exchange;
- ``gathered.py``: flash kernels, one varlen call on every shard's gathered keys;
- ``lean.py``: the PyTorch kernel on the gather modes, local part while the exchange flies;
- ``ring.py``: the PyTorch kernel on ``p2p_ring`` plans, N - 1 point-to-point steps;
- ``segment_ring.py``: flash kernels on ``p2p_ring`` plans, piece calls per ring step.

Shared: ``base.py`` (the context, the table's entry type, planned calls and transfers),
``merge.py`` (the log-sum-exp merge), ``rows.py`` (rows that see a key set),
``ring_steps.py`` (the ring's step loops), ``pieces.py`` and ``piece_calls.py`` (the piece
decomposition and its calls), ``segment_kernels.py`` (the segment kernel contract).
"""

from __future__ import annotations

from types import ModuleType

from planner_service.core.paths import ExecutionPath
from worker_runtime.paths import gathered, lean, ring, segment_ring, segments
from worker_runtime.paths.base import (
    PathContext,
    PlannedCall,
    PlannedTransfer,
    RuntimePath,
    standalone_context,
)
from worker_runtime.paths.segment_kernels import SegmentKernel
from worker_runtime.paths.window_pieces import native_window


def _entry(name: ExecutionPath, module: ModuleType, windowed: ExecutionPath) -> RuntimePath:
    return RuntimePath(name, module.build, module.run, module.planned_calls,
                       module.planned_transfers, module.buffers, windowed)


PATHS: dict[ExecutionPath, RuntimePath] = {
    ExecutionPath.SEGMENTS: _entry(ExecutionPath.SEGMENTS, segments, ExecutionPath.GATHERED),
    ExecutionPath.GATHERED: _entry(ExecutionPath.GATHERED, gathered, ExecutionPath.GATHERED),
    ExecutionPath.LEAN: _entry(ExecutionPath.LEAN, lean, ExecutionPath.LEAN),
    ExecutionPath.RING: _entry(ExecutionPath.RING, ring, ExecutionPath.RING),
    ExecutionPath.SEGMENT_RING: _entry(ExecutionPath.SEGMENT_RING, segment_ring, ExecutionPath.GATHERED),
}
"""Every path's entry: ``PATHS[path].build(ctx)`` once, then ``.run(state, ...)`` per call."""


NATIVE_WINDOW = (ExecutionPath.SEGMENTS, ExecutionPath.SEGMENT_RING)
"""Paths whose table entry names the gathered form under a window but that run a window
themselves on a kernel with positional masks (``window_pieces.native_window``)."""


def windowed_path(path: ExecutionPath, kernel: SegmentKernel | None) -> ExecutionPath:
    """The path a sliding-window call of ``path`` on segment kernel ``kernel`` runs."""
    if path in NATIVE_WINDOW and native_window(kernel):
        return path
    return PATHS[path].windowed


__all__ = ["PATHS", "PathContext", "PlannedCall", "PlannedTransfer", "RuntimePath", "standalone_context",
           "windowed_path"]
