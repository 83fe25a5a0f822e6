"""Metrics of a group and of a plan, computed only from shards (so the validator can
recompute and compare every reported figure).

Under a mask that is not causal in every layer (core/mask.py), the work and exchange
figures are those of the whole model (core/window_work.py ``mask_figures_of``):
``imbalance``, ``max_workload`` and ``mean_workload`` of the layer-weighted work
``sum_g count_g work_g``; ``comm_tokens``, ``full_comm_tokens``, ``alltoallv_tokens``,
``compact_allgather_tokens`` and ``comm_bytes`` summed over the layers (each layer's
exchange is its own collective: ``sum_g count_g max_i recv_g[i]``; ``p2p_ring`` in a window's layers
``steps_run`` blocks, the steps the runtime's rings run, ``window_work.RingSchedule``),
the savings their ratios; ``rank_stats.workload``, ``alltoallv_recv`` and ``allgather_send`` the
layer-weighted sums per rank, ``kv_tokens_peak`` the largest over the windows. A
``layers`` list holds the figures of one layer of each window (``LayerMetrics``,
``RankLayerStats``). The step-time estimates (``est_*``) stay per layer: the
layer-weighted mean ``sum_g (count_g / L) est_g`` over the mask's groups, ``est_g`` the
figures of the slowest rank of one layer of window g (step_time ``group_steps`` with
``window``, each rank receiving that window's exchange), so L times ``est_step_ms`` is
the model's time over all L layers (every path prices a windowed layer: the PyTorch
kernel's ring its windowed steps 1 .. ``steps_run``, step_time/windowed_ring.py). A causal mask gives exactly the causal figures, with no
``layers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.mask import CAUSAL, AttentionMask
from planner_service.core.model import ModelSpec
from planner_service.core.plan import LayerMetrics, Metrics, RankLayerStats, RankStats, Shard
from planner_service.core.profiles import get_kernel_profile, get_link_profile
from planner_service.core.step_time import (
    attention_tiles_per_shard,
    group_steps,
    held_kv_mode,
    rank_step,
)


def group_metrics(
    shards_per_rank: Sequence[Sequence[Shard]],
    padding: Sequence[int],
    *,
    comm_mode: str,
    model: ModelSpec,
    kernel: str,
    link: str,
    mask: AttentionMask = CAUSAL,
) -> tuple[Metrics, RankStats]:
    """Metrics and per-rank stats of one group (ranks in group order) under ``mask``."""
    return group_metrics_of(
        cost.shard_arrays(shards_per_rank), shards_per_rank, padding,
        comm_mode=comm_mode, model=model, kernel=kernel, link=link, mask=mask,
    )


def group_metrics_of(
    arrays: cost.ShardArrays | None,
    shards_per_rank: Sequence[Sequence[Shard]],
    padding: Sequence[int],
    *,
    comm_mode: str,
    model: ModelSpec,
    kernel: str,
    link: str,
    mask: AttentionMask = CAUSAL,
) -> tuple[Metrics, RankStats]:
    """``group_metrics`` given the shards also as ``cost.ShardArrays`` (None: not
    representable in int64, computed shard by shard and ``rank_step`` rank by rank).
    O(s log s) for s shards in numpy, plus ``group_steps`` (O(shards + tiles) for the
    flash-attn profiles; no loop over ranks); under a mask, O(G s log s) more for G
    windows (``window_work.mask_figures_of``)."""
    n = len(shards_per_rank)
    kernel_profile, link_profile = get_kernel_profile(kernel), get_link_profile(link)
    counts = np.fromiter(map(len, shards_per_rank), dtype=np.int64, count=n)
    per_shard: np.ndarray | None
    if arrays is None:
        tokens = [sum(s.end - s.start for s in rank) for rank in shards_per_rank]
        workloads = cost.rank_workloads(shards_per_rank)
        volumes = cost.comm_volumes(shards_per_rank)
        flat = [s for rank in shards_per_rank for s in rank]
        per_shard = attention_tiles_per_shard(flat, kernel_profile.tile_q, kernel_profile.tile_k)
        doc_ranks: dict[int, set[int]] = {}
        for rank, shards in enumerate(shards_per_rank):
            for s in shards:
                doc_ranks.setdefault(s.doc, set()).add(rank)
        split_docs = sum(1 for ranks in doc_ranks.values() if len(ranks) > 1)
        bounds = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=bounds[1:])
    else:
        lengths = arrays.end - arrays.start
        tokens = cost.per_rank_sums(lengths, arrays.bounds).tolist()
        workloads = cost.rank_workloads_of(arrays)
        volumes, _, split_docs = cost.comm_volumes_of(arrays)
        per_shard = None  # group_steps counts the segment tiles where its path runs them
        bounds = arrays.bounds
    tokens_per_rank = max(t + p for t, p in zip(tokens, padding, strict=True))
    full = cost.full_exchange_tokens(n, tokens_per_rank)
    recv = cost.recv_tokens_by_mode(comm_mode, volumes, tokens_per_rank)
    tiles = None if per_shard is None else cost.per_rank_sums(per_shard, bounds)
    if arrays is None:
        steps = [
            rank_step(
                shards_per_rank[i],
                recv_tokens=recv[i],
                tokens_per_rank=tokens_per_rank,
                num_ranks=n,
                comm_mode=comm_mode,
                model=model,
                kernel=kernel_profile,
                link=link_profile,
                tiles=None if tiles is None else int(tiles[i]),
                ring_blocks=[shards_per_rank[(i - s) % n] for s in range(1, n)],
            )
            for i in range(n)
        ]
        totals = [s.total_ms for s in steps]
        slowest = max(range(n), key=lambda i: (totals[i], -i))
        step = steps[slowest]
        est = (step.total_ms, step.attn_ms, step.comm_ms, step.linear_ms)
    else:
        group = group_steps(arrays, recv_tokens=np.asarray(recv, dtype=np.int64),
                            tokens_per_rank=tokens_per_rank, num_ranks=n, comm_mode=comm_mode,
                            model=model, kernel=kernel_profile, link=link_profile, tiles=tiles)
        slowest = int(np.argmax(group.total_ms))  # the first of equal maxima: lowest index
        est = (float(group.total_ms[slowest]), float(group.attn_ms[slowest]),
               float(group.comm_ms[slowest]), float(group.linear_ms[slowest]))
    comm_tokens = max(recv)
    metrics = Metrics(
        imbalance=cost.imbalance(workloads),
        max_workload=max(workloads),
        mean_workload=sum(workloads) / n,
        comm_mode=comm_mode,
        comm_tokens=comm_tokens,
        full_comm_tokens=full,
        compact_allgather_tokens=volumes.compact_allgather_tokens,
        alltoallv_tokens=volumes.alltoallv_tokens,
        comm_saving=cost.saving(comm_tokens, full),
        comm_saving_allgather=cost.saving(volumes.compact_allgather_tokens, full),
        comm_saving_alltoallv=cost.saving(volumes.alltoallv_tokens, full),
        comm_bytes=comm_tokens * model.kv_bytes_per_token,
        full_comm_bytes=full * model.kv_bytes_per_token,
        est_step_ms=est[0],
        est_attn_ms=est[1],
        est_comm_ms=est[2],
        est_linear_ms=est[3],
        tokens_per_rank=tokens_per_rank,
        padding_tokens=sum(padding),
        num_shards=sum(len(rank) for rank in shards_per_rank),
        num_split_docs=split_docs,
    )
    stats = RankStats(
        tokens=tuple(tokens),
        workload=tuple(workloads),
        alltoallv_recv=volumes.alltoallv_recv,
        allgather_send=volumes.allgather_send,
        kv_tokens_peak=cost.kv_tokens_peak(held_kv_mode(kernel, comm_mode), volumes, tokens,
                                            tokens_per_rank),
    )
    if mask.is_causal:
        return metrics, stats
    return masked_metrics(metrics, stats, shards_per_rank, arrays, mask=mask,
                          comm_mode=comm_mode, model=model, kernel=kernel, link=link)


def masked_metrics(
    metrics: Metrics, stats: RankStats, shards_per_rank: Sequence[Sequence[Shard]],
    arrays: cost.ShardArrays | None, *, mask: AttentionMask, comm_mode: str,
    model: ModelSpec, kernel: str, link: str,
) -> tuple[Metrics, RankStats]:
    """A group's causal ``metrics`` and ``stats`` turned into those under ``mask`` (module
    docstring). O(G (s log s + tiles)) for G windows and s shards."""
    if arrays is None:
        arrays = int_arrays(shards_per_rank)
    tokens_per_rank = metrics.tokens_per_rank
    # The runtime's rings (and a ring plan's gathered form on flash kernels) stop after
    # the window's last useful step: steps_run blocks, not N - 1.
    figures = ww.mask_figures_of(
        arrays, mask, comm_mode=comm_mode, tokens_per_rank=tokens_per_rank,
        skip_ring_steps=True,
        causal=(stats.workload, cost.CommVolumes(stats.alltoallv_recv, stats.allgather_send)))
    n = len(shards_per_rank)
    held = held_kv_mode(kernel, comm_mode)
    layers, rank_layers = [], []
    for f in figures.layers:
        work = f.workload
        layers.append(LayerMetrics(
            window=f.window, count=f.layers, imbalance=cost.imbalance(work),
            max_workload=max(work), mean_workload=sum(work) / n,
            comm_tokens=max(f.recv), alltoallv_tokens=f.volumes.alltoallv_tokens,
            compact_allgather_tokens=f.volumes.compact_allgather_tokens))
        rank_layers.append(RankLayerStats(
            window=f.window, workload=work, alltoallv_recv=f.volumes.alltoallv_recv,
            allgather_send=f.volumes.allgather_send,
            kv_tokens_peak=cost.kv_tokens_peak(held, f.volumes, stats.tokens,
                                               tokens_per_rank)))
    count = mask.num_layers
    full = count * metrics.full_comm_tokens
    alltoallv = sum(layer.count * layer.alltoallv_tokens for layer in layers)
    allgather = sum(layer.count * layer.compact_allgather_tokens for layer in layers)
    workload = figures.workload
    est = weighted_estimates(metrics, figures, arrays, mask=mask, comm_mode=comm_mode,
                             model=model, kernel=kernel, link=link)
    masked = replace(
        metrics,
        est_step_ms=est[0],
        est_attn_ms=est[1],
        est_comm_ms=est[2],
        est_linear_ms=est[3],
        imbalance=cost.imbalance(workload),
        max_workload=max(workload),
        mean_workload=sum(workload) / n,
        comm_tokens=figures.comm_tokens,
        full_comm_tokens=full,
        compact_allgather_tokens=allgather,
        alltoallv_tokens=alltoallv,
        comm_saving=cost.saving(figures.comm_tokens, full),
        comm_saving_allgather=cost.saving(allgather, full),
        comm_saving_alltoallv=cost.saving(alltoallv, full),
        comm_bytes=figures.comm_tokens * model.kv_bytes_per_token,
        full_comm_bytes=full * model.kv_bytes_per_token,
        layers=tuple(layers),
    )
    weighted_recv = ww.layer_weighted([(layer.layers, r.alltoallv_recv)
                                       for layer, r in zip(mask.groups, rank_layers, strict=True)])
    weighted_send = ww.layer_weighted([(layer.layers, r.allgather_send)
                                       for layer, r in zip(mask.groups, rank_layers, strict=True)])
    masked_stats = replace(
        stats,
        workload=workload,
        alltoallv_recv=weighted_recv,
        allgather_send=weighted_send,
        kv_tokens_peak=tuple(map(max, zip(*[r.kv_tokens_peak for r in rank_layers], strict=True))),
        layers=tuple(rank_layers),
    )
    return masked, masked_stats


def window_estimate(arrays: cost.ShardArrays, recv: Sequence[int], window: int, *,
                    tokens_per_rank: int, comm_mode: str, model: ModelSpec, kernel: str,
                    link: str) -> tuple[float, float, float, float]:
    """(step, attention, comm, linear) ms of the slowest rank (the first of equal maxima) of
    one layer of ``window``, each rank receiving ``recv``. O(shards + tiles)."""
    group = group_steps(arrays, recv_tokens=np.asarray(recv, dtype=np.int64),
                        tokens_per_rank=tokens_per_rank, num_ranks=len(arrays.bounds) - 1,
                        comm_mode=comm_mode, model=model, kernel=get_kernel_profile(kernel),
                        link=get_link_profile(link), window=window)
    slowest = int(np.argmax(group.total_ms))
    return (float(group.total_ms[slowest]), float(group.attn_ms[slowest]),
            float(group.comm_ms[slowest]), float(group.linear_ms[slowest]))


def weighted_estimates(metrics: Metrics, figures: ww.MaskFigures, arrays: cost.ShardArrays, *,
                       mask: AttentionMask, comm_mode: str, model: ModelSpec, kernel: str,
                       link: str) -> tuple[float, ...]:
    """The layer-weighted (step, attention, comm, linear) ms per layer (module docstring):
    the causal group's from ``metrics``; a window's from :func:`window_estimate`.
    O(G (shards + tiles)) (the PyTorch kernel's ring: windowed_ring.py's bound)."""
    causal = (metrics.est_step_ms, metrics.est_attn_ms, metrics.est_comm_ms,
              metrics.est_linear_ms)
    total = [0.0, 0.0, 0.0, 0.0]
    for weight, f in zip(mask.weights(), figures.layers, strict=True):
        est = causal if f.window is None else window_estimate(
            arrays, f.recv, f.window, tokens_per_rank=metrics.tokens_per_rank,
            comm_mode=comm_mode, model=model, kernel=kernel, link=link)
        for j in range(4):
            total[j] += weight * est[j]
    return tuple(total)


def int_arrays(shards_per_rank: Sequence[Sequence[Shard]]) -> cost.ShardArrays:
    """The shards as ``ShardArrays`` without the int64 workload guard (window_work's
    figures of one layer stay below 2^62: at most 2^31 tokens, each attending fewer keys);
    rank by rank, in order."""
    counts = [len(rank) for rank in shards_per_rank]
    flat = [s for rank in shards_per_rank for s in rank]
    bounds = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    return cost.ShardArrays(
        np.repeat(np.arange(len(counts), dtype=np.int64), counts),
        np.array([s.doc for s in flat], dtype=np.int64),
        np.array([s.start for s in flat], dtype=np.int64),
        np.array([s.end for s in flat], dtype=np.int64), bounds)


def plan_metrics(groups: Sequence[tuple[Metrics, RankStats]], comm_mode: str) -> Metrics:
    """Aggregate group metrics: balance over all grouped ranks, the rest from the worst group.

    A single-group plan's metrics equal its group's. Under a mask, each window's
    ``layers`` entry likewise: balance over all ranks, the exchange of the worst group.
    """
    if len(groups) == 1:
        return groups[0][0]
    layers = None
    if groups[0][1].layers is not None:
        layers = []
        for j, first in enumerate(groups[0][0].layers or ()):
            work = [w for _, stats in groups for w in (stats.layers or ())[j].workload]
            layers.append(replace(
                first, imbalance=cost.imbalance(work), max_workload=max(work),
                mean_workload=sum(work) / len(work),
                comm_tokens=max((m.layers or ())[j].comm_tokens for m, _ in groups),
                alltoallv_tokens=max((m.layers or ())[j].alltoallv_tokens for m, _ in groups),
                compact_allgather_tokens=max((m.layers or ())[j].compact_allgather_tokens
                                             for m, _ in groups)))
    workloads = [w for _, stats in groups for w in stats.workload]
    slowest = max(groups, key=lambda g: g[0].est_step_ms)[0]
    comm_tokens = max(m.comm_tokens for m, _ in groups)
    full = max(m.full_comm_tokens for m, _ in groups)
    allgather = max(m.compact_allgather_tokens for m, _ in groups)
    alltoallv = max(m.alltoallv_tokens for m, _ in groups)
    return Metrics(
        imbalance=cost.imbalance(workloads),
        max_workload=max(workloads),
        mean_workload=sum(workloads) / len(workloads),
        comm_mode=comm_mode,
        comm_tokens=comm_tokens,
        full_comm_tokens=full,
        compact_allgather_tokens=allgather,
        alltoallv_tokens=alltoallv,
        comm_saving=cost.saving(comm_tokens, full),
        comm_saving_allgather=cost.saving(allgather, full),
        comm_saving_alltoallv=cost.saving(alltoallv, full),
        comm_bytes=max(m.comm_bytes for m, _ in groups),
        full_comm_bytes=max(m.full_comm_bytes for m, _ in groups),
        est_step_ms=slowest.est_step_ms,
        est_attn_ms=slowest.est_attn_ms,
        est_comm_ms=slowest.est_comm_ms,
        est_linear_ms=slowest.est_linear_ms,
        tokens_per_rank=max(m.tokens_per_rank for m, _ in groups),
        padding_tokens=sum(m.padding_tokens for m, _ in groups),
        num_shards=sum(m.num_shards for m, _ in groups),
        num_split_docs=sum(m.num_split_docs for m, _ in groups),
        layers=None if layers is None else tuple(layers),
    )
