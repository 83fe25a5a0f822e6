"""Per-layer step-time estimate of one rank: what the worker runtime executes, term by term.

The runtime (worker_runtime/attention.py, comm.py) runs one attention layer as: stack the
local K and V, one blocking KV collective, gather every shard's keys ``[0, e)`` into
contiguous K and V (``index_select``), one varlen kernel call on the real queries, zero
rows appended for padding; backward mirrors it (kernel backward, scatter-add of the key
gradients, one blocking all-to-all returning dK/dV to their owners, add into the local
gradient). A ``p2p_ring`` plan runs as the full all-gather: same bytes, one kernel call,
no overlap. Nothing overlaps anything, so the estimate is a plain sum:

``kernel``  tiles x FLOPs per tile at the profile's rate, plus per-call, per-segment and
            per-tile overheads. Two tilings, as the two kernels loop:
            ``segment`` (FlashAttention): each shard of s queries starting at doc
            position p runs in ceil(s / tile_q) query tiles, query tile j reading
            ceil((p + min((j + 1) tile_q, s)) / tile_k) key tiles; a started tile costs a
            full tile (tile quantisation; FlashCP Fig. 3, WLB-LLM section 5).
            ``packed`` (the runtime's PyTorch kernel): query blocks of tile_q rows of the
            packed local queries, each against the key span from its first row's segment
            start to its last row's limit, in blocks of tile_k keys; FLOPs are the exact
            block sizes (dense inside a block), each block pair pays ``per_tile_us``.
``copy``    the runtime's copies around the kernel, in bytes (see :func:`copy_bytes`), at
            the profile's copy bandwidth, plus a fixed cost per eager op.
``comm``    two blocking collectives (forward KV, backward dK/dV), each latency + a step
            cost per peer (N - 1 sends and receives) + received bytes / bandwidth,
            exposed in full.
``linear``  the layer's GEMMs on every local row, padding included.

Padding rows cost copies and linear time, not kernel time (the kernel sees real rows only),
and travel in the ``full`` exchange (its buffers are whole local buffers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from planner_service.core.cost import comm_volumes, recv_tokens_by_mode
from planner_service.core.model import ModelSpec
from planner_service.core.plan import Plan, Shard
from planner_service.core.profiles import KernelProfile, LinkProfile

BWD_FLOP_RATIO = 2.5
"""Backward attention does 2.5x the forward FLOPs (5 vs 2 matmuls; FlashAttention-2 paper)."""

COPY_OPS = 16
"""Eager tensor ops around the kernel per forward+backward call (attention.py, comm.py):
forward stack, send index_select, buffer fill, receive concat, source concat, two key
gathers, padding concat; backward two gather scatter-adds with their zero buffers, local
clone, receive buffer, gradient index_add, stack split."""


def attention_tiles(shards: Sequence[Shard], tile_q: int, tile_k: int) -> int:
    """Number of (tile_q x tile_k) tiles the causal varlen kernel computes for ``shards``."""
    return int(attention_tiles_per_shard(shards, tile_q, tile_k).sum())


def attention_tiles_per_shard(shards: Sequence[Shard], tile_q: int, tile_k: int) -> np.ndarray:
    """Tiles per shard (vectorised over shards and query tiles; O(tiles) time)."""
    if not shards:
        return np.zeros(0, dtype=np.int64)
    # Lists of ints convert to arrays far faster than the shard tuples themselves.
    starts = np.array([s.start for s in shards], dtype=np.int64)
    lengths = np.array([s.end - s.start for s in shards], dtype=np.int64)
    return attention_tiles_of(starts, lengths, tile_q, tile_k)


def attention_tiles_of(starts: np.ndarray, lengths: np.ndarray, tile_q: int, tile_k: int) -> np.ndarray:
    """``attention_tiles_per_shard`` from int64 arrays of shard starts and lengths."""
    if not len(starts):
        return np.zeros(0, dtype=np.int64)
    q_tiles = -(-lengths // tile_q)
    shard_of_tile = np.repeat(np.arange(len(starts)), q_tiles)
    # Index of each query tile within its shard: 0, 1, ... per shard.
    first = np.cumsum(q_tiles) - q_tiles
    j = np.arange(int(q_tiles.sum()), dtype=np.int64) - np.repeat(first, q_tiles)
    last_row = starts[shard_of_tile] + np.minimum((j + 1) * tile_q, lengths[shard_of_tile])
    return np.bincount(shard_of_tile, weights=-(-last_row // tile_k), minlength=len(starts)).astype(
        np.int64
    )


class KernelWork(NamedTuple):
    """What one rank's kernel call computes."""

    pairs: int
    """Query-key pairs computed (masked ones inside a computed tile included)."""
    tiles: int
    """Tiles (segment tiling) or block pairs (packed tiling) visited."""
    segments: int
    """Varlen segments (shards)."""
    row_blocks: int
    """Query tiles (segment tiling) or query blocks (packed tiling)."""


def packed_blocks(shards: Sequence[Shard], block_q: int, block_k: int) -> tuple[int, int, int]:
    """(pairs, block pairs, query blocks) of the runtime's PyTorch kernel (worker_runtime/kernels.py
    ``build_meta``): query blocks of ``block_q`` packed rows, each against the keys from its
    first row's segment start to its last row's limit, cut into ``block_k`` key blocks.
    O(shards + query blocks)."""
    shards = [s for s in shards if s.end > s.start]
    if not shards:
        return 0, 0, 0
    lq = np.array([s.end - s.start for s in shards], dtype=np.int64)
    lk = np.array([s.end for s in shards], dtype=np.int64)
    cu_q = np.concatenate(([0], np.cumsum(lq)))
    cu_k = np.concatenate(([0], np.cumsum(lk)))
    q0 = np.arange(0, int(cu_q[-1]), block_q, dtype=np.int64)
    q1 = np.minimum(q0 + block_q, cu_q[-1])
    seg_first = np.searchsorted(cu_q, q0, side="right") - 1
    seg_last = np.searchsorted(cu_q, q1 - 1, side="right") - 1
    k_lo = cu_k[seg_first]
    k_hi = cu_k[seg_last] + (lk - lq)[seg_last] + (q1 - 1 - cu_q[seg_last]) + 1
    span = k_hi - k_lo
    return int(((q1 - q0) * span).sum()), int((-(-span // block_k)).sum()), len(q0)


def kernel_work(shards: Sequence[Shard], kernel: KernelProfile, *, tiles: int | None = None) -> KernelWork:
    """Pairs, tiles and segments of one rank's kernel call under ``kernel``'s tiling.

    ``tiles`` may be passed when already counted (segment tiling only).
    """
    if kernel.tiling == "packed":
        pairs, blocks, rows = packed_blocks(shards, kernel.tile_q, kernel.tile_k)
        return KernelWork(pairs, blocks, len(shards), rows)
    if tiles is None:
        tiles = attention_tiles(shards, kernel.tile_q, kernel.tile_k)
    rows = sum(-(-(s.end - s.start) // kernel.tile_q) for s in shards)
    return KernelWork(tiles * kernel.tile_q * kernel.tile_k, tiles, len(shards), rows)


def kernel_ms(work: KernelWork, model: ModelSpec, kernel: KernelProfile, *, num_calls: int = 1) -> float:
    """Forward+backward kernel time in milliseconds for ``work``."""
    fwd_flops = 4.0 * model.head_dim * model.num_heads * work.pairs
    compute_s = fwd_flops / (kernel.fwd_tflops * 1e12) + (
        BWD_FLOP_RATIO * fwd_flops / (kernel.bwd_tflops * 1e12)
    )
    overhead_us = (
        num_calls * kernel.call_overhead_us
        + work.segments * kernel.per_seq_us
        + work.tiles * kernel.per_tile_us
        + work.row_blocks * kernel.per_row_block_us
    )
    return compute_s * 1e3 + overhead_us * 1e-3


def attention_ms(
    shards: Sequence[Shard],
    model: ModelSpec,
    kernel: KernelProfile,
    *,
    num_calls: int = 1,
    tiles: int | None = None,
) -> float:
    """Forward+backward attention kernel time of one rank in milliseconds.

    ``tiles`` may be passed when already counted (attention_tiles of ``shards``).
    """
    return kernel_ms(kernel_work(shards, kernel, tiles=tiles), model, kernel, num_calls=num_calls)


def key_rows(shards: Sequence[Shard]) -> int:
    """Rows of the gathered K (and V) the kernel reads: keys ``[0, e)`` for every shard."""
    return sum(s.end for s in shards)


def copy_bytes(
    *, tokens_per_rank: int, recv_tokens: int, key_tokens: int, real_tokens: int, model: ModelSpec
) -> int:
    """Bytes written by the runtime's copies around the kernel, forward + backward.

    KV rows (K and V, ``kv_bytes_per_token``): forward stack (T), send gather and receive
    concat (~2R), source concat (T + R), key gathers (Kk); backward zeroed source
    gradient (T + R), key scatter-add (Kk), local clone (T), returned-gradient add (~R),
    stack split (T). Query-shaped rows (H heads): output padding concat (T) and the
    kernel's query slice (real rows). T local rows with padding, R received, Kk key rows.
    """
    kv_rows = 4 * tokens_per_rank + 5 * recv_tokens + 2 * key_tokens
    q_row = model.num_heads * model.head_dim * model.dtype_bytes
    return kv_rows * model.kv_bytes_per_token + (tokens_per_rank + real_tokens) * q_row


def copy_ms(num_bytes: int, kernel: KernelProfile) -> float:
    """Copy time: bytes / copy bandwidth + one eager-op overhead per op (COPY_OPS)."""
    return num_bytes / (kernel.copy_gbps * 1e9) * 1e3 + COPY_OPS * kernel.op_overhead_us * 1e-3


def transfer_ms(num_bytes: int, link: LinkProfile, peers: int = 1) -> float:
    """One blocking collective with ``peers`` other ranks: latency + per-peer step cost
    + bytes / bandwidth."""
    return (link.latency_us + peers * link.per_peer_us) * 1e-3 + num_bytes / (link.bandwidth_gbps * 1e9) * 1e3


def linear_ms(tokens: int, model: ModelSpec, kernel: KernelProfile) -> float:
    """Forward+backward time of one layer's linear layers for ``tokens`` (padding included)."""
    return tokens * model.linear_flops_per_token / (kernel.linear_tflops * 1e12) * 1e3


class StepEstimate(NamedTuple):
    """Per-layer forward+backward estimate of one rank, by term."""

    kernel_ms: float
    copy_ms: float
    comm_ms: float
    """Exposed communication: all of it (the runtime's collectives block)."""
    linear_ms: float

    @property
    def attn_ms(self) -> float:
        """The attention layer without its exchange: kernel + copies."""
        return self.kernel_ms + self.copy_ms

    @property
    def layer_ms(self) -> float:
        """The attention layer as the runtime runs it: kernel + copies + exchange."""
        return self.kernel_ms + self.copy_ms + self.comm_ms

    @property
    def total_ms(self) -> float:
        return self.kernel_ms + self.copy_ms + self.comm_ms + self.linear_ms


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
) -> StepEstimate:
    """Estimate one rank's per-layer time (module docstring). O(shards + tiles).

    ``recv_tokens`` is what the rank receives per pass in ``comm_mode`` (for ``p2p_ring``
    the full all-gather's (N - 1) x tokens_per_rank, which the runtime runs instead).
    Each pass with anything received costs one collective; forward and backward move the
    same bytes. ``comm_mode`` does not change the terms: the runtime runs every mode as
    one blocking collective per pass (over ``num_ranks`` - 1 peers) and one kernel call.
    """
    del comm_mode  # every mode runs as one blocking collective per pass
    real = sum(s.end - s.start for s in shards)
    work = kernel_work(shards, kernel, tiles=tiles if kernel.tiling == "segment" else None)
    copies = copy_bytes(
        tokens_per_rank=tokens_per_rank, recv_tokens=recv_tokens, key_tokens=key_rows(shards),
        real_tokens=real, model=model,
    )
    comm = (
        2 * transfer_ms(recv_tokens * model.kv_bytes_per_token, link, num_ranks - 1)
        if recv_tokens
        else 0.0
    )
    return StepEstimate(
        kernel_ms(work, model, kernel),
        copy_ms(copies, kernel) if tokens_per_rank else 0.0,
        comm,
        linear_ms(tokens_per_rank, model, kernel),
    )


class RankTerms(NamedTuple):
    """One rank's inputs to the estimate (what a fit regresses on) and the estimate."""

    group: int
    rank: int
    work: KernelWork
    fwd_flops: float
    copy_bytes: int
    comm_bytes: int
    """Bytes received over both passes (forward KV, backward dK/dV)."""
    passes: int
    """Blocking collectives paid: 2 when this rank receives anything, else 0."""
    peer_steps: int
    """passes x (N - 1): the per-peer steps of those collectives."""
    estimate: StepEstimate


def plan_rank_terms(
    plan: Plan, kernel: KernelProfile, link: LinkProfile, *, comm_mode: str | None = None,
    model: ModelSpec | None = None,
) -> list[RankTerms]:
    """Per grouped rank of ``plan``, the terms of :func:`rank_step` under any profiles
    (``plan.metrics`` holds them under the plan's named profiles). ``comm_mode`` defaults
    to the plan's. O(shards + tiles)."""
    mode = comm_mode or plan.comm_mode
    model = model or plan.model
    out = []
    for gi, group in enumerate(plan.groups):
        tokens_per_rank = max(
            sum(s.end - s.start for s in shards) + pad
            for shards, pad in zip(group.shards, group.padding, strict=True)
        )
        recv = recv_tokens_by_mode(mode, comm_volumes(group.shards), tokens_per_rank)
        for rank, shards, r in zip(group.ranks, group.shards, recv, strict=True):
            work = kernel_work(shards, kernel)
            copies = copy_bytes(
                tokens_per_rank=tokens_per_rank, recv_tokens=r, key_tokens=key_rows(shards),
                real_tokens=sum(s.end - s.start for s in shards), model=model,
            )
            est = rank_step(shards, recv_tokens=r, tokens_per_rank=tokens_per_rank,
                            num_ranks=len(group.ranks), comm_mode=mode, model=model,
                            kernel=kernel, link=link)
            out.append(RankTerms(
                gi, rank, work, 4.0 * model.head_dim * model.num_heads * work.pairs, copies,
                2 * r * model.kv_bytes_per_token, 2 if r else 0,
                (2 if r else 0) * (len(group.ranks) - 1), est,
            ))
    return out
