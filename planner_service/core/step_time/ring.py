"""The ``ring`` path: the PyTorch kernel on a ``p2p_ring`` plan, the K/V blocks passed round.

worker_runtime/ring.py. N - 1 point-to-point shifts of the whole local K/V block (T rows,
padding included; shifts.py): shift 0 in flight during the local call (every real query
against the rank's own keys), shift s during step s's call and merge: the rank's queries
that see a key of the block of slot ``i - s`` against that block's real rows, one call per
step with such queries. Backward circulates the blocks again with a dK/dV accumulator per
block.

Cost: **calls** the local call and one per step with queries, counted in the kernel's
blocks (blocks.py), ``per_seq_us`` per shard, once; **copies** :func:`ring_rows` (each step's
merge: :func:`merge_rows`); **transfers** 3 (N - 1) shifts, hidden as shifts.py says.
Per rank from its rows and its blocks (:func:`ring_step_work`, the reference) and for a
group from shard arrays (:func:`group_ring_work`, O(s log s + t + blocks) for t (shard,
other holder of its doc) pairs, no loop over ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from planner_service.core.cost import stable_lexsort
from planner_service.core.plan import Shard
from planner_service.core.seeing import rows_seeing
from planner_service.core.step_time.blocks import (
    Blocks,
    GroupBlocks,
    blocks_of_calls,
    masked_blocks,
    shard_rows,
)
from planner_service.core.step_time.runs import SortedShards, ring_seen, sort_shards
from planner_service.core.step_time.shifts import (
    group_ring_hiding,
    ring_blocks,
    ring_exchange,
    ring_hiding,
)
from planner_service.core.step_time.terms import (
    MERGE_OPS,
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
)


def ring_step_work(shards: Sequence[Shard], block: Sequence[Shard], block_q: int,
                   block_k: int) -> Blocks:
    """One ring step's call: this rank's queries that see a key of ``block`` (another
    slot's shards) against that block's rows."""
    doc, pos = shard_rows(shards)
    k_doc, k_pos = shard_rows(block)
    rows = rows_seeing(doc, pos, k_doc, k_pos)
    return masked_blocks(doc[rows], pos[rows], k_doc, k_pos, block_q, block_k)

class GroupRingWork(NamedTuple):
    """One entry per (rank, step) whose call has queries, sorted by (rank, step)."""

    rank: np.ndarray
    step: np.ndarray
    blocks: GroupBlocks


def group_ring_work(s: SortedShards, block_q: int, block_k: int) -> GroupRingWork:
    """``ring_step_work`` of every rank and step with queries: the queries of the pairs of
    :func:`ring_seen`, each against ``seen`` keys from the run's first row. O(s log s + t
    + blocks) for t = (own shard, other holder of its doc) pairs; ValueError above
    MAX_RING_PAIRS."""
    seen = ring_seen(s)
    if len(seen.shard) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return GroupRingWork(empty, empty, GroupBlocks(empty, empty, empty, empty))
    shard, c, key0, step = seen.shard, seen.seen, seen.key0, seen.step
    i = s.rank[shard]
    order = stable_lexsort((shard, step, i))
    shard, c, key0, i, step = shard[order], c[order], key0[order], i[order], step[order]
    head = np.ones(len(i), dtype=bool)
    head[1:] = (i[1:] != i[:-1]) | (step[1:] != step[:-1])
    call = np.cumsum(head) - 1
    blocks = blocks_of_calls(call, s.length[shard], key0, key0 + c, False, int(head.sum()),
                             block_q, block_k)
    return GroupRingWork(i[head], step[head], blocks)


def merge_rows(queries: Any) -> Rows:
    """One ring step's query select and log-sum-exp merge (forward)."""
    return Rows(0 * queries, 6 * queries, 7 * queries, MERGE_OPS + 0 * queries)


def ring_rows(*, tokens_per_rank: Any, real: Any, queries: Any, parts: Any, num_ranks: int) -> Rows:
    """Rows the copies write, forward + backward (values may be arrays): T rows per rank
    (padding included), r real, Q = ``queries`` the steps' query rows, ``parts`` the steps
    with queries. K+V 2T - r (dK, dV concat) + 2T (first accumulator zeros, final add;
    N > 1) + T per step with queries (accumulator add); queries 4T - r + 9Q; LSE r + 9Q;
    10 ops (+ 4 for N > 1) + PART_OPS per step with queries."""
    t, r = tokens_per_rank, real
    ring = num_ranks > 1
    return Rows(2 * t - r + ring * 2 * t + parts * t, 4 * t - r + 9 * queries, r + 9 * queries,
                10 + 4 * ring + PART_OPS * parts)


def _terms(step: Step, local: KernelWork, steps: KernelWork, real: Any, recv: Any, queries: Any,
           hiding: Any) -> Terms:
    copies = ring_rows(tokens_per_rank=step.tokens_per_rank, real=real, queries=queries,
                  parts=steps.calls, num_ranks=step.num_ranks)
    return assemble(step, add_work(local, steps), copies, ring_exchange(step, recv, local, hiding))


def terms(inp: RankInput) -> Terms:
    """One rank's terms from its rows and its ring blocks (module docstring)."""
    blocks = ring_blocks(inp)
    shards, bq, bk = inp.shards, inp.step.kernel.tile_q, inp.step.kernel.tile_k
    lb = masked_blocks(*shard_rows(shards), *shard_rows(shards), bq, bk)
    local = KernelWork(lb.pairs, lb.tiles, len(shards), lb.row_blocks, 1)
    steps = [ring_step_work(shards, block, bq, bk) for block in blocks]
    called = [b for b in steps if b.queries]
    work = KernelWork(sum(b.pairs for b in called), sum(b.tiles for b in called), 0,
                      sum(b.row_blocks for b in called), len(called))
    hiding = ring_hiding([(KernelWork(b.pairs, b.tiles, 0, b.row_blocks, 1), merge_rows(b.queries))
                          if b.queries else None for b in steps], inp.step) if inp.step.overlap else None
    return _terms(inp.step, local, work, inp.real, inp.recv, sum(b.queries for b in called), hiding)


def group_terms(inp: GroupInput) -> Terms:
    """Every rank's terms (:func:`group_ring_work`)."""
    a, k, n = inp.arrays, inp.step.kernel, inp.step.num_ranks
    s = sort_shards(a.rank, a.doc, a.start, a.end, n)
    lb = blocks_of_calls(s.rank, s.length, s.rank_row[s.run_first[s.run]], s.rank_row, True,
                         n, k.tile_q, k.tile_k)
    zero = np.zeros(n, dtype=np.int64)
    local = KernelWork(lb.pairs, lb.tiles, np.diff(a.bounds), lb.row_blocks, 1 + zero)
    rw = group_ring_work(s, k.tile_q, k.tile_k)
    b = rw.blocks

    def per_rank(x: np.ndarray) -> np.ndarray:
        return np.bincount(rw.rank, weights=x, minlength=n).astype(np.int64)

    work = KernelWork(per_rank(b.pairs), per_rank(b.tiles), zero, per_rank(b.row_blocks),
                      np.bincount(rw.rank, minlength=n).astype(np.int64))
    hiding = group_ring_hiding(rw.rank, rw.step, KernelWork(b.pairs, b.tiles, 0, b.row_blocks, 1),
                               merge_rows(b.queries), inp.step) if inp.step.overlap else None
    return _terms(inp.step, local, work, inp.real, inp.recv, per_rank(b.queries), hiding)


MODEL = PathModel(terms, group_terms, hides="ring")
