"""The exchange of one sliding-window layer: its transfers, comm maps and ring schedule.

Under a window W the query at doc position p attends keys ``[max(0, p - W + 1), p]``, so
a rank's shard ``[s, e)`` of a doc needs from its peers only the *gap* before it: the
keys ``[max(e', s - W + 1), s)`` with ``e'`` the end of the rank's previous shard of the
doc (0 if none), which no own shard holds. Cut at the bounds of the peers' shards that
hold them, the gaps are the group's transfers ``(receiver, sender, doc, [lo, hi))``
(``planner_service.core.halo_map``'s, recomputed here from the group's arrays in numpy:
the runtime reads only the plan). From them, per window:

- ``alltoallv``: rank i sends each peer, in collective order, the transfers it is the
  sender of, sorted by (doc, lo); it receives the same order from each sender. Receive
  total: the window's ``alltoallv_recv`` (core/window_work.py).
- ``compact_allgather``: every shard sends the suffix its doc's next run on another rank
  reaches: ``[max(s, s_next - W + 1), e)`` with ``s_next`` the start of the nearest later
  shard of the doc held elsewhere (none: nothing); buffers padded to the group's largest,
  which is the window's ``allgather_send``.
- ``full``: the causal map (every local buffer moves whatever the window).
- ``p2p_ring``: step k is useful to slot i when slot ``i - k`` is a sender of i; the ring
  runs the steps up to the group's last useful one (``window_work.RingSchedule``); its
  gathered form (flash kernels) receives the blocks of those steps' senders in one
  all-to-all (``build_ring_window_map``).

The maps' ``remote_*`` arrays are the distinct halo keys, sorted by (doc, position), which
is what the lean path reads; their ``kv_index`` is empty (the gathered form reads the
causal map's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from worker_runtime.layout import CommMap, GroupArrays, RankLayout, expand_ranges


class WindowTransfers(NamedTuple):
    """One entry per (gap, holder shard): slot ``sender`` sends positions ``[lo, hi)`` of
    doc index ``dd`` (into ``GroupArrays.docs``) to slot ``receiver``; ``holder`` is the
    sender's shard (index into the group's arrays)."""

    receiver: np.ndarray
    sender: np.ndarray
    dd: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    holder: np.ndarray


def window_transfers(a: GroupArrays, window: int) -> WindowTransfers:
    """The group's transfers under ``window`` (module docstring). O(s log s + x) for s
    shards and x transfers."""
    empty = np.zeros(0, dtype=np.int64)
    keep = np.flatnonzero(a.end > a.start)
    if len(keep) == 0:
        return WindowTransfers(empty, empty, empty, empty, empty, empty)
    order = keep[np.lexsort((a.start[keep], a.dd[keep], a.slot[keep]))]
    r, d, s = a.slot[order], a.dd[order], a.start[order]
    prev = np.zeros(len(order), dtype=np.int64)
    same = (r[1:] == r[:-1]) & (d[1:] == d[:-1])
    prev[1:] = np.where(same, a.end[order][:-1], 0)
    lo = np.maximum(prev, s - window + 1)
    gap = lo < s
    g_recv, g_dd, g_lo, g_hi = r[gap], d[gap], lo[gap], s[gap]
    # Holders: the nonempty shards by (doc, start); a gap overlaps a contiguous run.
    by_doc = keep[np.lexsort((a.start[keep], a.dd[keep]))]
    stride = a.key_stride
    first = np.searchsorted(a.dd[by_doc] * stride + a.end[by_doc], g_dd * stride + g_lo, side="right")
    last = np.searchsorted(a.dd[by_doc] * stride + a.start[by_doc], g_dd * stride + g_hi, side="left")
    count = last - first
    which = np.repeat(np.arange(len(g_recv), dtype=np.int64), count)
    holder = by_doc[expand_ranges(first, count)]
    t_lo = np.maximum(g_lo[which], a.start[holder])
    t_hi = np.minimum(g_hi[which], a.end[holder])
    return WindowTransfers(g_recv[which], a.slot[holder], g_dd[which], t_lo, t_hi, holder)


def _reach(a: GroupArrays, window: int) -> np.ndarray:
    """Per shard, the first position of its compact all-gather suffix (``end``: nothing
    sent): ``max(s, s_next - W + 1)`` for the start ``s_next`` of the doc's next run of
    nonempty shards on another slot."""
    reach = a.end.copy()
    keep = np.flatnonzero(a.end > a.start)
    if len(keep) == 0:
        return reach
    order = keep[np.lexsort((a.start[keep], a.dd[keep]))]
    r, d, s = a.slot[order], a.dd[order], a.start[order]
    head = np.ones(len(order), dtype=bool)
    head[1:] = (r[1:] != r[:-1]) | (d[1:] != d[:-1])
    run_first = np.flatnonzero(head)
    run = np.cumsum(head) - 1
    nxt = np.append(run_first[1:], len(order))[run]
    has_next = nxt < len(order)
    nxt = np.minimum(nxt, len(order) - 1)
    has_next &= d[nxt] == d
    reach[order] = np.where(has_next, np.maximum(s, s[nxt] - window + 1), a.end[order])
    return np.minimum(reach, a.end)


def build_window_comm_map(layout: RankLayout, mode: str, window: int,
                          order: Sequence[int] | None = None) -> CommMap:
    """The comm map of ``layout``'s rank for a ``window`` layer in ``mode``
    (``alltoallv`` or ``compact_allgather``; module docstring). ``order[slot]``: the
    slot's rank inside the collectives' process group (default: sorted group ranks).
    Raises ValueError for another mode."""
    if mode not in ("alltoallv", "compact_allgather"):
        raise ValueError(f"a window comm map is built for alltoallv or compact_allgather, got {mode!r}")
    empty = np.zeros(0, dtype=np.int64)
    a = layout.arrays
    if a is None:
        return CommMap(mode, "none", empty, 0, (), (), 0, empty, empty, empty, empty)
    n, i = a.num_ranks, layout.slot
    coll = np.argsort(np.argsort(a.ranks)) if order is None else np.asarray(order, dtype=np.int64)
    tr = window_transfers(a, window)
    length = tr.hi - tr.lo
    # Receive side: from each sender in collective order, its transfers by (doc, lo).
    mine = np.flatnonzero(tr.receiver == i)
    mine = mine[np.lexsort((tr.lo[mine], tr.dd[mine], coll[tr.sender[mine]]))]
    recv_splits = np.zeros(n, dtype=np.int64)
    np.add.at(recv_splits, coll[tr.sender[mine]], length[mine])
    if mode == "alltoallv":
        rows = 0
        base = np.cumsum(length[mine]) - length[mine]
        sent = np.flatnonzero(tr.sender == i)
        sent = sent[np.lexsort((tr.lo[sent], tr.dd[sent], coll[tr.receiver[sent]]))]
        offset = a.local_start[tr.holder[sent]] + tr.lo[sent] - a.start[tr.holder[sent]]
        send_index = expand_ranges(offset, length[sent])
        send_splits = np.zeros(n, dtype=np.int64)
        np.add.at(send_splits, coll[tr.receiver[sent]], length[sent])
        collective = "all_to_all" if len(tr.lo) else "none"
        splits_out = tuple(int(x) for x in send_splits)
        recv_rows = int(recv_splits.sum())
        splits_in = tuple(int(x) for x in recv_splits)
    else:
        reach = _reach(a, window)
        clen = a.end - reach
        total = np.zeros(n, dtype=np.int64)
        np.add.at(total, a.slot, clen)
        cstart = np.cumsum(clen) - clen - np.repeat(np.cumsum(total) - total, np.diff(a.slot_bounds))
        rows = int(total.max(initial=0))
        lo_s, hi_s = a.slot_bounds[i], a.slot_bounds[i + 1]
        send_index = expand_ranges(a.local_start[lo_s:hi_s] + reach[lo_s:hi_s] - a.start[lo_s:hi_s],
                                   clen[lo_s:hi_s])
        peer_pos = coll - (coll > coll[i])
        h = tr.holder[mine]
        assert (tr.lo[mine] >= reach[h]).all(), "every halo key is in its sender's compact suffix"
        base = peer_pos[tr.sender[mine]] * rows + cstart[h] + tr.lo[mine] - reach[h]
        collective = "all_gather" if rows and n > 1 else "none"
        splits_out = splits_in = tuple(0 if p == coll[i] else rows for p in range(n))
        recv_rows = (n - 1) * rows
    # The distinct halo keys by (doc, position): the receive rows of the transfers.
    by_key = np.lexsort((tr.lo[mine], tr.dd[mine]))
    sel = mine[by_key]
    remote_index = expand_ranges(base[by_key], length[sel])
    remote_doc = np.repeat(a.docs[tr.dd[sel]], length[sel])
    remote_pos = expand_ranges(tr.lo[sel], length[sel])
    return CommMap(mode, collective, send_index, rows, splits_out, splits_in, recv_rows,
                   empty, remote_index, remote_doc, remote_pos)


def ring_steps(layout: RankLayout, window: int) -> tuple[np.ndarray, int]:
    """(``useful[i, k]``: step k brings slot i a key inside one of its windows, the
    number of steps the group's ring runs: its last useful step, 0 for none)."""
    a = layout.arrays
    n = layout.num_ranks
    useful = np.zeros((n, n), dtype=bool)
    if a is None or n == 0:
        return useful, 0
    tr = window_transfers(a, window)
    useful[tr.receiver, (tr.receiver - tr.sender) % n] = True
    steps = np.flatnonzero(useful.any(axis=0))
    return useful, int(steps[-1]) if len(steps) else 0


def build_ring_window_map(layout: RankLayout, window: int,
                          order: Sequence[int] | None = None) -> CommMap:
    """The gathered form's exchange of a ``p2p_ring`` plan's ``window`` layer: one
    all-to-all in which slot i receives the whole local buffers (padding included, the
    ring's blocks) of slots ``i - 1 .. i - S`` and sends its own to ``i + 1 .. i + S``,
    S the ring's ``steps_run`` (:func:`ring_steps`): the ring's bytes, ``S`` x tokens per
    rank, in one collective. Every key inside a window of slot i is held by a slot at
    ring distance at most S, so the gathered call (``window_gather``) finds all of them.
    ``remote_*``: every real row received, by sender in collective order; backward
    returns each copy's dK/dV, summed into the local rows (``send_index`` repeats the
    buffer once per receiver). O(s + S T) for s shards, T rows per rank."""
    empty = np.zeros(0, dtype=np.int64)
    a = layout.arrays
    if a is None:
        return CommMap("p2p_ring", "none", empty, 0, (), (), 0, empty, empty, empty, empty)
    n, i, t = a.num_ranks, layout.slot, layout.num_tokens
    coll = np.argsort(np.argsort(a.ranks)) if order is None else np.asarray(order, dtype=np.int64)
    _, steps = ring_steps(layout, window)
    dist_ = np.arange(1, steps + 1, dtype=np.int64)
    senders, receivers = (i - dist_) % n, (i + dist_) % n
    recv_splits = np.zeros(n, dtype=np.int64)
    recv_splits[coll[senders]] = t
    send_splits = np.zeros(n, dtype=np.int64)
    send_splits[coll[receivers]] = t
    # Each sender's block sits at t x (its rank among the senders in collective order).
    block = np.full(n, -1, dtype=np.int64)
    by_coll = senders[np.argsort(coll[senders])]
    block[by_coll] = np.arange(len(by_coll), dtype=np.int64) * t
    held = np.flatnonzero((block[a.slot] >= 0) & (a.end > a.start))
    length = a.end[held] - a.start[held]
    remote_index = expand_ranges(block[a.slot[held]] + a.local_start[held], length)
    remote_doc = np.repeat(a.doc[held], length)
    remote_pos = expand_ranges(a.start[held], length)
    send_index = np.tile(np.arange(t, dtype=np.int64), steps)
    return CommMap("p2p_ring", "all_to_all" if steps and t else "none", send_index, 0,
                   tuple(int(x) for x in send_splits), tuple(int(x) for x in recv_splits),
                   steps * t, empty, remote_index, remote_doc, remote_pos)


class WindowGather(NamedTuple):
    """The gathered form of a window layer on a window comm map: per own shard ``(d, s,
    e)`` (plan order) its keys ``[max(0, s - W + 1), e)`` as rows of ``cat(local buffer,
    receive buffer)``."""

    kv_index: np.ndarray
    cu_seqlens_k: np.ndarray
    """int32 ``[num_shards + 1]``: shard j's key segment."""


def window_gather(layout: RankLayout, comm: CommMap, window: int) -> WindowGather:
    """Key rows of every own shard's window span (``WindowGather``) from ``comm``'s distinct
    halo keys and the local rows. O((T + R) log (T + R))."""
    r, t = layout.num_real, layout.num_tokens
    doc = np.concatenate((layout.doc_ids[:r], comm.remote_doc)).astype(np.int64)
    pos = np.concatenate((layout.positions[:r], comm.remote_pos)).astype(np.int64)
    rows = np.concatenate((np.arange(r, dtype=np.int64), t + comm.remote_index))
    shards = np.array(layout.shards, dtype=np.int64).reshape(-1, 3)
    stride = int(max(pos.max(initial=0), shards[:, 2].max(initial=0))) + 1
    key = doc * stride + pos
    order = np.argsort(key, kind="stable")
    key, rows = key[order], rows[order]
    lo = np.maximum(shards[:, 1] - window + 1, 0)
    first = np.searchsorted(key, shards[:, 0] * stride + lo)
    last = np.searchsorted(key, shards[:, 0] * stride + shards[:, 2])
    count = last - first
    assert (count == shards[:, 2] - lo).all(), "every key of a shard's windows is local or received"
    return WindowGather(rows[expand_ranges(first, count)],
                        np.concatenate(([0], np.cumsum(count))).astype(np.int32))
