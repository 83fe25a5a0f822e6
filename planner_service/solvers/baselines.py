"""Baseline layouts: Llama3 CP, Per-Doc CP (WLB-LLM), ring and zigzag ring attention."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner_service.core.build import GroupLayout, Layout
from planner_service.core.plan import Shard
from planner_service.core.request import PlanRequest
from planner_service.solvers.common import doc_offsets, global_range_shards, zigzag_doc_shards


def llama3_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    """The packed sequence cut into 2N equal chunks; chunk i and 2N-1-i on rank i.

    Chunks are ceil(S / 2N) tokens; the shortfall of the last chunks is padding.
    """
    n = request.cp_size
    offsets = doc_offsets(doc_lengths)
    total = offsets[-1]
    chunk = -(-total // (2 * n))
    ranks: list[list[Shard]] = [[] for _ in range(n)]
    for rank in range(n):
        for c in (rank, 2 * n - 1 - rank):
            ranks[rank] += global_range_shards(
                offsets, min(c * chunk, total), min((c + 1) * chunk, total)
            )
    return Layout(groups=[GroupLayout(tuple(range(n)), ranks)], info={})


def ring_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    """The packed sequence cut into N contiguous chunks of ceil(S / N) tokens (ring attention)."""
    n = request.cp_size
    offsets = doc_offsets(doc_lengths)
    total = offsets[-1]
    chunk = -(-total // n)
    ranks = [
        global_range_shards(offsets, min(r * chunk, total), min((r + 1) * chunk, total))
        for r in range(n)
    ]
    return Layout(groups=[GroupLayout(tuple(range(n)), ranks)], info={})


def per_doc_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    """Every doc cut into 2N chunks, zigzag per doc (WLB-LLM Per-Doc CP; the zigzag ring
    layout of ring-flash-attention's varlen kernels)."""
    n = request.cp_size
    ranks: list[list[Shard]] = [[] for _ in range(n)]
    rank_tokens = np.zeros(n, dtype=np.int64)
    for doc, length in enumerate(doc_lengths):
        for rank, shard in zigzag_doc_shards(doc, length, n, rank_tokens):
            ranks[rank].append(shard)
    return Layout(groups=[GroupLayout(tuple(range(n)), ranks)], info={})
