"""A sliding-window layer on the PyTorch kernel's lean path (``packed`` tiling, gather modes).

Under a window W the runtime's lean path (worker_runtime/paths/lean.py with ``window``)
runs its two calls on windowed masks (worker_runtime/kernels.py ``build_masked_meta``):
each query block reads the keys from its first query's window start
``max(0, p0 - W + 1)`` of its doc up to its last query's own position, cut into key blocks.

- local call: every real query against the rank's own keys;
- remote keys: on ``alltoallv`` and ``compact_allgather`` the window's distinct halo (per
  own shard ``[s, e)`` of a doc the positions ``[max(e', s - W + 1), s)``, ``e'`` the end of
  the rank's previous shard of the doc); on ``full`` the causal map's distinct remote keys
  (per doc, the positions below the rank's last end it does not hold);
- remote call: the queries with a remote key in their window, against those keys.

Copies, transfers and overlap are the lean path's (lean.py ``_terms``) on these calls and
``recv`` (the caller's: the window's exchange, core/window_work.py). A window at least
every position gives the lean path's causal terms exactly. Per rank from its rows,
O(rows log rows + blocks); the group form runs the per-rank one rank by rank,
O(S log S + blocks) for S tokens of the group.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner_service.core.plan import Shard
from planner_service.core.step_time import lean
from planner_service.core.step_time.blocks import NO_BLOCKS, Blocks, shard_rows
from planner_service.core.step_time.terms import GroupInput, KernelWork, RankInput, Terms

HALO_MODES = ("alltoallv", "compact_allgather")


def window_blocks(q_doc: np.ndarray, q_pos: np.ndarray, k_doc: np.ndarray, k_pos: np.ndarray,
                  block_q: int, block_k: int, window: int) -> Blocks:
    """``build_masked_meta(..., window=W)``'s blocks for these rows (each sorted by (doc,
    position)), counted. O(T + K) numpy."""
    if len(q_doc) == 0:
        return NO_BLOCKS
    stride = int(max(q_pos.max(initial=0), k_pos.max(initial=0))) + 1
    k_key = k_doc * stride + k_pos
    q0 = np.arange(0, len(q_doc), block_q, dtype=np.int64)
    q1 = np.minimum(q0 + block_q, len(q_doc))
    low = np.maximum(0, q_pos[q0] - window + 1)
    k_lo = np.searchsorted(k_key, q_doc[q0] * stride + low, side="left")
    k_hi = np.searchsorted(k_key, q_doc[q1 - 1] * stride + q_pos[q1 - 1], side="right")
    span = np.maximum(k_hi - k_lo, 0)
    return Blocks(int(((q1 - q0) * span).sum()), int((-(-span // block_k)).sum()), len(q0),
                  len(q_doc))


def remote_keys(shards: Sequence[Shard], window: int, comm_mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(doc, position) of the remote keys the lean path reads (module docstring), sorted."""
    ordered = sorted(s for s in shards if s.end > s.start)
    docs: list[int] = []
    pos: list[np.ndarray] = []
    prev_doc, prev_end = -1, 0
    for s in ordered:
        e_prev = prev_end if s.doc == prev_doc else 0
        if comm_mode in HALO_MODES:
            gap = np.arange(max(e_prev, s.start - window + 1), s.start, dtype=np.int64)
        else:
            gap = np.arange(e_prev, s.start, dtype=np.int64)
        docs.extend([s.doc] * len(gap))
        pos.append(gap)
        prev_doc, prev_end = s.doc, s.end
    if not pos:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.array(docs, dtype=np.int64), np.concatenate(pos)


def lean_window_work(shards: Sequence[Shard], block_q: int, block_k: int, window: int,
                     comm_mode: str) -> lean.LeanWork:
    """The two windowed calls of one rank and its remote key rows (module docstring)."""
    doc, pos = shard_rows(shards)
    local = window_blocks(doc, pos, doc, pos, block_q, block_k, window)
    if len(doc) == 0:
        return lean.LeanWork(local, NO_BLOCKS, 0)
    k_doc, k_pos = remote_keys(shards, window, comm_mode)
    if len(k_doc) == 0:
        return lean.LeanWork(local, NO_BLOCKS, 0)
    stride = int(max(pos.max(), k_pos.max())) + 1
    key = k_doc * stride + k_pos
    hi = np.searchsorted(key, doc * stride + pos, side="right")
    lo = np.searchsorted(key, doc * stride + np.maximum(pos - window + 1, 0), side="left")
    rows = np.flatnonzero(hi > lo)
    remote = window_blocks(doc[rows], pos[rows], k_doc, k_pos, block_q, block_k, window)
    return lean.LeanWork(local, remote, len(k_doc))


def terms(inp: RankInput, window: int) -> Terms:
    """One rank's terms under ``window`` (module docstring)."""
    k, step = inp.step.kernel, inp.step
    lw = lean_window_work(inp.shards, k.tile_q, k.tile_k, window, step.comm_mode)
    local = KernelWork(lw.local.pairs, lw.local.tiles, len(inp.shards), lw.local.row_blocks, 1)
    r = lw.remote
    remote = KernelWork(r.pairs, r.tiles, 0, r.row_blocks, int(r.queries > 0))
    return lean._terms(step, local, remote, inp.real, inp.recv, lw.remote_keys, r.queries)


def group_terms(inp: GroupInput, window: int) -> Terms:
    """Every rank's terms under ``window``: :func:`terms`' work rank by rank, in arrays."""
    a, step = inp.arrays, inp.step
    k, n = step.kernel, step.num_ranks
    fields = np.zeros((n, 10), dtype=np.int64)
    for i in range(n):
        lo, hi = int(a.bounds[i]), int(a.bounds[i + 1])
        shards = [Shard(int(d), int(s), int(e))
                  for d, s, e in zip(a.doc[lo:hi], a.start[lo:hi], a.end[lo:hi], strict=True)]
        lw = lean_window_work(shards, k.tile_q, k.tile_k, window, step.comm_mode)
        fields[i] = (lw.local.pairs, lw.local.tiles, hi - lo, lw.local.row_blocks,
                     lw.remote.pairs, lw.remote.tiles, lw.remote.row_blocks,
                     int(lw.remote.queries > 0), lw.remote_keys, lw.remote.queries)
    f = fields.T
    zero = np.zeros(n, dtype=np.int64)
    local = KernelWork(f[0], f[1], f[2], f[3], 1 + zero)
    remote = KernelWork(f[4], f[5], zero, f[6], f[7])
    return lean._terms(step, local, remote, inp.real, inp.recv, f[8], f[9])
