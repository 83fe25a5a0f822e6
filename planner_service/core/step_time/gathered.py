"""The ``gathered`` path: flash-attn on gathered keys, one blocking exchange each way.

flash-attn with ``flash_path="gathered"`` (opt-out, or when flash-attn's private varlen
API fails the runtime's probe; worker_runtime/attention.py, comm.py). The runtime stacks
the local K and V, runs one blocking KV collective over the N - 1 peers, gathers every
shard's keys ``[0, e)`` into contiguous K and V and makes one varlen kernel call on the
real queries, padding rows appended; backward mirrors it (one blocking all-to-all returns
dK/dV). A ``p2p_ring`` plan runs as the full all-gather. Nothing overlaps; ``overlap``
has no effect.

Cost: **calls** one, each shard of s queries at doc position p running ceil(s / tile_q)
query tiles, query tile j reading ceil((p + min((j + 1) tile_q, s)) / tile_k) key tiles
(a started tile costs a full tile, FlashCP Fig. 3, WLB-LLM section 5), ``per_seq_us`` per
shard; **copies** :func:`gathered_rows`; **transfers** 2 X1 with X1 = one collective of R b bytes,
all exposed. O(shards + tiles) per rank and for a group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from planner_service.core.cost import per_rank_sums
from planner_service.core.plan import Shard
from planner_service.core.profiles import KernelProfile
from planner_service.core.step_time.segment_calls import causal_tiles_of
from planner_service.core.step_time.terms import (
    COPY_OPS,
    GroupInput,
    KernelWork,
    PathModel,
    RankInput,
    Rows,
    Step,
    Terms,
    add_work,
    assemble,
    collectives,
)


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
    return causal_tiles_of(starts, lengths, tile_q, tile_k)


def kernel_work(shards: Sequence[Shard], kernel: KernelProfile, *, tiles: int | None = None) -> KernelWork:
    """The one call under ``kernel``'s ``segment`` tiling (module docstring).

    ``tiles`` may be passed when already counted (:func:`attention_tiles` of ``shards``).
    """
    if tiles is None:
        tiles = attention_tiles(shards, kernel.tile_q, kernel.tile_k)
    rows = sum(-(-(s.end - s.start) // kernel.tile_q) for s in shards)
    return KernelWork(tiles * kernel.tile_q * kernel.tile_k, tiles, len(shards), rows)


def key_rows(shards: Sequence[Shard]) -> int:
    """Rows of the gathered K (and V) the flash kernel reads: keys ``[0, e)`` per shard."""
    return sum(s.end for s in shards)


def gathered_rows(tokens_per_rank: Any, real: Any, recv: Any, key_tokens: Any) -> Rows:
    """Rows the copies write, forward + backward (values may be arrays): T rows per rank
    (padding included), r real, R received per pass, ``key_tokens`` the gathered keys.
    K+V 4T + 5R + 2 key_tokens (forward stack, send and receive ~2R, source concat T + R,
    key gathers; backward zeroed source gradient T + R, scatter-add, clone, returned add
    ~R, split); queries T + r; COPY_OPS ops."""
    t = tokens_per_rank
    return Rows(4 * t + 5 * recv + 2 * key_tokens, t + real, 0 * t, COPY_OPS + 0 * t)


def _terms(step: Step, work: KernelWork, none: KernelWork, real: Any, recv: Any,
           key_tokens: Any) -> Terms:
    return assemble(step, add_work(work, none), gathered_rows(step.tokens_per_rank, real, recv, key_tokens),
                    collectives(step, recv, 1, None))


def terms(inp: RankInput) -> Terms:
    """One rank's terms (module docstring)."""
    work = kernel_work(inp.shards, inp.step.kernel, tiles=inp.tiles)
    return _terms(inp.step, work, KernelWork(0, 0, 0, 0, 0), inp.real, inp.recv,
                  key_rows(inp.shards))


def group_terms(inp: GroupInput) -> Terms:
    """Every rank's terms: the tiles of every shard in numpy, summed per rank."""
    a, kernel, n = inp.arrays, inp.step.kernel, inp.step.num_ranks
    lengths = a.end - a.start
    tiles = inp.tiles
    if tiles is None:
        tiles = per_rank_sums(attention_tiles_of(a.start, lengths, kernel.tile_q, kernel.tile_k),
                              a.bounds)
    tiles = np.asarray(tiles, dtype=np.int64)
    row_blocks = per_rank_sums(-(-lengths // kernel.tile_q), a.bounds)
    zero = np.zeros(n, dtype=np.int64)
    work = KernelWork(tiles * kernel.tile_q * kernel.tile_k, tiles, np.diff(a.bounds), row_blocks,
                      1 + zero)
    return _terms(inp.step, work, KernelWork(zero, zero, zero, zero, zero), inp.real, inp.recv,
                  per_rank_sums(a.end, a.bounds))


MODEL = PathModel(terms, group_terms, hides="none")
