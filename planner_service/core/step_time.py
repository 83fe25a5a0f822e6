"""Per-layer step-time estimate: attention kernel + exposed KV comm + linear layers.

The kernel model counts FlashAttention tiles: a shard of s queries starting at doc
position p is processed in ceil(s / tile_q) query tiles, and query tile j (rows up to
p + min((j + 1) tile_q, s)) reads ceil(that / tile_k) key tiles. A started tile costs a
full tile, so short shards waste work (tile quantisation); each kernel call and each
varlen sequence adds a fixed overhead. This is why fine sharding runs slower (FlashCP
Fig. 3, WLB-LLM section 5). Comm is latency + bytes / bandwidth per collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from planner_service.core.model import ModelSpec
from planner_service.core.plan import Shard
from planner_service.core.profiles import KernelProfile, LinkProfile

BWD_FLOP_RATIO = 2.5
"""Backward attention does 2.5x the forward FLOPs (5 vs 2 matmuls; FlashAttention-2 paper)."""


def attention_tiles(shards: Sequence[Shard], tile_q: int, tile_k: int) -> int:
    """Number of (tile_q x tile_k) tiles the causal varlen kernel computes for ``shards``."""
    return int(attention_tiles_per_shard(shards, tile_q, tile_k).sum())


def attention_tiles_per_shard(shards: Sequence[Shard], tile_q: int, tile_k: int) -> np.ndarray:
    """Tiles per shard (vectorised over shards and query tiles)."""
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
    if tiles is None:
        tiles = attention_tiles(shards, kernel.tile_q, kernel.tile_k)
    fwd_flops = 4.0 * kernel.tile_q * kernel.tile_k * model.head_dim * model.num_heads * tiles
    compute_s = fwd_flops / (kernel.fwd_tflops * 1e12) + (
        BWD_FLOP_RATIO * fwd_flops / (kernel.bwd_tflops * 1e12)
    )
    overhead_us = num_calls * kernel.call_overhead_us + len(shards) * kernel.per_seq_us
    return compute_s * 1e3 + overhead_us * 1e-3


def transfer_ms(num_bytes: int, link: LinkProfile) -> float:
    """One collective or P2P step: latency + bytes / bandwidth."""
    return link.latency_us * 1e-3 + num_bytes / (link.bandwidth_gbps * 1e9) * 1e3


def linear_ms(tokens: int, model: ModelSpec, kernel: KernelProfile) -> float:
    """Forward+backward time of one layer's linear layers for ``tokens`` (padding included)."""
    return tokens * model.linear_flops_per_token / (kernel.linear_tflops * 1e12) * 1e3


class StepEstimate(NamedTuple):
    """Per-layer forward+backward estimate of one rank."""

    attn_ms: float
    comm_ms: float
    """Exposed (not overlapped) communication."""
    linear_ms: float

    @property
    def total_ms(self) -> float:
        return self.attn_ms + self.comm_ms + self.linear_ms


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
    """Estimate one rank's per-layer time.

    Collective modes gather KV before the forward kernel and reduce dK/dV after the
    backward one, unoverlapped: 2 x (latency + bytes / bandwidth) when anything moves.
    ``p2p_ring`` runs N kernel calls per pass and overlaps each of the N - 1 ring steps
    with one step of compute (ring attention): a pass takes c + (N - 1) max(c, t), c the
    compute per step, t the transfer per step (the backward step moves KV and dKV).
    """
    lin = linear_ms(tokens_per_rank, model, kernel)
    if comm_mode != "p2p_ring" or num_ranks == 1:
        attn = attention_ms(shards, model, kernel, tiles=tiles)
        comm = 2 * transfer_ms(recv_tokens * model.kv_bytes_per_token, link) if recv_tokens else 0.0
        return StepEstimate(attn, comm, lin)
    attn = attention_ms(shards, model, kernel, num_calls=num_ranks, tiles=tiles)
    fwd_share = 1.0 / (1.0 + BWD_FLOP_RATIO * kernel.fwd_tflops / kernel.bwd_tflops)
    step_bytes = tokens_per_rank * model.kv_bytes_per_token
    total = 0.0
    for share, bytes_per_step in ((fwd_share, step_bytes), (1.0 - fwd_share, 2 * step_bytes)):
        c = attn * share / num_ranks
        t = transfer_ms(bytes_per_step, link)
        total += c + (num_ranks - 1) * max(c, t)
    return StepEstimate(attn, total - attn, lin)


def rank_step_totals(
    num_shards: np.ndarray,
    tiles: np.ndarray,
    recv_tokens: np.ndarray,
    *,
    tokens_per_rank: int,
    num_ranks: int,
    comm_mode: str,
    model: ModelSpec,
    kernel: KernelProfile,
    link: LinkProfile,
) -> np.ndarray:
    """``rank_step(...).total_ms`` of every rank at once (float64), for picking the slowest
    rank: the same formulas, equal to ``rank_step`` up to rounding (callers recompute the
    candidates with ``rank_step``)."""
    lin = linear_ms(tokens_per_rank, model, kernel)
    p2p = comm_mode == "p2p_ring" and num_ranks > 1
    calls = num_ranks if p2p else 1
    fwd_flops = 4.0 * kernel.tile_q * kernel.tile_k * model.head_dim * model.num_heads * tiles
    compute_s = fwd_flops / (kernel.fwd_tflops * 1e12) + (
        BWD_FLOP_RATIO * fwd_flops / (kernel.bwd_tflops * 1e12)
    )
    overhead_us = calls * kernel.call_overhead_us + num_shards * kernel.per_seq_us
    attn = compute_s * 1e3 + overhead_us * 1e-3
    if not p2p:
        moved = recv_tokens.astype(np.float64) * model.kv_bytes_per_token
        comm = np.where(
            recv_tokens != 0,
            2 * (link.latency_us * 1e-3 + moved / (link.bandwidth_gbps * 1e9) * 1e3),
            0.0,
        )
        return attn + comm + lin
    fwd_share = 1.0 / (1.0 + BWD_FLOP_RATIO * kernel.fwd_tflops / kernel.bwd_tflops)
    step_bytes = tokens_per_rank * model.kv_bytes_per_token
    total = np.zeros(len(tiles))
    for share, bytes_per_step in ((fwd_share, step_bytes), (1.0 - fwd_share, 2 * step_bytes)):
        c = attn * share / num_ranks
        t = transfer_ms(bytes_per_step, link)
        total += c + (num_ranks - 1) * np.maximum(c, t)
    return attn + (total - attn) + lin
