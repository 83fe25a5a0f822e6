"""Cost accounting shared by every solver, benchmark, the validator and the runtime.

Formulas (DESIGN.md section 3; FlashCP, arXiv:2606.08476, section 3):

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
from typing import NamedTuple

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


def alltoallv_receives(shards_per_rank: Sequence[Sequence[Shard]]) -> list[int]:
    """Per rank, the KV tokens the exact all-to-all-v delivers: per doc it holds, the
    prefix up to its last shard's end minus what it holds; summed, the ends minus its
    own tokens."""
    return [sum(last_ends(shards).values()) - sum(b - a for _, a, b in shards)
            for shards in shards_per_rank]


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
