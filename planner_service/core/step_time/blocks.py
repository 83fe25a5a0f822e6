"""Blocks the runtime's PyTorch kernel visits on its lean and ring paths (shared by both).

The kernel (worker_runtime/kernels.py, ``build_masked_meta``) takes queries and keys as
(doc, position) rows, each sorted by (doc, position); query blocks of ``block_q`` rows
each read the keys from the first key of the block's first query's doc up to the last key
at or below the block's last query, cut into key blocks of ``block_k``; every block pair
is computed dense. Per call that gives (pairs, key blocks, query blocks).

Two forms: per call from its rows (:func:`masked_blocks`, O(rows + blocks) numpy; the
reference) and many calls at once from shard arrays (:func:`blocks_of_calls`,
O(shards + blocks)); the lean path (lean.py) and the ring (ring.py) build their calls
from them, compared on random groups in tests, and the runtime's own metadata is the check
of the reference (tests/test_step_time.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from planner_service.core.plan import Shard


class Blocks(NamedTuple):
    """What one kernel call computes."""

    pairs: int
    """Query-key pairs computed (dense block pairs, masked ones included)."""
    tiles: int
    """Key blocks visited (block pairs)."""
    row_blocks: int
    """Query blocks."""
    queries: int
    """Query rows of the call."""


NO_BLOCKS = Blocks(0, 0, 0, 0)


def masked_blocks(q_doc: np.ndarray, q_pos: np.ndarray, k_doc: np.ndarray, k_pos: np.ndarray,
                  block_q: int, block_k: int) -> Blocks:
    """``build_masked_meta``'s blocks for these rows, counted. O(T + K) numpy.

    Key rows with a negative doc (padding) sort last and are never read.
    """
    q_doc, q_pos = np.asarray(q_doc, np.int64), np.asarray(q_pos, np.int64)
    k_doc, k_pos = np.asarray(k_doc, np.int64), np.asarray(k_pos, np.int64)
    if len(q_doc) == 0:
        return NO_BLOCKS
    stride = int(max(q_pos.max(initial=0), k_pos.max(initial=0))) + 1
    k_key = np.where(k_doc < 0, np.iinfo(np.int64).max, k_doc * stride + k_pos)
    q0 = np.arange(0, len(q_doc), block_q, dtype=np.int64)
    q1 = np.minimum(q0 + block_q, len(q_doc))
    k_lo = np.searchsorted(k_key, q_doc[q0] * stride, side="left")
    k_hi = np.searchsorted(k_key, q_doc[q1 - 1] * stride + q_pos[q1 - 1], side="right")
    span = np.maximum(k_hi - k_lo, 0)
    return Blocks(int(((q1 - q0) * span).sum()), int((-(-span // block_k)).sum()), len(q0),
                  len(q_doc))


def shard_rows(shards: Sequence[Shard]) -> tuple[np.ndarray, np.ndarray]:
    """(doc, position) of every row of ``shards`` sorted by (doc, start)."""
    ordered = sorted(s for s in shards if s.end > s.start)
    if not ordered:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    doc = np.array([s.doc for s in ordered], dtype=np.int64)
    start = np.array([s.start for s in ordered], dtype=np.int64)
    length = np.array([s.end - s.start for s in ordered], dtype=np.int64)
    first = np.cumsum(length) - length
    pos = np.arange(int(length.sum()), dtype=np.int64) - np.repeat(first - start, length)
    return np.repeat(doc, length), pos


class GroupBlocks(NamedTuple):
    """Per call group: ``Blocks`` fields as int64 arrays."""

    pairs: np.ndarray
    tiles: np.ndarray
    row_blocks: np.ndarray
    queries: np.ndarray


class QueryBlocks(NamedTuple):
    """The ``block_q``-row query blocks of calls whose rows are entries' rows in order."""

    row0: np.ndarray
    """Each entry's first row in the calls' rows laid end to end, then the total."""
    rows: np.ndarray
    """Per call, its query rows."""
    nb: np.ndarray
    """Per call, its query blocks."""
    call: np.ndarray
    """Per block (call by call), its call."""
    q0: np.ndarray
    """Per block (call by call), its first row."""
    q1: np.ndarray
    """Per block, the row after its last."""
    a: np.ndarray
    """Per block, the entry holding its first row."""
    b: np.ndarray
    """Per block, the entry holding its last row."""

    def per_call(self, x: np.ndarray) -> np.ndarray:
        """Per call, the sum of ``x`` (one value per block) over its blocks."""
        sums = np.concatenate(([0], np.cumsum(x)))
        ends = np.cumsum(self.nb)
        return sums[ends] - sums[ends - self.nb]


def query_blocks(call: np.ndarray, length: np.ndarray, num_calls: int, block_q: int
                 ) -> QueryBlocks:
    """``QueryBlocks`` of ``num_calls`` calls: entry i (``length[i]`` > 0 rows) belongs to
    call ``call[i]`` (non-decreasing), each call's rows cut in blocks of ``block_q``.
    O(entries + blocks log entries)."""
    row0 = np.concatenate(([0], np.cumsum(length)))
    bounds = np.searchsorted(call, np.arange(num_calls + 1), side="left")
    rows = row0[bounds[1:]] - row0[bounds[:-1]]
    nb = -(-rows // block_q)
    block_call = np.repeat(np.arange(num_calls, dtype=np.int64), nb)
    index = np.arange(int(nb.sum()), dtype=np.int64) - np.repeat(np.cumsum(nb) - nb, nb)
    q0 = row0[bounds[:-1]][block_call] + index * block_q
    q1 = np.minimum(q0 + block_q, row0[bounds[1:]][block_call])
    a = np.searchsorted(row0, q0, side="right") - 1
    b = np.searchsorted(row0, q1 - 1, side="right") - 1
    return QueryBlocks(row0, rows, nb, block_call, q0, q1, a, b)


def blocks_of_calls(call: np.ndarray, length: np.ndarray, lo_key: np.ndarray, hi_base: np.ndarray,
                    diagonal: bool, num_calls: int, block_q: int, block_k: int) -> GroupBlocks:
    """Blocks of ``num_calls`` calls whose query rows are the given shards, in order.

    Shard i (non-empty) belongs to call ``call[i]`` (non-decreasing); a block whose first
    row is in shard a and last row in shard b reads keys ``[lo_key[a], hi)`` with
    ``hi = hi_base[b]`` plus, if ``diagonal`` (keys are the queries themselves), the rows
    of b up to the block's last. O(shards + blocks).
    """
    zeros = np.zeros(num_calls, dtype=np.int64)
    if len(call) == 0:
        return GroupBlocks(zeros, zeros.copy(), zeros.copy(), zeros.copy())
    qb = query_blocks(call, length, num_calls, block_q)
    hi = hi_base[qb.b] + (qb.q1 - qb.row0[qb.b] if diagonal else 0)
    span = np.maximum(hi - lo_key[qb.a], 0)
    return GroupBlocks(qb.per_call((qb.q1 - qb.q0) * span), qb.per_call(-(-span // block_k)),
                       qb.nb, qb.rows)
