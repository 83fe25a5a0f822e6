"""The ``lean`` path: the PyTorch kernel on a gather mode, the exchange behind the local call.

The PyTorch kernel (a ``packed``-tiling profile; worker_runtime/overlap.py) on ``full``,
``compact_allgather`` or ``alltoallv``. The K and V collectives (two, async) start, the
local call (every real query against the rank's own keys) runs while they are in flight,
then one copy of the distinct remote KV, the remote call (the queries that see a remote
key: rows of a doc at or after the doc's first position the rank does not hold, against
the distinct remote keys: per doc, the positions below the end of the rank's last shard of
it that it does not hold) and a log-sum-exp merge. Backward: the remote call's gradients
first, the dK/dV return (two collectives, async) in flight during the local call's
gradients.

Cost: **calls** the local call and, when some query sees a remote key, the remote one,
counted in the kernel's blocks (blocks.py), ``per_seq_us`` per shard, once; **copies**
:func:`lean_rows`; **transfers** two collectives (K, V) of R b bytes in all each way, X; with
overlap, exposed ``max(0, X - phi K_loc) + max(0, X - (1 - phi) K_loc - C_win)``, K_loc the
local call, C_win the copies between backward's start and wait (:func:`lean_window_rows`).
Per rank from its rows (:func:`lean_work`, the reference) and for a group from shard
arrays (:func:`group_lean_work`, O(s log s + blocks), no loop over ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from planner_service.core.plan import Shard
from planner_service.core.seeing import rows_seeing
from planner_service.core.step_time.blocks import (
    NO_BLOCKS,
    Blocks,
    GroupBlocks,
    blocks_of_calls,
    masked_blocks,
    shard_rows,
)
from planner_service.core.step_time.runs import SortedShards, sort_shards
from planner_service.core.step_time.terms import (
    PART_OPS,
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
    exchange_rows,
    window_hides,
)


class LeanWork(NamedTuple):
    local: Blocks
    remote: Blocks
    remote_keys: int
    """Distinct remote KV rows the rank keeps (its all-to-all-v receive)."""


def lean_work(shards: Sequence[Shard], block_q: int, block_k: int) -> LeanWork:
    """The two calls of one rank (module docstring), from its rows; the reference."""
    doc, pos = shard_rows(shards)
    local = masked_blocks(doc, pos, doc, pos, block_q, block_k)
    if len(doc) == 0:
        return LeanWork(local, NO_BLOCKS, 0)
    # Remote keys: per doc, the positions below the doc's last own row + 1 not held here.
    docs, first = np.unique(doc, return_index=True)
    last = np.append(first[1:], len(doc)) - 1
    limit = pos[last] + 1
    gaps_doc, gaps_pos = [], []
    for d, lo, hi, e in zip(docs.tolist(), first.tolist(), last.tolist(), limit.tolist(), strict=True):
        held = np.zeros(e, dtype=bool)
        held[pos[lo:hi + 1]] = True
        missing = np.flatnonzero(~held)
        gaps_doc.append(np.full(len(missing), d, dtype=np.int64))
        gaps_pos.append(missing)
    k_doc, k_pos = np.concatenate(gaps_doc), np.concatenate(gaps_pos)
    rows = rows_seeing(doc, pos, k_doc, k_pos)
    remote = masked_blocks(doc[rows], pos[rows], k_doc, k_pos, block_q, block_k)
    return LeanWork(local, remote, len(k_doc))

class GroupLeanWork(NamedTuple):
    local: GroupBlocks
    remote: GroupBlocks
    remote_keys: np.ndarray


def group_lean_work(s: SortedShards, block_q: int, block_k: int) -> GroupLeanWork:
    """``lean_work`` of every rank of the group. O(s + blocks).

    Local: a block reads from its first row's doc run start to its last row. Remote: a
    shard's rows see the gaps below its start (``g = start - before``), all of them when
    ``g > 0``; the remote keys of a run follow those of the rank's earlier runs.
    """
    n = s.num_ranks
    local = blocks_of_calls(s.rank, s.length, s.rank_row[s.run_first[s.run]], s.rank_row, True,
                            n, block_q, block_k)
    gap = s.start - s.before
    run_end = np.maximum.reduceat(s.start + s.length, s.run_first) if len(s.run_first) else \
        np.zeros(0, np.int64)
    run_tokens = np.add.reduceat(s.length, s.run_first) if len(s.run_first) else run_end
    run_far = run_end - run_tokens
    run_rank = s.rank[s.run_first]
    cum = np.concatenate(([0], np.cumsum(run_far)))
    rank_first_run = np.searchsorted(run_rank, np.arange(n + 1), side="left")
    far = cum[rank_first_run[1:]] - cum[rank_first_run[:-1]]
    run_key0 = cum[:-1] - cum[rank_first_run[run_rank]]
    sees = gap > 0
    key0 = run_key0[s.run[sees]]
    remote = blocks_of_calls(s.rank[sees], s.length[sees], key0, key0 + gap[sees], False, n,
                             block_q, block_k)
    return GroupLeanWork(local, remote, far)


def lean_rows(comm_mode: str, *, tokens_per_rank: Any, real: Any, recv: Any, remote_keys: Any,
         queries: Any, parts: Any, num_ranks: int) -> Rows:
    """Rows the copies write, forward + backward (values may be arrays): T rows per rank
    (padding included), r real, R received per pass, F = ``remote_keys`` the distinct
    remote KV, Q = ``queries`` the remote call's query rows, ``parts`` its calls (0 or 1).
    K+V send + returned (SEND_ROWS) + 2F (remote copy, dK/dV index_copy) + R (zeroed
    return buffer) + 2T - r (dK, dV padding concat); queries 9Q + 4T - r (query select,
    merge 5Q, output concat 2T - r, delta r, dO/Q selects 2Q, dQ add Q, dQ concat 2T - r);
    LSE 9Q + r; 14 ops + send/return ops + PART_OPS with a remote part."""
    t, r = tokens_per_rank, real
    send, send_ops = exchange_rows(comm_mode, recv, num_ranks)
    kv = send + 2 * remote_keys + recv + 2 * t - r
    return Rows(kv, 4 * t - r + 9 * queries, r + 9 * queries, 14 + send_ops + PART_OPS * parts)


def lean_window_rows(tokens_per_rank: Any, real: Any, queries: Any) -> Rows:
    """Backward: copies between starting the dK/dV return and waiting for it (the remote
    queries' dQ add, the dK/dV padding concatenation)."""
    return Rows(2 * tokens_per_rank - real, queries, 0 * queries, 4 + (queries > 0))


def _terms(step: Step, local: KernelWork, remote: KernelWork, real: Any, recv: Any,
           remote_keys: Any, queries: Any) -> Terms:
    t = step.tokens_per_rank
    copies = lean_rows(step.comm_mode, tokens_per_rank=t, real=real, recv=recv,
                  remote_keys=remote_keys, queries=queries, parts=remote.calls,
                  num_ranks=step.num_ranks)
    hides = window_hides(step, local, None, lean_window_rows(t, real, queries)) if step.overlap else None
    return assemble(step, add_work(local, remote), copies, collectives(step, recv, 2, hides))


def terms(inp: RankInput) -> Terms:
    """One rank's terms from its rows (module docstring)."""
    k = inp.step.kernel
    lw = lean_work(inp.shards, k.tile_q, k.tile_k)
    local = KernelWork(lw.local.pairs, lw.local.tiles, len(inp.shards), lw.local.row_blocks, 1)
    r = lw.remote
    remote = KernelWork(r.pairs, r.tiles, 0, r.row_blocks, int(r.queries > 0))
    return _terms(inp.step, local, remote, inp.real, inp.recv, lw.remote_keys, r.queries)


def group_terms(inp: GroupInput) -> Terms:
    """Every rank's terms (:func:`group_lean_work`)."""
    a, k, n = inp.arrays, inp.step.kernel, inp.step.num_ranks
    lw = group_lean_work(sort_shards(a.rank, a.doc, a.start, a.end, n), k.tile_q, k.tile_k)
    zero = np.zeros(n, dtype=np.int64)
    local = KernelWork(lw.local.pairs, lw.local.tiles, np.diff(a.bounds), lw.local.row_blocks,
                       1 + zero)
    r = lw.remote
    remote = KernelWork(r.pairs, r.tiles, zero, r.row_blocks, (r.queries > 0).astype(np.int64))
    return _terms(inp.step, local, remote, inp.real, inp.recv, lw.remote_keys, r.queries)


MODEL = PathModel(terms, group_terms, hides="local")
