"""The segments path's key sets as varlen calls (``PieceCall``): one rank's document mask split into
contiguous (query segment, key segment) pairs, each causal or full (numpy, built once).

flash-attn's varlen format gives each query segment one contiguous key segment, either
bottom-right causal or full. A rank that holds several shards of a document needs, per
shard, a different prefix of that document's keys; gathering one prefix per shard stores
the shared part several times. Instead, per document ``d`` held here, with its local
shards sorted by start ``S_1 .. S_m`` (``S_j = [s_j, e_j)``), the keys ``[0, e_m)`` split
into local pieces ``L_j = S_j`` and remote gaps ``G_j = [e_{j-1}, s_j)`` (``e_0 = 0``; every
gap token is a peer's). Shard ``S_j`` attends ``G_1, L_1, ..., G_j`` fully and ``L_j``
causally (a square block: bottom-right alignment equals top-left). So, with ``M`` the most
shards of one document on the rank, for every ``j`` and ``i <= j``:

- local call ``A(j, i)``: queries ``S_j`` of every document with at least ``j`` shards here,
  keys ``L_i`` of the same documents, causal iff ``i == j``;
- remote call ``B(j, i)``: the same queries, keys ``G_i``, full.

Buffers (one of each, kept for backward): the *local buffer* holds the rank's real rows
ordered by (piece ``j``, document order, position), so piece ``j`` is both query group
``j`` and key piece ``L_j``; the *remote buffer* holds the distinct remote tokens ordered by
(gap ``i``, document order, position). Documents are ordered by shard count, descending
(ties: local row of the first shard), so the documents with at least ``j`` shards are a
prefix of every piece and gap, and each call reads one contiguous slice of each buffer.
Every (query, key) pair of the document mask is in exactly one call; every key row is in
exactly one buffer. A gap can be empty for some documents (a rank holding a document's
first tokens has no ``G_1``); a remote call covers the documents from its first to its last
non-empty gap, and the query rows of the empty gaps inside that range are listed
(``PieceCall.empty``): the caller masks their (undefined) results.

``M (M + 1)`` calls per pass at most: ``j + 1`` local and up to ``j + 1`` remote calls for
query group ``j`` (0-based). When every document has one shard here (``M = 1``: one local
call and at most one remote call) the local buffer is the caller's rows in place.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from worker_runtime.layout import CommMap, RankLayout, expand_ranges


class PieceCall(NamedTuple):
    """One varlen kernel call: a contiguous slice of query rows against a contiguous slice
    of one buffer's keys."""

    remote: bool
    """Keys from the remote buffer (a gap ``G_i``) or the local buffer (a piece ``L_i``)."""
    causal: bool
    """Bottom-right causal per segment (``A(j, j)``) or full."""
    group: int
    """Query group ``j`` (0-based)."""
    piece: int
    """Key piece or gap ``i`` (0-based, ``i <= j``)."""
    q_lo: int
    q_hi: int
    """Query rows of the local buffer."""
    k_lo: int
    k_hi: int
    """Key rows of the local (``remote=False``) or remote buffer."""
    cu_q: np.ndarray
    cu_k: np.ndarray
    """int32 segment boundaries, relative to ``q_lo`` and ``k_lo``."""
    empty: np.ndarray
    """Query rows (relative to ``q_lo``) whose key segment is empty."""


class SegmentPlan(NamedTuple):
    """One rank's buffers and calls (see the module docstring)."""

    local_rows: np.ndarray
    """``[r]`` local row (the caller's q, k, v) of every local-buffer row."""
    in_place: bool
    """``local_rows`` is ``0 .. r - 1``: the caller's rows serve as the local buffer."""
    group_bounds: np.ndarray
    """Query group / piece ``j`` is local-buffer rows ``[group_bounds[j], group_bounds[j + 1])``."""
    remote_order: np.ndarray
    """``[R]`` index into ``CommMap.remote_*`` of every remote-buffer row."""
    calls: tuple[PieceCall, ...]
    """Local calls first (per group: ``A(j, j)``, then ``A(j, i < j)``), then remote calls."""
    docs: np.ndarray
    """The rank's documents in buffer order."""

    @property
    def num_local_calls(self) -> int:
        return sum(not c.remote for c in self.calls)


def _cumsum0(x: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(x))).astype(np.int64)


def build_segment_plan(layout: RankLayout, comm: CommMap | None,
                       window: int | None = None) -> SegmentPlan:
    """Buffers and calls of ``layout``'s rank for the distinct remote KV of ``comm``;
    ``comm=None``: the local buffer and the local calls alone (no remote buffer, no remote
    calls; the segment ring, ``segment_ring.py``, reads remote keys from the ring's blocks).
    ``window``: a sliding-window layer on a halo map (``window_map.py``): gap ``G_j`` is
    its halo ``[max(e_{j-1}, s_j - W + 1), s_j)`` (every key a window of ``S_j`` or a later
    shard reaches), taken from ``comm``'s remote keys, which may hold more (the compact
    all-gather's padding and suffixes for other ranks: not put in the remote buffer).

    O(S log S + M S) numpy for S shards on the rank and M the most shards of one document
    here; nothing loops over tokens.
    """
    empty = np.zeros(0, dtype=np.int64)
    shards = np.array(layout.shards, dtype=np.int64).reshape(-1, 3)
    length = shards[:, 2] - shards[:, 1]
    row = _cumsum0(length)[:-1]
    keep = length > 0
    doc, start, end, row, length = shards[keep, 0], shards[keep, 1], shards[keep, 2], row[keep], length[keep]
    if len(doc) == 0:
        return SegmentPlan(empty, True, np.zeros(1, dtype=np.int64), empty, (), empty)

    # Shards by (doc, start); j = index of the shard within its doc.
    by_doc = np.lexsort((start, doc))
    docs, first, counts = np.unique(doc[by_doc], return_index=True, return_counts=True)
    piece_of = np.arange(len(by_doc)) - np.repeat(first, counts)
    # Document order: most shards first (a prefix per piece), then by first local row.
    doc_order = np.lexsort((row[by_doc][first], -counts))
    rank_of = np.empty(len(docs), dtype=np.int64)
    rank_of[doc_order] = np.arange(len(docs))
    t_of = rank_of[np.repeat(np.arange(len(docs)), counts)]
    num_pieces = int(counts.max())
    num_docs = len(docs)
    counts_sorted = counts[doc_order]
    docs_with = np.array([(counts_sorted > j).sum() for j in range(num_pieces)], dtype=np.int64)

    # Dense (piece, doc rank) tables of shard start, end and local row.
    s_tab = np.zeros((num_pieces, num_docs), dtype=np.int64)
    e_tab = np.zeros((num_pieces, num_docs), dtype=np.int64)
    s_tab[piece_of, t_of] = start[by_doc]
    e_tab[piece_of, t_of] = end[by_doc]
    present = np.arange(num_docs)[None, :] < docs_with[:, None]
    len_tab = np.where(present, e_tab - s_tab, 0)
    prev_end = np.vstack((np.zeros((1, num_docs), dtype=np.int64), e_tab[:-1]))
    gap_tab = np.where(present, s_tab - prev_end, 0)
    assert (gap_tab >= 0).all(), "shards of one doc on one rank do not overlap"

    # Local buffer: shards in (piece, doc rank) order.
    buf = np.lexsort((t_of, piece_of))
    local_rows = expand_ranges(row[by_doc][buf], length[by_doc][buf])
    in_place = bool(np.array_equal(local_rows, np.arange(len(local_rows))))
    group_bounds = _cumsum0(len_tab.sum(axis=1))
    local_calls = [
        PieceCall(False, i == j, j, i, int(group_bounds[j]), int(group_bounds[j + 1]),
                    int(group_bounds[i]), int(group_bounds[i]) + int(len_tab[i, : docs_with[j]].sum()),
                    _cumsum0(len_tab[j, : docs_with[j]]).astype(np.int32),
                    _cumsum0(len_tab[i, : docs_with[j]]).astype(np.int32), empty)
        for j in range(num_pieces) for i in [j, *range(j)]
    ]
    if comm is None:
        return SegmentPlan(local_rows, in_place, group_bounds, empty, tuple(local_calls), docs[doc_order])

    # Remote buffer: per (gap, doc rank), the remote tokens of [prev_end, start), located in
    # the comm map's (doc, position)-sorted distinct remote arrays.
    stride = int(max(comm.remote_pos.max(initial=0), e_tab.max(initial=0))) + 1
    remote_key = comm.remote_doc * stride + comm.remote_pos
    gap_doc = np.broadcast_to(docs[doc_order], gap_tab.shape)
    if window is not None:
        gap_lo = np.maximum(prev_end, s_tab - window + 1)
        gap_tab = np.where(present, s_tab - gap_lo, 0)
    else:
        gap_lo = prev_end
    lo = np.searchsorted(remote_key, gap_doc * stride + gap_lo)
    hi = np.searchsorted(remote_key, gap_doc * stride + s_tab)
    assert (np.where(present, hi - lo, 0) == gap_tab).all(), "every gap token is a distinct remote token"
    remote_order = expand_ranges(lo[present], gap_tab[present])
    assert window is not None or len(remote_order) == len(comm.remote_index), \
        "the gaps are the distinct remote KV"
    remote_bounds = _cumsum0(gap_tab.sum(axis=1))

    remote_calls: list[PieceCall] = []
    for j in range(num_pieces):
        n = int(docs_with[j])
        cu_q = _cumsum0(len_tab[j, :n])
        q_lo = int(group_bounds[j])
        for i in range(j + 1):
            gaps = gap_tab[i, :n]
            nonzero = np.flatnonzero(gaps)
            if len(nonzero) == 0:
                continue
            t0, t1 = int(nonzero[0]), int(nonzero[-1]) + 1
            cu_g = _cumsum0(gaps)
            seg_q = cu_q[t0 : t1 + 1] - cu_q[t0]
            seg_k = cu_g[t0 : t1 + 1] - cu_g[t0]
            hollow = np.flatnonzero(gaps[t0:t1] == 0)
            k_lo = int(remote_bounds[i] + cu_g[t0])
            remote_calls.append(PieceCall(
                True, False, j, i, q_lo + int(cu_q[t0]), q_lo + int(cu_q[t1]), k_lo,
                k_lo + int(seg_k[-1]), seg_q.astype(np.int32), seg_k.astype(np.int32),
                expand_ranges(seg_q[hollow], np.diff(seg_q)[hollow])))
    return SegmentPlan(local_rows, in_place, group_bounds, remote_order,
                       tuple(local_calls + remote_calls), docs[doc_order])

