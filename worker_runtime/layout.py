"""Plan + rank -> local token layout and KV send/receive index maps (built once per plan).

Everything here is numpy on index arrays, computed from shard-level arrays with one
vectorised range expansion (:func:`expand_ranges`); nothing loops over tokens in Python.

Legend (per CP group of N ranks, ``slot`` = a rank's index in ``group.ranks``):

- local buffer (``T`` rows): the rank's shards in plan order, then its padding rows.
- context (``ctx``): for every doc the rank holds, the KV prefix ``[0, E)`` it attends,
  where ``E`` is the end of its last shard of that doc; docs in ascending order.
- source: ``cat(local buffer, receive buffer)``; ``CommMap.kv_index`` picks, for every
  shard ``(d, s, e)`` in order, the source rows of keys ``[0, e)`` of doc d.

Receive buffers by mode (docs/runtime.md, Exchanges and bytes; ``planner_service.core.cost``):

- ``full``: every other rank's whole local buffer (padding included), peers in slot order.
- ``compact_allgather``: every other rank's compact buffer padded to the group's largest,
  ``B`` rows each. A rank's compact buffer holds, per shard ``(d, s, e)``, tokens
  ``[s, min(e, F))`` with F the furthest end of doc d needed by any *other* rank.
- ``alltoallv``: from each peer exactly the tokens of its shards this rank needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from planner_service.core.cost import CommVolumes, kv_tokens_peak, recv_tokens_by_mode
from planner_service.core.paths import GATHER_MODES
from planner_service.core.plan import Plan, RankStats, Shard


def expand_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for every (s, n), vectorised.

    A running sum of steps: +1 inside a range, and at the first element of each range the
    jump from the previous range's last value to its start (10x faster than np.repeat).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    out = np.ones(int(lengths.sum()), dtype=np.int64)
    if len(out) == 0:
        return out
    first = np.cumsum(lengths) - lengths
    out[0] = starts[0]
    out[first[1:]] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
    return np.cumsum(out, out=out)


def _exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    out = np.zeros(len(values), dtype=np.int64)
    np.cumsum(values[:-1], out=out[1:])
    return out


@dataclass(frozen=True, slots=True, eq=False)
class GroupArrays:
    """All shards of one group as flat arrays, slot-major then (doc, start) (plan order)."""

    ranks: tuple[int, ...]
    docs: np.ndarray
    """The group's docs (global ids), ascending; ``dd`` below indexes into this."""
    slot: np.ndarray
    doc: np.ndarray
    dd: np.ndarray
    start: np.ndarray
    end: np.ndarray
    local_start: np.ndarray
    """Row of the shard's first token in its owner's local buffer."""
    slot_bounds: np.ndarray
    """Shards of slot i are ``[slot_bounds[i], slot_bounds[i + 1])``."""
    need: np.ndarray
    """``need[dd, slot]``: end of the slot's last shard of the doc (0 if it holds none)."""
    held: np.ndarray
    """``held[dd, slot]``: tokens of the doc on the slot."""
    compact_len: np.ndarray
    compact_start: np.ndarray
    """Row of the shard's compact tokens in its owner's compact buffer."""
    compact_total: np.ndarray
    """Compact buffer size per slot (equals the plan's ``rank_stats.allgather_send``)."""
    by_doc: np.ndarray
    """Shard indices sorted by (doc, start): each doc's shards in position order."""
    doc_key: np.ndarray
    """``dd * key_stride + start`` of the shards in ``by_doc`` order (ascending)."""
    key_stride: int
    tokens_per_rank: int
    num_real: np.ndarray

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)


def group_arrays(plan: Plan, group_index: int) -> GroupArrays:
    """Flatten one group's shards and derive need/held/compact arrays (no token loops)."""
    group = plan.groups[group_index]
    n = len(group.ranks)
    counts = np.array([len(rank) for rank in group.shards], dtype=np.int64)
    flat = np.array([s for rank in group.shards for s in rank], dtype=np.int64).reshape(-1, 3)
    doc, start, end = flat[:, 0], flat[:, 1], flat[:, 2]
    slot = np.repeat(np.arange(n, dtype=np.int64), counts)
    slot_bounds = np.concatenate(([0], np.cumsum(counts)))
    length = end - start
    num_real = np.zeros(n, dtype=np.int64)
    np.add.at(num_real, slot, length)
    local_start = _exclusive_cumsum(length) - np.repeat(_exclusive_cumsum(num_real), counts)
    docs = np.asarray(group.docs, dtype=np.int64)
    dd = np.searchsorted(docs, doc)
    need = np.zeros((len(docs), n), dtype=np.int64)
    held = np.zeros((len(docs), n), dtype=np.int64)
    np.maximum.at(need, (dd, slot), end)
    np.add.at(held, (dd, slot), length)
    # Furthest end of each doc needed by a rank other than the shard's owner: the doc's
    # maximum unless the owner is the (first) argmax, then the second largest.
    top = need.max(axis=1, initial=0)
    arg = need.argmax(axis=1) if n else np.zeros(len(docs), dtype=np.int64)
    rest = need.copy()
    rest[np.arange(len(docs)), arg] = 0
    second = rest.max(axis=1, initial=0)
    furthest_other = np.where(arg[dd] == slot, second[dd], top[dd])
    compact_len = np.clip(np.minimum(end, furthest_other) - start, 0, None)
    compact_total = np.zeros(n, dtype=np.int64)
    np.add.at(compact_total, slot, compact_len)
    compact_start = _exclusive_cumsum(compact_len) - np.repeat(_exclusive_cumsum(compact_total), counts)
    by_doc = np.lexsort((start, dd))
    key_stride = int(end.max(initial=0)) + 1
    return GroupArrays(
        ranks=tuple(group.ranks), docs=docs, slot=slot, doc=doc, dd=dd, start=start, end=end,
        local_start=local_start, slot_bounds=slot_bounds, need=need, held=held,
        compact_len=compact_len, compact_start=compact_start, compact_total=compact_total,
        by_doc=by_doc, doc_key=dd[by_doc] * key_stride + start[by_doc], key_stride=key_stride,
        tokens_per_rank=int(num_real[0] + group.padding[0]) if n else 0, num_real=num_real,
    )


@dataclass(frozen=True, slots=True, eq=False)
class RankLayout:
    """One rank's view of a plan: local tokens and the varlen kernel metadata."""

    plan_id: str
    rank: int
    group_index: int
    """Index into plan.groups; -1 for a rank in no group (it holds no tokens)."""
    slot: int
    group_ranks: tuple[int, ...]
    num_tokens: int
    """Local rows including padding (same on every rank of the group)."""
    num_real: int
    shards: tuple[Shard, ...]
    global_index: np.ndarray
    """``[num_tokens]`` position in the global packed sequence; -1 for padding."""
    doc_ids: np.ndarray
    """``[num_tokens]`` doc of each row; -1 for padding."""
    positions: np.ndarray
    """``[num_tokens]`` doc-relative position (for RoPE); 0 for padding."""
    cu_seqlens_q: np.ndarray
    """int32 ``[num_shards + 1]``: shard boundaries in the local buffer."""
    cu_seqlens_k: np.ndarray
    """int32 ``[num_shards + 1]``: key segments, shard j attends ``end_j`` keys."""
    max_seqlen_q: int
    max_seqlen_k: int
    doc_offsets: np.ndarray
    """``[num_docs + 1]`` global packed start of every doc of the plan, then the total."""
    arrays: GroupArrays | None
    """The group's arrays (None for an idle rank); comm maps are built from them."""

    @property
    def num_ranks(self) -> int:
        return len(self.group_ranks)


def find_slot(plan: Plan, rank: int) -> tuple[int, int]:
    """(group index, slot) of a rank; (-1, -1) for a rank in no group."""
    for gi, group in enumerate(plan.groups):
        if rank in group.ranks:
            return gi, group.ranks.index(rank)
    return -1, -1


def build_layout(plan: Plan, rank: int) -> RankLayout:
    """Local layout of ``rank`` (a rank of the plan, 0 <= rank < plan.cp_size).

    Raises ValueError if rank is outside [0, plan.cp_size).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.cp_size:
        raise ValueError(f"rank must be an integer in [0, {plan.cp_size}) (plan.cp_size), got {rank!r}")
    gi, slot = find_slot(plan, rank)
    empty = np.zeros(0, dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(plan.doc_lengths, dtype=np.int64)))
    if gi < 0:
        zero = np.zeros(1, dtype=np.int32)
        return RankLayout(
            plan_id=plan.plan_id, rank=rank, group_index=-1, slot=-1, group_ranks=(), num_tokens=0,
            num_real=0, shards=(), global_index=empty, doc_ids=empty, positions=empty,
            cu_seqlens_q=zero, cu_seqlens_k=zero, max_seqlen_q=0, max_seqlen_k=0,
            doc_offsets=offsets, arrays=None,
        )
    arrays = group_arrays(plan, gi)
    lo, hi = arrays.slot_bounds[slot], arrays.slot_bounds[slot + 1]
    doc, start, end = arrays.doc[lo:hi], arrays.start[lo:hi], arrays.end[lo:hi]
    length = end - start
    pad = arrays.tokens_per_rank - int(arrays.num_real[slot])
    fill = np.full(pad, -1, dtype=np.int64)
    positions = expand_ranges(start, length)
    return RankLayout(
        plan_id=plan.plan_id, rank=rank, group_index=gi, slot=slot, group_ranks=arrays.ranks,
        num_tokens=arrays.tokens_per_rank, num_real=int(arrays.num_real[slot]),
        shards=plan.groups[gi].shards[slot],
        global_index=np.concatenate((positions + np.repeat(offsets[doc], length), fill)),
        doc_ids=np.concatenate((np.repeat(doc, length), fill)),
        positions=np.concatenate((positions, np.zeros(pad, dtype=np.int64))),
        cu_seqlens_q=np.concatenate(([0], np.cumsum(length))).astype(np.int32),
        cu_seqlens_k=np.concatenate(([0], np.cumsum(end))).astype(np.int32),
        max_seqlen_q=int(length.max(initial=0)), max_seqlen_k=int(end.max(initial=0)),
        doc_offsets=offsets, arrays=arrays,
    )


class CommMap(NamedTuple):
    """What one rank sends and receives per pass in one comm mode, and where keys live.

    Forward: rows ``send_index`` of the local KV buffer are sent (one buffer padded to
    ``buffer_rows`` for the all-gather modes; ``send_splits[p]`` rows to each peer p for
    all-to-all-v). The receive buffer has ``recv_rows`` rows, ``recv_splits[p]`` from peer
    p. Backward (``return_gradients``): gradients of the receive buffer go back the same
    way and are added into the local rows they came from.
    """

    mode: str
    collective: str
    """``all_gather``, ``all_to_all`` or ``none`` (nothing moves anywhere in the group)."""
    send_index: np.ndarray
    buffer_rows: int
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_rows: int
    kv_index: np.ndarray
    """Source rows of every shard's keys, shards in order (length ``cu_seqlens_k[-1]``)."""
    remote_index: np.ndarray
    """Rows of the receive buffer this rank attends, one per distinct remote token, sorted
    by (doc, position): per doc it holds, the peers' tokens below its last shard's end."""
    remote_doc: np.ndarray
    remote_pos: np.ndarray
    """Doc and doc-relative position of every ``remote_index`` row."""


def build_comm_map(layout: RankLayout, mode: str, order: Sequence[int] | None = None) -> CommMap:
    """Index maps of ``layout``'s rank for ``mode`` (one of GATHER_MODES).

    ``order[slot]`` is the rank of each group slot inside the process group that runs the
    collectives (default: position in the sorted group ranks, as ``new_group`` orders
    them); peers' blocks and split sizes follow that order.
    Raises ValueError for an unknown mode or an order that is not a permutation.
    """
    if mode not in GATHER_MODES:
        raise ValueError(f"comm_mode must be one of {', '.join(GATHER_MODES)}, got {mode!r}")
    empty = np.zeros(0, dtype=np.int64)
    a = layout.arrays
    if a is None:
        return CommMap(mode, "none", empty, 0, (), (), 0, empty, empty, empty, empty)
    n, i, t = a.num_ranks, layout.slot, layout.num_tokens
    coll = np.argsort(np.argsort(a.ranks)) if order is None else np.asarray(order, dtype=np.int64)
    if sorted(coll.tolist()) != list(range(n)):
        raise ValueError(f"order must be a permutation of range({n}), got {list(order or ())}")
    lo, hi = a.slot_bounds[i], a.slot_bounds[i + 1]
    mine = np.zeros(len(a.slot), dtype=bool)
    mine[lo:hi] = True
    peer_pos = coll - (coll > coll[i])  # position of each slot's block among the peers'

    # Peer shards of docs this rank holds, clipped to the prefix it needs.
    need_i = a.need[:, i]
    clip = np.minimum(a.end, need_i[a.dd]) - a.start
    recv = np.flatnonzero(~mine & (clip > 0))
    recv = recv[np.argsort(coll[a.slot[recv]], kind="stable")]  # senders in collective order
    rlen = clip[recv]
    recv_splits = np.zeros(n, dtype=np.int64)
    np.add.at(recv_splits, coll[a.slot[recv]], rlen)

    if mode == "full":
        rows = t
        base = a.local_start[recv] + peer_pos[a.slot[recv]] * rows
        send_index = np.arange(t, dtype=np.int64)
    elif mode == "compact_allgather":
        rows = int(a.compact_total.max(initial=0))
        base = a.compact_start[recv] + peer_pos[a.slot[recv]] * rows
        send_index = expand_ranges(a.local_start[lo:hi], a.compact_len[lo:hi])
    else:
        rows = 0
        base = _exclusive_cumsum(rlen)
        # To each peer, in collective order: my shards of docs it holds, clipped to its need.
        clen = np.clip(np.minimum(a.end[lo:hi, None], a.need[a.dd[lo:hi]]) - a.start[lo:hi, None], 0, None)
        clen[:, i] = 0
        clen = clen[:, np.argsort(coll)]
        send_index = expand_ranges(np.tile(a.local_start[lo:hi], n), clen.T.ravel())
        send_splits = tuple(int(x) for x in clen.sum(axis=0))
    # Source row of the first token of every group shard this rank reads: its own shards
    # in the local buffer, peers' shards in the receive buffer.
    src = np.full(len(a.slot), -1, dtype=np.int64)
    src[lo:hi] = a.local_start[lo:hi]
    src[recv] = t + base
    # Keys [0, e) of an own shard (d, s, e) are the pieces of doc d's shards that start
    # below e, in doc order; one range expansion turns pieces into rows.
    e_mine = a.end[lo:hi]
    first = np.searchsorted(a.doc_key, a.dd[lo:hi] * a.key_stride)
    count = np.searchsorted(a.doc_key, a.dd[lo:hi] * a.key_stride + e_mine) - first
    piece = a.by_doc[expand_ranges(first, count)]
    piece_len = np.minimum(a.end[piece], np.repeat(e_mine, count)) - a.start[piece]
    assert (src[piece] >= 0).all(), "every needed key is held locally or received"
    kv_index = expand_ranges(src[piece], piece_len)
    # The distinct remote KV: per doc this rank holds, the peers' pieces below the end E of
    # its last shard of the doc (every own shard of the doc attends a prefix of [0, E)).
    docs_mine = np.unique(a.dd[lo:hi])
    e_doc = need_i[docs_mine]
    first = np.searchsorted(a.doc_key, docs_mine * a.key_stride)
    count = np.searchsorted(a.doc_key, docs_mine * a.key_stride + e_doc) - first
    piece = a.by_doc[expand_ranges(first, count)]
    piece_len = np.minimum(a.end[piece], np.repeat(e_doc, count)) - a.start[piece]
    far = ~mine[piece]
    piece, piece_len = piece[far], piece_len[far]
    remote = (
        expand_ranges(src[piece] - t, piece_len),
        np.repeat(a.doc[piece], piece_len),
        expand_ranges(a.start[piece], piece_len),
    )

    if mode == "alltoallv":
        splits = tuple(int(x) for x in recv_splits)
        moved = int((a.need - a.held).sum())
        return CommMap(
            mode, "all_to_all" if moved else "none", send_index, 0, send_splits, splits,
            int(recv_splits.sum()), kv_index, *remote,
        )
    peers = n - 1
    splits = tuple(0 if p == coll[i] else rows for p in range(n))
    return CommMap(
        mode, "all_gather" if rows and peers else "none", send_index, rows, splits, splits,
        peers * rows, kv_index, *remote,
    )


def planned_recv_tokens(plan: Plan, rank: int, mode: str) -> int:
    """KV tokens ``rank`` receives per pass in ``mode`` according to the plan's own figures.

    full: (N - 1) x tokens per rank (padding included); compact_allgather: (N - 1) x the
    group's largest compact buffer; alltoallv: the rank's ``rank_stats.alltoallv_recv``.
    """
    found = _planned_figures(plan, rank)
    if found is None:
        return 0
    slot, _, volumes, tokens = found
    return recv_tokens_by_mode(mode, volumes, tokens)[slot]


def planned_kv_tokens_peak(plan: Plan, rank: int, mode: str) -> int:
    """KV tokens ``rank`` holds at once per layer in ``mode`` (a gather mode or
    ``p2p_ring``) by the plan's figures (``cost.kv_tokens_peak``; the plan's own mode is
    ``rank_stats.kv_tokens_peak``)."""
    found = _planned_figures(plan, rank)
    if found is None:
        return 0
    slot, stats, volumes, tokens = found
    return kv_tokens_peak(mode, volumes, stats.tokens, tokens)[slot]


def _planned_figures(plan: Plan, rank: int) -> tuple[int, RankStats, CommVolumes, int] | None:
    """``rank``'s slot in its group, the group's stats, its exchange volumes and tokens per
    rank (padding included), as the plan states them; None if no group holds ``rank``."""
    gi, slot = find_slot(plan, rank)
    if gi < 0:
        return None
    group = plan.groups[gi]
    stats = group.rank_stats
    volumes = CommVolumes(alltoallv_recv=stats.alltoallv_recv, allgather_send=stats.allgather_send)
    return slot, stats, volumes, stats.tokens[slot] + group.padding[slot]
