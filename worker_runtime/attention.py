"""The public runtime object: one plan, this rank, a process group -> local layout and a
differentiable context-parallel attention call.

Per call the runtime picks an execution path with the plan contract's rule
(``core.paths.execution_path``: the kernel's tiling, the comm mode and ``flash_path``) and
runs it from the table ``worker_runtime.paths.PATHS`` (one module per path, docs/paths.md):

- the PyTorch kernel (exact, any device): ``lean`` for the gather modes (``full``,
  ``compact_allgather``, ``alltoallv``), ``ring`` for ``p2p_ring``;
- a segment kernel (CUDA, fp16/bf16: PyTorch's own FlashAttention by default, flash-attn
  with ``kernel="flash"``; ``aten_flash.choose_kernel``): ``segments`` (the default
  ``flash_path``) or ``segment_ring`` for ``p2p_ring``, ``gathered`` with
  ``flash_path="gathered"``. Every kernel is probed against the reference first; a refused
  one falls back with one warning (PyTorch's kernel to flash-attn under ``auto`` where
  installed, else to the PyTorch kernel; flash-attn to the gathered path with its public
  varlen function).

Only the path a call runs has its state built (once per device, segment kernel and
window). Attention sinks (``attention(..., sink=)``) merge into every path's log-sum-exp
(``sinks.py``); sliding-window layers (``attention(..., window=W)``) run on the path the
table names for them (``windows.py``). ``segment_kernel`` runs the segments path (or the
segment ring) with another kernel on any device (the tests pass the exact
``segment_kernels.ReferenceSegments``). ``overlap=False`` waits for every exchange right
after starting it (same arithmetic). Backward runs the collectives in reverse, so every
rank of a group must call backward if any does.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from planner_service.core.paths import COMM_MODES, FLASH_PATHS, ExecutionPath, execution_path
from planner_service.core.plan import Plan
from worker_runtime import dispatch as _dispatch
from worker_runtime.aten_flash import RUNTIME_KERNELS, choose_kernel, kernel_record
from worker_runtime.comm import CommCounter, Exchanger
from worker_runtime.groups import group_cache
from worker_runtime.kernels import check_window
from worker_runtime.layout import (
    CommMap,
    RankLayout,
    build_comm_map,
    build_layout,
    planned_kv_tokens_peak,
    planned_recv_tokens,
)
from worker_runtime.paths import PATHS, PathContext, windowed_path
from worker_runtime.paths.lean import local_share
from worker_runtime.paths.segment_kernels import SegmentKernel
from worker_runtime.safety import CollectiveCheckError, agree, local_input_problem
from worker_runtime.sinks import check_sink

VERIFY = ("first", "always", "never")


RUN_MODES = COMM_MODES
"""Modes a caller may ask for: the gather modes and the ring."""


def resolve_comm_mode(plan: Plan, comm_mode: str | None) -> str:
    """The exchange to run: ``comm_mode`` or the plan's own (``p2p_ring`` runs as a ring on
    the torch kernel and the segments path). Raises ValueError for an unknown mode."""
    mode = comm_mode or plan.comm_mode
    if mode not in RUN_MODES:
        raise ValueError(f"comm_mode must be one of {', '.join(RUN_MODES)} (or the plan's), got {mode!r}")
    return mode


class _DeviceState(NamedTuple):
    exchanger: Exchanger
    """The causal exchange on the device (built with the device state)."""
    paths: dict[tuple[Any, ...], Any]
    """Each path's state per (path, segment kernel name, window); built on first use."""
    shared: dict[Any, Any]
    """What several paths share on the device (a window's exchange)."""


class ContextParallelAttention:
    """Executes one plan on one rank.

    Construction is collective over ``group`` (every rank of it constructs with its own
    copy of the plan): the ranks agree on the plan_id, then the process groups of a
    multi-group plan are created (cached, same order everywhere). Raises
    CollectiveCheckError on every rank if plan_ids differ or a rank cannot run the plan,
    ValueError for a bad ``comm_mode``, ``kernel`` or ``verify``. ``agreed=True`` skips the
    plan_id all-gather for a plan every rank already holds (planner_service.client.agreement);
    a rank that cannot run it then raises CollectiveCheckError on its own. ``overlap=False``
    waits for each exchange right after starting it (same results). ``kernel``: one of
    ``aten_flash.RUNTIME_KERNELS`` (``auto``: PyTorch's FlashAttention on CUDA fp16/bf16).
    ``flash_path``: how a FlashAttention kernel runs (FLASH_PATHS; ValueError otherwise).
    ``segment_kernel``: run the segments path with this kernel whatever the device and
    dtype (module docstring).
    """

    def __init__(
        self,
        plan: Plan,
        rank: int | None = None,
        group: Any = None,
        *,
        comm_mode: str | None = None,
        kernel: str = "auto",
        verify: str = "first",
        counter: CommCounter | None = None,
        agreed: bool = False,
        overlap: bool = True,
        flash_path: str = "segments",
        segment_kernel: SegmentKernel | None = None,
    ) -> None:
        if flash_path not in FLASH_PATHS:
            raise ValueError(f"flash_path must be one of {', '.join(FLASH_PATHS)}, got {flash_path!r}")
        self.flash_path, self.segment_kernel = flash_path, segment_kernel
        if kernel not in RUNTIME_KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(RUNTIME_KERNELS)}, got {kernel!r}")
        if verify not in VERIFY:
            raise ValueError(f"verify must be one of {', '.join(VERIFY)}, got {verify!r}")
        self.plan, self.kernel, self.verify, self.overlap = plan, kernel, verify, bool(overlap)
        self.comm_mode = resolve_comm_mode(plan, comm_mode)
        # The gathered flash path and the comm map run a ring's bytes as a full exchange.
        self.gather_mode = "full" if self.comm_mode == "p2p_ring" else self.comm_mode
        self.counter = counter if counter is not None else CommCounter()
        initialised = dist.is_initialized()
        self.parent = group
        if rank is None:
            rank = dist.get_rank(group) if initialised else 0
        self.rank = rank
        size = dist.get_world_size(group) if initialised else 1
        problem = None
        try:
            self.layout: RankLayout = build_layout(plan, rank)
        except ValueError as exc:
            problem, self.layout = str(exc), build_layout(plan, 0)
        if plan.cp_size != size:
            problem = f"plan.cp_size is {plan.cp_size} but the process group has {size} ranks"
        if not agreed:
            agree(group, rank=rank, plan_id=plan.plan_id, problem=problem,
                  where="ContextParallelAttention(plan)", extra={"comm_mode": self.comm_mode})
        elif problem:
            raise CollectiveCheckError(f"ContextParallelAttention(plan): rank {rank}: {problem}")
        self.process_group: Any = None
        order = None
        if initialised:
            cache = group_cache(group)
            cache.ensure([g.ranks for g in plan.groups])
            if self.layout.group_index >= 0:
                self.process_group = cache.get(self.layout.group_ranks)
                # Slot -> rank inside the process group that runs the collectives.
                globals_ = [dist.get_global_rank(self._parent(), r) for r in self.layout.group_ranks]
                order = [dist.get_group_rank(self.process_group, g) for g in globals_]
        self.order = order
        self.comm_map: CommMap = build_comm_map(self.layout, self.gather_mode, order)
        self._states: dict[torch.device, _DeviceState] = {}
        self._verified = False

    # -- layout for the dataloader and RoPE ------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Local rows q, k, v must have (shards plus padding)."""
        return self.layout.num_tokens

    @property
    def local_token_indices(self) -> np.ndarray:
        """Global packed position of every local row; -1 for padding."""
        return self.layout.global_index

    @property
    def doc_ids(self) -> np.ndarray:
        return self.layout.doc_ids

    @property
    def positions(self) -> np.ndarray:
        """Doc-relative position of every local row (RoPE position ids); 0 for padding."""
        return self.layout.positions

    def planned_recv_tokens(self) -> int:
        """KV tokens this rank receives per forward pass according to the plan's figures."""
        return planned_recv_tokens(self.plan, self.rank, self.gather_mode)

    def planned_kv_tokens_peak(self) -> int:
        """KV tokens this rank holds at once per layer according to the plan's figures
        (the counter's ``kv_tokens_peak`` after a call on the torch kernel or the segments
        path; a ring plan holds the ``p2p_ring`` figure on both, and runs as ``full`` on
        the gathered flash path)."""
        return planned_kv_tokens_peak(self.plan, self.rank, self.comm_mode)

    def local_query_share(self) -> tuple[int, int]:
        """(queries whose keys are all local, real queries): the attention that can run
        before any remote KV arrives."""
        return local_share(self.layout, self.comm_map)

    def dispatch(self, x: torch.Tensor, pad_value: float | int = 0) -> torch.Tensor:
        """Local rows of a global packed tensor (see dispatch.dispatch)."""
        return _dispatch.dispatch(self.layout, x, pad_value)

    def undispatch(self, y: torch.Tensor, *, gather: bool = False) -> torch.Tensor:
        """Local rows back in global order; ``gather=True`` fills in the whole group's rows
        (collective, not differentiable), else other ranks' rows are zero."""
        if gather:
            return _dispatch.gather_global(self.layout, y, self.process_group, self.order)
        return _dispatch.undispatch(self.layout, y)

    # -- attention ---------------------------------------------------------------------
    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
        sink: torch.Tensor | None = None, window: int | None = None,
    ) -> torch.Tensor:
        """Context-parallel attention on local ``q [T, H, D]``, ``k, v [T, G, D]``.

        ``sink``: None, or one logit per query head ``[H]`` added to every query's softmax
        denominator (attention sinks, ``sinks.py``; differentiable, each rank's gradient is
        the part of its own queries). ``window``: None (causal) or a sliding window W, the
        query at doc position p attending keys ``[max(0, p - W + 1), p]`` (transformers'
        ``sliding_window``; ``windows.py``); every rank of the group passes the same. Returns
        the local output ``[T, H, D]``; padding rows are zero. Raises ValueError for a sink
        of another shape or a window below 1, CollectiveCheckError on
        every rank of the group if any rank's inputs do not match the plan (checked on the
        first call, or every call with verify='always').
        """
        check_sink(sink, q.shape[1])
        window = check_window(window)
        path, segment_kernel = self.execution_path(q)
        self._check(q, k, v, path, window)
        if self.layout.group_index < 0:
            # No rows; tied to q, k, v so a caller's backward gives them (empty) gradients.
            tied = (k.sum() + v.sum() + (sink.sum() if sink is not None else 0)) * 0
            return q * 0 + tied
        scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
        runner = PATHS[ExecutionPath(path)]
        if window is not None:
            runner = PATHS[windowed_path(runner.name, segment_kernel)]
        state = self.path_state(runner.name, q.device, segment_kernel, window)
        return runner.run(state, q, k, v, scale, self.overlap, sink)

    __call__ = attention

    def execution_path(self, q: torch.Tensor) -> tuple[ExecutionPath, SegmentKernel | None]:
        """(path, segment kernel) a call with queries like ``q`` runs: ``segments`` or
        ``segment_ring`` (a ``p2p_ring`` plan), ``gathered`` (a segment kernel's one call,
        or flash-attn's public varlen function: kernel None), ``ring`` or ``lean`` (the
        torch kernel); see the module docstring. Probes a kernel once per device, dtype and
        head dim (``aten_flash.choose_kernel``)."""
        path, found, _ = self._choice(q)
        return path, found

    def kernel_record(self, q: torch.Tensor) -> dict[str, str]:
        """What a call with queries like ``q`` runs: path, kernel name, FlashAttention impl
        (``FA2``, ``FA3``, ``FA4`` behind PyTorch's ops) and torch version."""
        path, found, flash_gathered = self._choice(q)
        return kernel_record(str(path), found, flash_gathered)

    def _choice(self, q: torch.Tensor) -> tuple[ExecutionPath, SegmentKernel | None, bool]:
        """(path, segment kernel, flash-attn's public function on the gathered path)."""
        if self.segment_kernel is not None:
            return execution_path("segment", self.comm_mode), self.segment_kernel, False
        found, flash_gathered = choose_kernel(self.kernel, q, self.flash_path)
        if found is not None:
            return execution_path("segment", self.comm_mode, self.flash_path), found, False
        if flash_gathered:
            return execution_path("segment", self.comm_mode, "gathered"), None, True
        return execution_path("packed", self.comm_mode), None, False

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, path: str,
               window: int | None = None) -> None:
        if self.verify == "never" or (self.verify == "first" and self._verified):
            return
        problem = local_input_problem(q, k, v, self.layout.num_tokens, self.rank)
        if self.layout.group_index < 0 or self.process_group is None:
            if problem:
                raise CollectiveCheckError(f"attention: rank {self.rank}: {problem}")
        else:
            # The path too: ranks on different paths would run different collectives.
            extra: dict[str, Any] = {"dtype": str(q.dtype), "heads": tuple(q.shape[1:]),
                                     "kv_heads": tuple(k.shape[1:]), "path": str(path)}
            if window is not None:
                # Ranks on different windows would run different exchanges.
                extra["window"] = window
            agree(self.process_group, rank=self.rank, plan_id=self.plan.plan_id, problem=problem,
                  where="attention", extra=extra)
        self._verified = True

    def exchanger(self, device: torch.device | str) -> Exchanger:
        """The KV exchange bound to ``device`` (the profiler times it alone)."""
        return self._state(torch.device(device)).exchanger

    def path_state(self, path: ExecutionPath | str, device: torch.device | str,
                   kernel: SegmentKernel | None = None, window: int | None = None) -> Any:
        """The state of ``path`` (``PATHS[path].build``) on ``device`` with segment kernel
        ``kernel`` and ``window``, built on first use; what ``PATHS[path].planned_calls``
        and ``planned_transfers`` read."""
        device = torch.device(device)
        dev = self._state(device)
        key = (ExecutionPath(path), kernel.name if kernel is not None else "", window)
        if key not in dev.paths:
            ctx = PathContext(self.layout, self.comm_map, self.gather_mode, self.process_group,
                              self.order, self.counter, device, dev.exchanger, kernel, window,
                              dev.shared, ring=self.comm_mode == "p2p_ring")
            dev.paths[key] = PATHS[key[0]].build(ctx)
        return dev.paths[key]

    def _state(self, device: torch.device) -> _DeviceState:
        if device not in self._states:
            position = dist.get_rank(self.process_group) if self.process_group is not None else 0
            exchanger = Exchanger.create(self.comm_map, self.process_group, position, self.counter, device)
            self._states[device] = _DeviceState(exchanger=exchanger, paths={}, shared={})
        return self._states[device]

    def _parent(self) -> Any:
        return self.parent if self.parent is not None else dist.group.WORLD
