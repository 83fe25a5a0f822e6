"""The step-time drivers: one rank, a whole group, every rank of a plan, on its path's model.

Each driver asks ``paths.execution_path`` for the path the runtime takes, looks its model
up in ``PATH_MODELS`` and calls it: :func:`rank_terms` (and :func:`rank_step`) the per-rank
reference, :func:`group_steps` the group form in numpy (equal to it rank by rank; tests
compare them), :func:`plan_rank_terms` every grouped rank of a plan under any profiles.

``window`` (None: causal, every result as without it) prices a sliding-window layer: on the
flash paths (``segment`` tiling) the gathered form the runtime runs under a window
(windowed.py), on the PyTorch kernel's lean path its two windowed calls
(windowed_lean.py), on the PyTorch kernel's ring its windowed steps 1 .. ``steps_run``
(windowed_ring.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from planner_service.core import paths
from planner_service.core.cost import (
    ShardArrays,
    comm_volumes,
    per_rank_sums,
    recv_tokens_by_mode,
    shard_arrays,
)
from planner_service.core.model import ModelSpec
from planner_service.core.paths import RING_PATHS, RUNTIME_FLASH_PATH, ExecutionPath
from planner_service.core.plan import Plan, Shard
from planner_service.core.profiles import KernelProfile, LinkProfile, get_kernel_profile
from planner_service.core.step_time import (
    gathered,
    lean,
    ring,
    segment_ring,
    segments,
    windowed,
    windowed_lean,
    windowed_ring,
)
from planner_service.core.step_time.terms import (
    RUNTIME_OVERLAP,
    GroupInput,
    KernelWork,
    PathModel,
    RankInput,
    Step,
    StepArrays,
    StepEstimate,
    Terms,
)

PATH_MODELS: dict[ExecutionPath, PathModel] = {
    ExecutionPath.SEGMENTS: segments.MODEL,
    ExecutionPath.GATHERED: gathered.MODEL,
    ExecutionPath.LEAN: lean.MODEL,
    ExecutionPath.RING: ring.MODEL,
    ExecutionPath.SEGMENT_RING: segment_ring.MODEL,
}
"""The model of every execution path (one module of this package each)."""


def execution_path(kernel: KernelProfile, comm_mode: str,
                   flash_path: str = RUNTIME_FLASH_PATH) -> ExecutionPath:
    """The runtime path for a kernel profile and comm mode: ``paths.execution_path`` on the
    profile's tiling. ValueError for an unknown ``flash_path``."""
    return paths.execution_path(kernel.tiling, comm_mode, flash_path)


def check_window(kernel: KernelProfile, window: int | None, comm_mode: str | None = None) -> None:
    """ValueError naming ``window`` for a window that is not None or an integer >= 1
    (every path prices a windowed layer; ``kernel`` and ``comm_mode`` are unused)."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be None (causal) or an integer >= 1, got {window!r}")


def windowed_model(path: ExecutionPath) -> Any:
    """The module pricing a windowed layer of ``path``: the lean path's and the ring's own
    calls, else the gathered form the runtime runs."""
    if path == ExecutionPath.LEAN:
        return windowed_lean
    return windowed_ring if path == ExecutionPath.RING else windowed


def held_kv_mode(kernel: str, comm_mode: str) -> str:
    """The exchange whose KV a rank holds (``cost.kv_tokens_peak``'s mode) when ``kernel``
    (a profile name) runs ``comm_mode`` on the runtime's default flash path: ``p2p_ring``
    where the runtime runs a ring (RING_PATHS), ``full`` where it runs a ring plan as the
    full all-gather (flash-attn's gathered path), else ``comm_mode`` itself."""
    if comm_mode == "p2p_ring" and execution_path(get_kernel_profile(kernel), comm_mode) not in RING_PATHS:
        return "full"
    return comm_mode


def rank_terms(
    shards: Sequence[Shard],
    *,
    recv_tokens: int,
    tokens_per_rank: int,
    num_ranks: int,
    comm_mode: str,
    model: ModelSpec,
    kernel: KernelProfile,
    link: LinkProfile,
    tiles: int | None = None,
    overlap: bool = RUNTIME_OVERLAP,
    ring_blocks: Sequence[Sequence[Shard]] | None = None,
    flash_path: str = RUNTIME_FLASH_PATH,
    window: int | None = None,
) -> Terms:
    """:func:`rank_step`'s terms with their inputs (what a fit regresses on)."""
    check_window(kernel, window, comm_mode)
    path = execution_path(kernel, comm_mode, flash_path)
    step = Step(tokens_per_rank, num_ranks, comm_mode, model, kernel, link, overlap)
    real = sum(s.end - s.start for s in shards)
    inp = RankInput(step, shards, recv_tokens, real, tiles, ring_blocks)
    if window is not None:
        return windowed_model(path).terms(inp, window)  # type: ignore[no-any-return]
    return PATH_MODELS[path].terms(inp)


def rank_step(
    shards: Sequence[Shard],
    *,
    recv_tokens: int,
    tokens_per_rank: int,
    num_ranks: int,
    comm_mode: str,
    model: ModelSpec,
    kernel: KernelProfile,
    link: LinkProfile,
    tiles: int | None = None,
    overlap: bool = RUNTIME_OVERLAP,
    ring_blocks: Sequence[Sequence[Shard]] | None = None,
    flash_path: str = RUNTIME_FLASH_PATH,
    window: int | None = None,
) -> StepEstimate:
    """Estimate one rank's per-layer time (the package docstring). O(shards + tiles) on the
    gathered path, O(M^2 D + tiles) on the segments path (M the most shards of one of the
    rank's D documents), O(M^2 D + N (shards + block shards) M) on segment_ring, O(rows +
    blocks) on the others (the reference :func:`group_steps` equals).

    ``recv_tokens``: what the rank receives per pass in ``comm_mode`` (``p2p_ring``: the
    (N - 1) x tokens_per_rank the ring's forward moves). ``tiles``: the shards' segment tiles
    when already counted (gathered path only). ``overlap``: the runtime's switch (no effect
    on the gathered path). ``ring_blocks``: on the ring paths (RING_PATHS) with N > 1, the
    shards of the blocks the rank attends at steps 1..N-1 (slots i - 1, i - 2, ... mod N).
    ``flash_path``: how a ``segment``-tiling kernel runs (FLASH_PATHS). Shards in (doc, start) order,
    disjoint, as plans hold them (the segments path takes them in local-row order).
    ``window``: a sliding-window layer (module docstring; ``recv_tokens`` then the window's
    exchange, ``tiles`` unused), O(shards + tiles).
    """
    t = rank_terms(shards, recv_tokens=recv_tokens, tokens_per_rank=tokens_per_rank,
                   num_ranks=num_ranks, comm_mode=comm_mode, model=model, kernel=kernel,
                   link=link, tiles=tiles, overlap=overlap, ring_blocks=ring_blocks,
                   flash_path=flash_path, window=window)
    return StepEstimate(float(t.kernel_ms), float(t.copy_ms), float(t.comm_ms), float(t.linear_ms))


def group_steps(
    arrays: ShardArrays,
    *,
    recv_tokens: np.ndarray,
    tokens_per_rank: int,
    num_ranks: int,
    comm_mode: str,
    model: ModelSpec,
    kernel: KernelProfile,
    link: LinkProfile,
    tiles: np.ndarray | None = None,
    overlap: bool = RUNTIME_OVERLAP,
    flash_path: str = RUNTIME_FLASH_PATH,
    window: int | None = None,
) -> StepArrays:
    """:func:`rank_step` of every rank of a group at once (equal to it rank by rank; shard i
    of ``arrays`` on rank ``arrays.rank[i]``, slot order = rank order, each rank's shards
    in its local-row order), in numpy: gathered path O(shards + tiles), segments
    O(s log s + c) for c candidate remote calls (M (M + 1) / 2 per rank, M the most shards
    of one doc on it), lean O(s log s + blocks), ring O(s log s + t + blocks) for t
    (shard, other holder of its doc) pairs, segment_ring the segments path's local calls
    and O(t log t) (segment_ring.py). No loop over ranks. ``tiles``: per-rank segment
    tiles of the gathered path when already counted (unused on the other paths).
    ``window``: as :func:`rank_step`'s (O(shards + tiles))."""
    check_window(kernel, window, comm_mode)
    n = num_ranks
    recv = np.asarray(recv_tokens, dtype=np.int64)
    real = per_rank_sums(arrays.end - arrays.start, arrays.bounds)
    path = execution_path(kernel, comm_mode, flash_path)
    step = Step(tokens_per_rank, n, comm_mode, model, kernel, link, overlap)
    inp = GroupInput(step, arrays, recv, real, tiles)
    t = (windowed_model(path).group_terms(inp, window) if window is not None
         else PATH_MODELS[path].group_terms(inp))

    def f(x: Any) -> np.ndarray:
        return np.broadcast_to(np.asarray(x, dtype=np.float64), (n,)).copy()

    return StepArrays(f(t.kernel_ms), f(t.copy_ms), f(t.comm_ms), f(t.linear_ms))


class RankTerms(NamedTuple):
    """One rank's inputs to the estimate (what a fit regresses on) and the estimate."""

    group: int
    rank: int
    path: str
    work: KernelWork
    fwd_flops: float
    copy_bytes: int
    copy_ops: int
    comm_bytes: int
    """Bytes moved over both passes."""
    passes: int
    """Collectives or ring shifts paid (0 when the rank receives nothing)."""
    peer_steps: int
    """Per-peer steps of those."""
    transfer_ms: float
    """Every transfer in full under the link profile (the exposed part is ``estimate.comm_ms``)."""
    estimate: StepEstimate


def plan_rank_terms(
    plan: Plan, kernel: KernelProfile, link: LinkProfile, *, comm_mode: str | None = None,
    model: ModelSpec | None = None, overlap: bool = RUNTIME_OVERLAP,
    flash_path: str = RUNTIME_FLASH_PATH, window: int | None = None,
) -> list[RankTerms]:
    """Per grouped rank of ``plan``, the terms of :func:`rank_step` under any profiles
    (``plan.metrics`` holds them under the plan's named profiles). ``comm_mode`` defaults
    to the plan's; ``flash_path`` is the runtime's by default. ``window``: one layer of that
    window, each rank receiving the window's exchange (core/window_work.py; ``p2p_ring``:
    the ring's ``steps_run`` blocks). O(shards +
    tiles) per rank (ring: per rank and step)."""
    mode = comm_mode or plan.comm_mode
    check_window(kernel, window, mode)
    model = model or plan.model
    out = []
    for gi, group in enumerate(plan.groups):
        n = len(group.ranks)
        tokens_per_rank = max(
            sum(s.end - s.start for s in shards) + pad
            for shards, pad in zip(group.shards, group.padding, strict=True)
        )
        recv: Sequence[int]
        if window is None:
            recv = recv_tokens_by_mode(mode, comm_volumes(group.shards), tokens_per_rank)
        else:
            from planner_service.core import window_work  # imports step_time.runs: not at the top
            arrays = shard_arrays(group.shards)
            if arrays is None:
                raise ValueError("window: the windowed model needs int64-safe shards "
                                 "(positions below 2^31)")
            volumes = window_work.window_comm_volumes_of(arrays, window)
            ring = window_work.ring_schedule_of(arrays, window) if mode == "p2p_ring" else None
            recv = list(window_work.recv_tokens(mode, volumes, tokens_per_rank, ring))
        for slot, (rank, shards, r) in enumerate(zip(group.ranks, group.shards, recv, strict=True)):
            blocks = [group.shards[(slot - s) % n] for s in range(1, n)]
            t = rank_terms(shards, recv_tokens=r, tokens_per_rank=tokens_per_rank, num_ranks=n,
                           comm_mode=mode, model=model, kernel=kernel, link=link,
                           overlap=overlap, ring_blocks=blocks, flash_path=flash_path,
                           window=window)
            est = StepEstimate(float(t.kernel_ms), float(t.copy_ms), float(t.comm_ms),
                               float(t.linear_ms))
            out.append(RankTerms(
                gi, rank, execution_path(kernel, mode, flash_path), t.work,
                4.0 * model.head_dim * model.num_heads * t.work.pairs, int(t.copy_bytes),
                int(t.rows.ops), int(t.comm_bytes), int(t.passes), int(t.peer_steps),
                float(t.transfer_ms), est,
            ))
    return out
