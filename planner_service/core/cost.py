"""Cost accounting shared by every solver, benchmark, the validator and the runtime.

Formulas (docs/plan.md, Cost accounting; FlashCP, arXiv:2606.08476, section 3):

- workload of shard (d, p, p + s) under causal masking inside its doc is the number of
  query-key pairs ``W = (2p + s + 1) * s / 2``; a whole doc of length L: ``L (L + 1) / 2``.
- a rank that holds shard (d, p, e) needs the K and V of doc d for tokens [0, e).
- exact all-to-all-v: a rank receives, per doc it holds, the prefix up to the end of its
  last shard of that doc minus what it holds itself.
- compact all-gather: a rank contributes, per shard, the part some *other* rank needs
  (below the furthest end any other rank holds of that doc); everyone receives every
  other rank's buffer, padded to the largest buffer when the collective needs equal sizes.
- full exchange: every rank receives every other rank's tokens, (N - 1) x tokens per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import itemgetter
from typing import NamedTuple

import numpy as np

from planner_service.core.plan import Shard


def shard_workload(start: int, length: int) -> int:
    """Query-key pairs of a shard of ``length`` queries starting at doc position ``start``.

    Query at position i attends keys [0, i]: sum over i in [p, p+s) of (i + 1)
    = (2p + s + 1) * s / 2, an integer since s and 2p + s + 1 are never both odd.
    """
    return (2 * start + length + 1) * length // 2


def doc_workload(length: int) -> int:
    """Query-key pairs of a whole doc: L (L + 1) / 2."""
    return length * (length + 1) // 2


def rank_workloads(shards_per_rank: Sequence[Sequence[Shard]]) -> list[int]:
    # shard_workload inlined: (2p + s + 1) s / 2 = (p + e + 1)(e - p) / 2.
    return [sum((a + b + 1) * (b - a) // 2 for _, a, b in rank) for rank in shards_per_rank]


def imbalance(workloads: Sequence[int]) -> float:
    """max / mean over ranks; 1.0 when there is no work at all."""
    total = sum(workloads)
    if total == 0:
        return 1.0
    return max(workloads) * len(workloads) / total


class CommVolumes(NamedTuple):
    """KV tokens moved per pass by each exchange of one group, per rank in group order."""

    alltoallv_recv: tuple[int, ...]
    """Exact all-to-all-v: tokens each rank receives."""
    allgather_send: tuple[int, ...]
    """Compact all-gather: tokens each rank contributes (unpadded buffer)."""

    @property
    def alltoallv_tokens(self) -> int:
        """Critical path: the rank that receives most."""
        return max(self.alltoallv_recv, default=0)

    @property
    def compact_allgather_tokens(self) -> int:
        """Critical path with equal-size buffers: (N - 1) x the largest buffer."""
        n = len(self.allgather_send)
        return (n - 1) * max(self.allgather_send, default=0)


def last_ends(shards: Sequence[Shard]) -> dict[int, int]:
    """Per doc, the end of a rank's last shard of it: the KV prefix the rank needs."""
    end: dict[int, int] = {}
    for doc, _, stop in shards:
        if stop > end.get(doc, 0):
            end[doc] = stop
    return end


def alltoallv_receives_reference(shards_per_rank: Sequence[Sequence[Shard]]) -> list[int]:
    """Per rank, the KV tokens the exact all-to-all-v delivers: per doc it holds, the
    prefix up to its last shard's end minus what it holds; summed, the ends minus its
    own tokens."""
    return [sum(last_ends(shards).values()) - sum(b - a for _, a, b in shards)
            for shards in shards_per_rank]


_doc_of, _start_of = itemgetter(0), itemgetter(1)


def rank_receive(shards: Sequence[Shard]) -> tuple[int, list[int]]:
    """One rank's all-to-all-v receive (``alltoallv_receives_reference``) and the docs it
    holds as two or more shards (unordered). O(s) for its s shards, at C speed where no
    doc repeats (most ranks): then each shard needs exactly the prefix below its start."""
    if len(set(map(_doc_of, shards))) == len(shards):
        return sum(map(_start_of, shards)), []
    # One pass: each doc's furthest end (``last_ends``), the docs met again, own tokens.
    end: dict[int, int] = {}
    repeated: set[int] = set()
    held = 0
    for doc, a, b in shards:
        held += b - a
        if doc in end:
            repeated.add(doc)
            if b > end[doc]:
                end[doc] = b
        else:
            end[doc] = b
    return sum(end.values()) - held, list(repeated)


def alltoallv_receives(shards_per_rank: Sequence[Sequence[Shard]]) -> list[int]:
    """``alltoallv_receives_reference`` rank by rank by ``rank_receive``. O(s)."""
    return [rank_receive(shards)[0] for shards in shards_per_rank]


def comm_volumes(shards_per_rank: Sequence[Sequence[Shard]]) -> CommVolumes:
    """Per-rank all-to-all-v receive and compact all-gather send volumes."""
    ends = [last_ends(shards) for shards in shards_per_rank]
    recv = [sum(end.values()) - sum(b - a for _, a, b in shards)
            for end, shards in zip(ends, shards_per_rank, strict=True)]
    # The furthest end among a doc's holders (with its rank) and the runner-up: the
    # furthest end any *other* rank needs is the runner-up for the furthest holder itself.
    first: dict[int, tuple[int, int]] = {}
    second: dict[int, int] = {}
    for rank, end in enumerate(ends):
        for doc, stop in end.items():
            best = first.get(doc)
            if best is None:
                first[doc] = (stop, rank)
            elif stop > best[0]:
                second[doc] = best[0]
                first[doc] = (stop, rank)
            elif stop > second.get(doc, 0):
                second[doc] = stop
    send = []
    for rank, shards in enumerate(shards_per_rank):
        total = 0
        for doc, start, stop in shards:
            furthest, holder = first[doc]
            other = second.get(doc, 0) if holder == rank else furthest
            if other > start:
                total += min(stop, other) - start
        send.append(total)
    return CommVolumes(alltoallv_recv=tuple(recv), allgather_send=tuple(send))


def full_exchange_tokens(num_ranks: int, tokens_per_rank: int) -> int:
    """Tokens each rank receives in a full all-gather (or an N - 1 step ring)."""
    return (num_ranks - 1) * tokens_per_rank


def recv_tokens_by_mode(mode: str, volumes: CommVolumes, tokens_per_rank: int) -> tuple[int, ...]:
    """Per-rank tokens received in ``mode``."""
    n = len(volumes.alltoallv_recv)
    if mode in ("full", "p2p_ring"):
        return (full_exchange_tokens(n, tokens_per_rank),) * n
    if mode == "compact_allgather":
        return (volumes.compact_allgather_tokens,) * n
    if mode == "alltoallv":
        return volumes.alltoallv_recv
    raise ValueError(f"comm_mode {mode!r} is unknown")


def kv_tokens_peak(
    mode: str, volumes: CommVolumes, tokens: Sequence[int], tokens_per_rank: int
) -> tuple[int, ...]:
    """Per rank, the KV tokens the worker runtime holds at once for one layer's attention.

    Gather modes (full, compact all-gather, all-to-all-v): the rank's own tokens plus one
    copy of every remote token it attends (per doc, the prefix up to its last shard's end),
    kept from forward to backward: ``tokens + alltoallv_recv``. The transient receive
    buffer of the full and compact exchanges is freed before the kernel runs.
    ``p2p_ring``: own tokens plus the block being attended and the one in flight
    (``min(N - 1, 2)`` blocks of ``tokens_per_rank`` rows); backward re-circulates the
    blocks, so nothing remote is kept between the passes.
    """
    n = len(volumes.alltoallv_recv)
    if mode == "p2p_ring":
        return tuple(t + min(n - 1, 2) * tokens_per_rank for t in tokens)
    if mode in ("full", "compact_allgather", "alltoallv"):
        return tuple(t + r for t, r in zip(tokens, volumes.alltoallv_recv, strict=True))
    raise ValueError(f"comm_mode {mode!r} is unknown")


def saving(tokens: int, full_tokens: int) -> float:
    """1 - tokens / full_tokens; 0.0 when the full exchange moves nothing."""
    return 0.0 if full_tokens == 0 else 1.0 - tokens / full_tokens


# Vectorised forms of the figures above, for groups with many shards (core/metrics.py and
# core/build.py); tests compare them with the functions above on random inputs.


class ShardArrays(NamedTuple):
    """A group's shards as flat int64 arrays, rank by rank: rank i's shards are entries
    ``bounds[i]:bounds[i + 1]``."""

    rank: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    end: np.ndarray
    bounds: np.ndarray
    """Length N + 1."""


def shard_arrays(shards_per_rank: Sequence[Sequence[Shard]]) -> ShardArrays | None:
    """The shards as ``ShardArrays``; None where int64 arithmetic could overflow (a doc,
    start or end outside [0, 2^31), an end before its start, or more than 2^62 workload in
    all), so callers fall back to the functions above. O(s) for s shards."""
    counts = np.fromiter(map(len, shards_per_rank), dtype=np.int64, count=len(shards_per_rank))
    total = int(counts.sum())
    try:
        flat = np.fromiter(chain.from_iterable(chain.from_iterable(shards_per_rank)),
                           dtype=np.int64, count=3 * total).reshape(total, 3)
    except (OverflowError, ValueError, TypeError):
        return None
    doc, start, end = flat[:, 0], flat[:, 1], flat[:, 2]
    if total and (int(flat.min()) < 0 or int(flat.max()) >= 1 << 31
                  or bool((end < start).any())):
        return None
    bounds = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    arrays = ShardArrays(np.repeat(np.arange(len(counts), dtype=np.int64), counts),
                         doc, start, end, bounds)
    if total and float(shard_workloads(arrays).sum(dtype=np.float64)) >= 2.0**62:
        return None
    return arrays


def shard_workloads(arrays: ShardArrays) -> np.ndarray:
    """``shard_workload`` of every shard (int64)."""
    return (arrays.start + arrays.end + 1) * (arrays.end - arrays.start) // 2


LEX_CHECK_MIN = 256
"""Entries from which ``lex_order`` checks the order before sorting."""


def lex_order(keys: Sequence[np.ndarray]) -> np.ndarray:
    """``np.lexsort(keys)`` (last key primary, stable), skipping the sort where the entries
    are already in that order, as canonical shards are by (rank, doc, start): then the
    stable sort is the identity. O(s k) to check, O(s log s) otherwise; below
    ``LEX_CHECK_MIN`` entries the sort alone is cheaper than the check."""
    n = len(keys[0])
    if 1 < n < LEX_CHECK_MIN:
        return np.lexsort(keys)
    if n > 1:
        ahead = np.zeros(n - 1, dtype=bool)
        tied = np.ones(n - 1, dtype=bool)
        for key in reversed(keys):
            ahead |= tied & (key[:-1] < key[1:])
            tied &= key[:-1] == key[1:]
        if not (ahead | tied).all():
            return stable_lexsort(keys)
    return np.arange(n)


def held_docs(doc: np.ndarray) -> np.ndarray:
    """``np.unique(doc)`` (the docs held, ascending) for non-negative doc indices: by a
    table of the docs present where the largest index is within a few times the shard
    count (a solver's docs are indices into the request's lengths), else by sorting. O(s)
    or O(s log s)."""
    if not len(doc):
        return doc[:0]
    top = int(doc.max())
    if top > 4 * len(doc) + 1024:
        return np.unique(doc)
    present = np.zeros(top + 1, dtype=bool)
    present[doc] = True
    return np.flatnonzero(present)


COMPOSITE_BITS = 63
"""Bits of an int64 composite key (``stable_lexsort``): non-negative below 2^63."""


def stable_lexsort(keys: Sequence[np.ndarray]) -> np.ndarray:
    """``np.lexsort(keys)`` for int64 keys: where every key's range fits one int64 side by
    side (the last key in the top bits), the stable sort of that composite key, which is
    the same order (lexicographic, ties in input order) and much faster on entries that
    are sorted in runs (a stable sort merges them); else ``np.lexsort``. O(s k) plus the
    sort."""
    if not len(keys[0]):
        return np.lexsort(keys)
    lows = [int(key.min()) for key in keys]
    widths = [(int(key.max()) - low).bit_length() for key, low in zip(keys, lows, strict=True)]
    if sum(widths) > COMPOSITE_BITS:
        return np.lexsort(keys)
    composite = np.zeros(len(keys[0]), dtype=np.int64)
    shift = 0
    for key, low, width in zip(keys, lows, widths, strict=True):
        composite |= (key - low) << shift
        shift += width
    return np.argsort(composite, kind="stable")


def per_rank_sums(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Exact int64 sums of ``values`` over each rank's entries ``bounds[i]:bounds[i + 1]``."""
    sums = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values, out=sums[1:])
    return sums[bounds[1:]] - sums[bounds[:-1]]


def rank_workloads_of(arrays: ShardArrays) -> list[int]:
    """``rank_workloads`` from ``ShardArrays``."""
    return per_rank_sums(shard_workloads(arrays), arrays.bounds).tolist()


class GroupVolumes(NamedTuple):
    """``comm_volumes_of``'s answer."""

    volumes: CommVolumes
    docs: list[int]
    """The docs the group holds, ascending."""
    split_docs: int
    """Docs held by more than one rank."""


def comm_volumes_of(arrays: ShardArrays) -> GroupVolumes:
    """``comm_volumes`` from ``ShardArrays``, with the docs held and how many are split.
    O(s log s).

    Per (rank, doc) the last end (``last_ends``); per doc the furthest end and the
    runner-up among its holders (equal to the furthest where two ranks tie); a shard then
    sends up to the runner-up if its rank holds the furthest end, else up to the furthest.
    """
    n = len(arrays.bounds) - 1
    rank, doc, start, end = arrays.rank, arrays.doc, arrays.start, arrays.end
    if not len(rank):
        zeros = (0,) * n
        return GroupVolumes(CommVolumes(alltoallv_recv=zeros, allgather_send=zeros), [], 0)
    order = lex_order((doc, rank))  # canonical shards: already in order
    r, d = rank[order], doc[order]
    head = np.empty(len(r), dtype=bool)  # the first shard of each (rank, doc)
    head[0] = True
    np.not_equal(r[1:], r[:-1], out=head[1:])
    head[1:] |= d[1:] != d[:-1]
    firsts = np.flatnonzero(head)
    seg_end = np.maximum.reduceat(end[order], firsts)
    seg_rank, seg_doc = r[firsts], d[firsts]
    tokens = per_rank_sums(end - start, arrays.bounds)
    seg_bounds = np.searchsorted(seg_rank, np.arange(n + 1))
    recv = per_rank_sums(seg_end, seg_bounds) - tokens
    # Per doc, its holders' last ends, furthest first.
    by_doc = stable_lexsort((-seg_end, seg_doc))
    doc_sorted, end_sorted = seg_doc[by_doc], seg_end[by_doc]
    new_doc = np.empty(len(by_doc), dtype=bool)
    new_doc[0] = True
    np.not_equal(doc_sorted[1:], doc_sorted[:-1], out=new_doc[1:])
    group = np.cumsum(new_doc) - 1
    group_first = np.flatnonzero(new_doc)
    furthest = end_sorted[group_first]
    runner = np.zeros(len(group_first), dtype=np.int64)
    has_two = np.append(group_first[1:], len(by_doc)) - group_first > 1
    runner[has_two] = end_sorted[group_first[has_two] + 1]
    seg_group = np.empty(len(seg_end), dtype=np.int64)
    seg_group[by_doc] = group
    seg_other = np.where(seg_end == furthest[seg_group], runner[seg_group], furthest[seg_group])
    # Back to shards: each shard's (rank, doc) is the segment it falls in.
    shard_seg = np.empty(len(order), dtype=np.int64)
    shard_seg[order] = np.cumsum(head) - 1
    other = seg_other[shard_seg]
    sent = np.maximum(0, np.minimum(end, other) - start)
    send = per_rank_sums(sent, arrays.bounds)
    volumes = CommVolumes(alltoallv_recv=tuple(recv.tolist()), allgather_send=tuple(send.tolist()))
    return GroupVolumes(volumes, doc_sorted[group_first].tolist(), int(has_two.sum()))
