"""A sliding-window layer on the flash paths: the gathered form with one windowed varlen call.

Under a window W the runtime runs the ``gathered`` path, and the ``segments`` path and the
segment ring in their gathered form (worker_runtime/windows.py): one blocking KV
collective each way, each shard ``[s, e)`` reading its window span, then one varlen call
with ``window_size_left = W - 1``. On the halo maps (``alltoallv``, ``compact_allgather``)
and ``p2p_ring`` (one all-to-all of the blocks of the ring's steps 1 .. ``steps_run``,
``window_work.RingSchedule``: the ring's bytes; HALO_MODES) a shard's keys are
``[max(0, s - W + 1), e)``; on ``full`` they are ``[0, e)`` from the causal map.

Cost: the ``gathered`` path's terms (gathered.py: its copies, its collectives, all
exposed) with the windowed call's tiles (core/window_tiles.py ``window_tiles_of``, keys
aligned at the span's first key) and the span's key rows in place of the causal ones;
``recv`` is the caller's: the window's own exchange (core/window_work.py; ``p2p_ring``:
``steps_run`` blocks, ``recv_tokens`` with the ring schedule). A window at
least every position gives the gathered path's causal terms exactly on every mode, given
the same ``recv`` (a ring's ``steps_run`` may be below the causal N - 1).
O(shards + tiles) per rank and for a group.
"""

from __future__ import annotations

import numpy as np

from planner_service.core.cost import per_rank_sums
from planner_service.core.step_time import gathered
from planner_service.core.step_time.terms import GroupInput, KernelWork, RankInput, Terms
from planner_service.core.window_tiles import window_tiles_of

HALO_MODES = ("alltoallv", "compact_allgather", "p2p_ring")
"""The exchanges whose windowed gather reads each shard's window span alone (keys from
the window's start): the halo maps, and a ring plan's blocks of steps 1 .. ``steps_run``."""


def _spans(starts: np.ndarray, ends: np.ndarray, window: int, comm_mode: str
           ) -> tuple[np.ndarray, bool]:
    """The first key of each shard's span and whether the keys start there (halo maps)."""
    halo = comm_mode in HALO_MODES
    lo = np.maximum(0, starts - window + 1) if halo else np.zeros_like(starts)
    return lo, halo


def terms(inp: RankInput, window: int) -> Terms:
    """One rank's terms under ``window`` (module docstring)."""
    step, kernel = inp.step, inp.step.kernel
    starts = np.array([s.start for s in inp.shards], dtype=np.int64)
    ends = np.array([s.end for s in inp.shards], dtype=np.int64)
    lo, halo = _spans(starts, ends, window, step.comm_mode)
    tiles = int(window_tiles_of(starts, ends - starts, window, kernel.tile_q, kernel.tile_k,
                                halo=halo).sum())
    work = gathered.kernel_work(inp.shards, kernel, tiles=tiles)
    return gathered._terms(step, work, KernelWork(0, 0, 0, 0, 0), inp.real, inp.recv,
                           int((ends - lo).sum()))


def group_terms(inp: GroupInput, window: int) -> Terms:
    """Every rank's terms under ``window``, in numpy (equal to :func:`terms` rank by rank)."""
    a, step = inp.arrays, inp.step
    kernel, n = step.kernel, step.num_ranks
    lengths = a.end - a.start
    lo, halo = _spans(a.start, a.end, window, step.comm_mode)
    tiles = per_rank_sums(window_tiles_of(a.start, lengths, window, kernel.tile_q,
                                          kernel.tile_k, halo=halo), a.bounds)
    tiles = np.asarray(tiles, dtype=np.int64)
    row_blocks = per_rank_sums(-(-lengths // kernel.tile_q), a.bounds)
    zero = np.zeros(n, dtype=np.int64)
    work = KernelWork(tiles * kernel.tile_q * kernel.tile_k, tiles, np.diff(a.bounds), row_blocks,
                      1 + zero)
    return gathered._terms(step, work, KernelWork(zero, zero, zero, zero, zero), inp.real,
                           inp.recv, per_rank_sums(a.end - lo, a.bounds))
