"""What every runtime path shares: the context its state is built from, its entry in the
runtime's table, and the kernel calls and transfers it lists for a layout.

A path (``worker_runtime.paths.<name>``, one per ``core.paths.ExecutionPath``) provides
``build(ctx) -> state`` (numpy decomposition and device tensors, built once per device,
kernel and window), ``run(state, q, k, v, scale, overlap, sink) -> out`` (its autograd
function) and ``planned_calls(state)`` / ``planned_transfers(state)``: every kernel call and
every transfer one forward + backward makes, so a harness (``bench/model_check.py``) and the
model-equals-runtime tests time or count them without re-deriving the path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from planner_service.core.paths import ExecutionPath
from worker_runtime.comm import CommCounter, Exchanger
from worker_runtime.layout import CommMap, RankLayout, build_comm_map
from worker_runtime.paths.segment_kernels import SegmentKernel


class PathContext(NamedTuple):
    """What a path's state is built from: one rank's layout on one device."""

    layout: RankLayout
    comm_map: CommMap
    """The causal comm map of ``gather_mode``."""
    gather_mode: str
    """The gather exchange (a ``p2p_ring`` plan's bytes run as ``full``)."""
    group: Any
    order: Any
    """``order[slot]``: the slot's rank inside ``group`` (None: slot order)."""
    counter: CommCounter
    device: torch.device
    exchanger: Exchanger | None
    """The causal exchange on ``device`` (None: a harness without a process group)."""
    kernel: SegmentKernel | None
    """The segment kernel (None on the PyTorch kernel or flash-attn's public function)."""
    window: int | None = None
    """A sliding-window layer's W (None: causal)."""
    shared: dict[Any, Any] | None = None
    """The device's cache of what several paths share (a window's exchange), or None."""
    ring: bool = False
    """A ``p2p_ring`` plan (its gather runs as ``full``; under a window the gathered form
    moves only the blocks of the ring's steps 1 .. ``steps_run``, ``windows.py``)."""

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` once per ``key`` on this device (every time without a cache)."""
        if self.shared is None:
            return build()
        if key not in self.shared:
            self.shared[key] = build()
        return self.shared[key]


def standalone_context(layout: RankLayout, comm_mode: str, device: torch.device,
                       kernel: SegmentKernel | None = None) -> PathContext:
    """``layout``'s rank on ``device`` without a process group, for harnesses that build a
    path's state to list or time its calls (nothing may be exchanged over it); a
    ``p2p_ring`` plan's gather runs as ``full``."""
    gather = "full" if comm_mode == "p2p_ring" else comm_mode
    comm = build_comm_map(layout, gather)
    counter = CommCounter()
    return PathContext(layout, comm, gather, None, None, counter, device,
                       Exchanger.create(comm, None, 0, counter, device), kernel,
                       ring=comm_mode == "p2p_ring")


class PlannedCall(NamedTuple):
    """One kernel call a forward + backward makes (each is run forward and backward).

    ``kind``: ``torch`` (``kernels.attention_forward``/``attention_backward`` on a
    ``VarlenMeta``), ``segment`` (the segment kernel's forward/backward on a
    ``SegmentMeta``) or ``varlen`` (``kernels.varlen_attention`` under autograd: the
    gathered path's call without a segment kernel). Queries are rows ``[q_lo, q_hi)`` of
    the path's query rows, keys rows ``[k_lo, k_hi)`` of key buffer ``buffer``."""

    kind: str
    meta: Any
    buffer: str
    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int


class PlannedTransfer(NamedTuple):
    """One kind of transfer a forward + backward makes, ``times`` times.

    ``kind``: ``split`` (the K/V collectives and the dK/dV ones, K and V apart:
    ``Exchanger.start_forward`` / ``start_backward``), ``stacked`` (the stacked K/V
    exchange, blocking: ``Exchanger.forward`` / ``backward``) or ``shift`` (one ring step:
    a ``rows``-row K/V block to the next slot)."""

    kind: str
    rows: int
    times: int


class RuntimePath(NamedTuple):
    """A path's entry in ``worker_runtime.paths.PATHS``."""

    name: ExecutionPath
    build: Callable[[PathContext], Any]
    run: Callable[..., torch.Tensor]
    """``run(state, q, k, v, scale, overlap, sink) -> out [T, H, D]``."""
    planned_calls: Callable[[Any], tuple[PlannedCall, ...]]
    planned_transfers: Callable[[Any], tuple[PlannedTransfer, ...]]
    buffers: Callable[[Any], dict[str, int]]
    """Rows of every key buffer ``planned_calls`` names, and ``queries``: the query rows."""
    windowed: ExecutionPath
    """The path a sliding-window call takes (windows.py): itself, or the gathered form."""
