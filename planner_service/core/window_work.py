"""Work and KV exchange of a group's shards in a sliding-window layer, in closed form.

A layer of window W (core/mask.py; None: causal) lets the query at document position p
attend the keys ``[max(0, p - W + 1), p]``. For a shard ``[s, e)`` of a document:

- **work** (query-key pairs): ``sum_{p=s}^{e-1} min(p + 1, W)``. With
  ``a = min(e, max(s, W))`` the positions below W attend their prefix and the rest W keys:
  ``(s + a + 1)(a - s) / 2 + (e - a) W``; W >= e gives ``cost.shard_workload``.
- **halo** (keys needed from outside the shard): ``[max(0, s - W + 1), s)``, against the
  causal prefix ``[0, s)``.

Per rank of a group (shards disjoint, as plans hold them), for each comm mode of
core/request.py:

- ``alltoallv`` (the exact exchange): the distinct remote keys the rank needs: per doc the
  union of its shards' ``[max(0, s - W + 1), e)`` minus its own tokens. With its shards of
  the doc in start order and ``e_prev`` the end of the previous one (0 for the first),
  each shard adds ``min(W - 1, s - e_prev)``; causal: the last end minus own tokens
  (``cost.alltoallv_receives``).
- ``compact_allgather``: each rank contributes, per shard, the tokens some other rank
  needs. Halos reach only left, so the other ranks' needs inside ``[s, e)`` are a suffix,
  set by the nearest later shard of the doc on another rank (start ``t``):
  ``max(0, e - max(s, t - W + 1))``, 0 without one; every rank receives ``N - 1`` buffers
  padded to the largest (``cost.CommVolumes.compact_allgather_tokens``).
- ``full``: ``(N - 1) T`` for T tokens per rank, whatever the mask.
- ``p2p_ring``: at step k = 1 .. N - 1 rank i holds the block of rank ``i - k`` (mod N);
  the step is *useful* to i if that block holds a key inside the window of one of i's
  queries: for a shard of i at s, the other rank's last shard of the doc below s ends
  after ``s - W + 1``. Blocks move one hop per step, so a ring that skips the calls of
  steps useful to no rank and stops after the last useful step of the group runs
  ``steps_run`` shifts of T rows: ``steps_run T`` received per rank, what the runtime's
  rings (and a ring plan's gathered form on flash kernels) move in windowed layers and
  plan metrics report (``skip_ring_steps``). Without skipping (causal layers):
  ``(N - 1) T``.

A hybrid model's figures are the layer-weighted sums over the mask's groups
(:func:`mask_figures`). Two forms of every figure: numpy over ``cost.ShardArrays`` (the
``*_of`` functions, O(s log s) for s shards, the ring O(s log s + t) for t (shard, other
holder of its doc) pairs, refused above ``step_time.runs.MAX_RING_PAIRS``) and a token by
token reference (the ``reference_*`` functions, sets of keys, O(tokens x W)), compared in
tests/test_core_window_work.py; W >= every doc reproduces core/cost.py's causal figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from planner_service.core import cost
from planner_service.core.mask import AttentionMask
from planner_service.core.plan import Shard
from planner_service.core.step_time.runs import ring_seen, sort_shards


def shard_window_workload(start: int, end: int, window: int | None) -> int:
    """Query-key pairs of shard ``[start, end)`` under ``window`` (module docstring)."""
    if window is None:
        return cost.shard_workload(start, end - start)
    a = min(end, max(start, window))
    return (start + a + 1) * (a - start) // 2 + (end - a) * window


class Halo(NamedTuple):
    """Doc positions ``[lo, hi)`` a shard's queries attend outside the shard."""

    lo: int
    hi: int

    @property
    def length(self) -> int:
        return self.hi - self.lo


def halo(start: int, window: int | None) -> Halo:
    """The keys before ``start`` a shard starting there attends: ``[max(0, s - W + 1), s)``,
    the whole prefix ``[0, s)`` when causal."""
    return Halo(0 if window is None else max(0, start - window + 1), start)


# Vectorised forms over cost.ShardArrays.


def shard_window_workloads(arrays: cost.ShardArrays, window: int | None) -> np.ndarray:
    """``shard_window_workload`` of every shard (int64). O(s)."""
    s, e = arrays.start, arrays.end
    if window is None:
        return cost.shard_workloads(arrays)
    a = np.minimum(e, np.maximum(s, window))
    return (s + a + 1) * (a - s) // 2 + (e - a) * window


def rank_window_workloads_of(arrays: cost.ShardArrays, window: int | None) -> list[int]:
    """Per rank, the pairs of its shards under ``window``. O(s)."""
    return cost.per_rank_sums(shard_window_workloads(arrays, window), arrays.bounds).tolist()


def _nonempty(arrays: cost.ShardArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    keep = arrays.end > arrays.start
    return arrays.rank[keep], arrays.doc[keep], arrays.start[keep], arrays.end[keep]


class SortedShards(NamedTuple):
    """A group's non-empty shards in the two orders the exchange formulas read, sorted once
    for every window of a mask. O(s log s); O(s) for canonical shards, already in rank
    order (``cost.lex_order``)."""

    n: int
    by_rank: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    """(rank, doc, start, end) by rank, doc, start."""
    by_doc: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    """(rank, doc, start, end) by doc, start."""


def sorted_shards(arrays: cost.ShardArrays) -> SortedShards:
    """``arrays`` sorted for :func:`window_comm_volumes_of` (``SortedShards``)."""
    rank, doc, start, end = _nonempty(arrays)
    cols = (rank, doc, start, end)
    by_rank = cost.lex_order((start, doc, rank))
    by_doc = cost.lex_order((start, doc))
    return SortedShards(len(arrays.bounds) - 1, tuple(c[by_rank] for c in cols),
                        tuple(c[by_doc] for c in cols))


def window_comm_volumes_of(arrays: cost.ShardArrays | SortedShards, window: int | None
                           ) -> cost.CommVolumes:
    """Per rank, the all-to-all-v receive and the compact all-gather send under ``window``
    (module docstring), from the shards or their ``sorted_shards`` (to sort once for
    several windows). O(s log s); O(s) given ``SortedShards``."""
    srt = arrays if isinstance(arrays, SortedShards) else sorted_shards(arrays)
    n = srt.n
    if len(srt.by_rank[0]) == 0:
        return cost.CommVolumes(alltoallv_recv=(0,) * n, allgather_send=(0,) * n)
    limit = np.iinfo(np.int64).max if window is None else window - 1
    # All-to-all-v: the rank's shards of a doc in start order, each adding the part of its
    # halo the rank's previous shard of the doc does not hold.
    r, d, s, e = srt.by_rank
    prev = np.zeros(len(r), dtype=np.int64)
    same = (r[1:] == r[:-1]) & (d[1:] == d[:-1])
    prev[1:] = np.where(same, e[:-1], 0)
    adds = np.minimum(limit, s - prev)
    recv = cost.per_rank_sums(adds, np.searchsorted(r, np.arange(n + 1), side="left"))
    # Compact all-gather: the doc's shards in start order, in runs of one rank; a shard's
    # nearest later shard on another rank opens the next run of the same doc.
    r, d, s, e = srt.by_doc
    head = np.ones(len(r), dtype=bool)
    head[1:] = (r[1:] != r[:-1]) | (d[1:] != d[:-1])
    run_first = np.flatnonzero(head)
    run = np.cumsum(head) - 1
    next_first = np.append(run_first[1:], len(r))[run]
    has_next = next_first < len(r)
    next_first = np.minimum(next_first, len(r) - 1)
    has_next &= d[next_first] == d
    if window is None:
        sent = np.where(has_next, e - s, 0)
    else:
        reach = np.maximum(s, s[next_first] - window + 1)
        sent = np.where(has_next, np.maximum(0, e - reach), 0)
    send = np.zeros(n, dtype=np.int64)
    np.add.at(send, r, sent)
    return cost.CommVolumes(alltoallv_recv=tuple(recv.tolist()),
                            allgather_send=tuple(send.tolist()))


class RingSchedule(NamedTuple):
    """Which ring steps bring a rank a key inside its windows."""

    useful: np.ndarray
    """bool (N, N): ``useful[i, k]`` for step k = 1 .. N - 1 (column 0, the local step,
    False)."""

    @property
    def steps_run(self) -> int:
        """Shifts a ring that stops after the group's last useful step runs."""
        steps = np.flatnonzero(self.useful.any(axis=0))
        return int(steps[-1]) if len(steps) else 0

    @property
    def useful_steps(self) -> tuple[int, ...]:
        """Per rank, the steps whose calls it runs."""
        return tuple(self.useful.sum(axis=1).tolist())


def ring_schedule_of(arrays: cost.ShardArrays, window: int | None) -> RingSchedule:
    """``RingSchedule`` of a group (module docstring). O(s log s + t) for t (shard, other
    holder of its doc) pairs: the pairs of ``step_time.runs.ring_seen`` (the other rank holds
    tokens of the doc below the shard's start), kept where the last of them ends inside
    the window; FieldError on ``comm_mode`` above ``step_time.runs.MAX_RING_PAIRS``."""
    n = len(arrays.bounds) - 1
    useful = np.zeros((n, n), dtype=bool)
    rank, doc, start, end = _nonempty(arrays)
    srt = sort_shards(rank, doc, start, end, n)
    seen = ring_seen(srt)
    if len(seen.shard) == 0:
        return RingSchedule(useful)
    shard, other = seen.shard, seen.other
    if window is not None:
        # The other run's last shard starting below the shard's start (shards disjoint:
        # it ends at or below it).
        stride = int((srt.start + srt.length).max()) + 1
        key = srt.run * stride + srt.start
        last = np.searchsorted(key, other * stride + srt.start[shard], side="left") - 1
        inside = srt.start[last] + srt.length[last] > srt.start[shard] - window + 1
        shard, other = shard[inside], other[inside]
    steps = (srt.rank[shard] - srt.rank[srt.run_first[other]]) % n
    useful[srt.rank[shard], steps] = True
    return RingSchedule(useful)


def recv_tokens(mode: str, volumes: cost.CommVolumes, tokens_per_rank: int,
                ring: RingSchedule | None = None) -> tuple[int, ...]:
    """Per-rank KV tokens received in ``mode`` for one windowed layer: as
    ``cost.recv_tokens_by_mode`` on the window's volumes, except ``p2p_ring`` with a
    ``ring`` schedule: ``steps_run`` shifts instead of N - 1."""
    if mode == "p2p_ring" and ring is not None:
        return (ring.steps_run * tokens_per_rank,) * len(volumes.alltoallv_recv)
    return cost.recv_tokens_by_mode(mode, volumes, tokens_per_rank)


class LayerFigures(NamedTuple):
    """The figures of one layer group of a mask (per rank, group rank order)."""

    window: int | None
    layers: int
    workload: tuple[int, ...]
    volumes: cost.CommVolumes
    recv: tuple[int, ...]
    """KV tokens each rank receives per layer in the mode asked for."""


class MaskFigures(NamedTuple):
    """A group's figures under a mask: per layer group, and layer-weighted."""

    layers: tuple[LayerFigures, ...]
    workload: tuple[int, ...]
    """Per rank, pairs summed over all layers: ``sum_g layers_g workload_g``."""
    recv: tuple[int, ...]
    """Per rank, KV tokens received summed over all layers."""
    comm_tokens: int
    """Each layer's exchange is its own collective: ``sum_g layers_g max_i recv_g[i]``."""

    @property
    def imbalance(self) -> float:
        """max / mean of the layer-weighted work."""
        return cost.imbalance(self.workload)


def layer_weighted(rows: Sequence[tuple[int, Sequence[int]]]) -> tuple[int, ...]:
    """Per rank, ``sum_g count_g values_g[i]`` of (count, per-rank values) rows, in exact
    integers. O(G N)."""
    return tuple(map(sum, zip(*[[count * v for v in values] for count, values in rows],
                              strict=True)))


def mask_figures_of(arrays: cost.ShardArrays, mask: AttentionMask, *, comm_mode: str,
                    tokens_per_rank: int, skip_ring_steps: bool = False,
                    causal: tuple[Sequence[int], cost.CommVolumes] | None = None
                    ) -> MaskFigures:
    """The group's work and exchange under ``mask`` in ``comm_mode`` (``skip_ring_steps``:
    a ``p2p_ring`` that runs only up to the last useful step in windowed layers; causal
    layers always run N - 1). ``causal``: the group's causal per-rank work and volumes
    where the caller has them (``cost``'s), taken for the causal layers. O(G (s log s + t))
    for G windows."""
    layers = []
    srt = sorted_shards(arrays)
    for group in mask.groups:
        if group.window is None and causal is not None:
            work, volumes = tuple(causal[0]), causal[1]
        else:
            work = tuple(rank_window_workloads_of(arrays, group.window))
            volumes = window_comm_volumes_of(srt, group.window)
        ring = ring_schedule_of(arrays, group.window) if (
            comm_mode == "p2p_ring" and skip_ring_steps and group.window is not None) else None
        layers.append(LayerFigures(group.window, group.layers, work, volumes,
                                   recv_tokens(comm_mode, volumes, tokens_per_rank, ring)))
    workload = layer_weighted([(f.layers, f.workload) for f in layers])
    recv = layer_weighted([(f.layers, f.recv) for f in layers])
    comm = sum(f.layers * max(f.recv, default=0) for f in layers)
    return MaskFigures(tuple(layers), workload, recv, comm)


def alltoallv_figures_of(arrays: cost.ShardArrays, mask: AttentionMask
                         ) -> tuple[tuple[int, ...], int]:
    """``mask_figures_of(arrays, mask, comm_mode="alltoallv", ...)``'s ``workload`` and
    ``comm_tokens`` alone, with one sort for all windows: a rank's shards of a doc in
    start order, each adds ``min(W - 1, s - e_prev)`` (module docstring). The shards need
    not be canonical (touching shards of a rank add nothing; empty ones are dropped).
    O(s log s + G s)."""
    n = len(arrays.bounds) - 1
    rank, doc, start, end = _nonempty(arrays)
    order = cost.lex_order((start, doc, rank))
    r, d, s, e = rank[order], doc[order], start[order], end[order]
    prev = np.zeros(len(r), dtype=np.int64)
    if len(r) > 1:
        same = (r[1:] == r[:-1]) & (d[1:] == d[:-1])
        prev[1:] = np.where(same, e[:-1], 0)
    gap = s - prev
    rank_bounds = np.searchsorted(r, np.arange(n + 1), side="left")
    workload = [0] * n
    comm = 0
    for group in mask.groups:
        adds = gap if group.window is None else np.minimum(gap, group.window - 1)
        comm += group.layers * int(cost.per_rank_sums(adds, rank_bounds).max(initial=0))
        work = rank_window_workloads_of(arrays, group.window)
        workload = [w + group.layers * x for w, x in zip(workload, work, strict=True)]
    return tuple(workload), comm


# The token-by-token references: sets of (doc, position) keys.


def reference_shard_workload(start: int, end: int, window: int | None) -> int:
    """Count, query by query, the keys k <= p inside the window (p - k < W)."""
    return sum(1 for p in range(start, end) for k in range(p + 1)
               if window is None or p - k < window)


def _needed(shards: Sequence[Shard], window: int | None) -> set[tuple[int, int]]:
    """Every (doc, key) some query of ``shards`` attends."""
    return {(doc, k) for doc, s, e in shards for p in range(s, e) for k in range(p + 1)
            if window is None or p - k < window}


def _held(shards: Sequence[Shard]) -> set[tuple[int, int]]:
    return {(doc, p) for doc, s, e in shards for p in range(s, e)}


def reference_comm_volumes(shards_per_rank: Sequence[Sequence[Shard]], window: int | None
                           ) -> cost.CommVolumes:
    """The receive and send volumes from key sets: a rank receives the keys it attends
    and does not hold; it sends the keys it holds that another rank attends."""
    needed = [_needed(shards, window) for shards in shards_per_rank]
    held = [_held(shards) for shards in shards_per_rank]
    recv = [len(need - own) for need, own in zip(needed, held, strict=True)]
    send = [len(own & set().union(*(needed[q] for q in range(len(held)) if q != r)))
            for r, own in enumerate(held)]
    return cost.CommVolumes(alltoallv_recv=tuple(recv), allgather_send=tuple(send))


def reference_ring_useful(shards_per_rank: Sequence[Sequence[Shard]], window: int | None
                          ) -> np.ndarray:
    """``RingSchedule.useful`` from key sets: step k is useful to rank i if rank i - k
    holds a key rank i attends."""
    n = len(shards_per_rank)
    needed = [_needed(shards, window) for shards in shards_per_rank]
    held = [_held(shards) for shards in shards_per_rank]
    useful = np.zeros((n, n), dtype=bool)
    for i in range(n):
        for k in range(1, n):
            useful[i, k] = bool(needed[i] & held[(i - k) % n])
    return useful
