"""The windowed ring (step_time/windowed_ring.py) against a token-by-token reference, its
group form, and the causal ring under a window past every position."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_cases import random_plan

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.model import ModelSpec
from planner_service.core.profiles import get_kernel_profile, get_link_profile
from planner_service.core.step_time import group_steps, rank_terms
from planner_service.core.step_time.blocks import shard_rows
from worker_runtime.kernels import build_masked_meta

KERNEL = get_kernel_profile("cpu-torch")
LINK = get_link_profile("nvlink")
MODEL = ModelSpec()


def counted(meta) -> tuple[int, int, int]:
    pairs = sum((q1 - q0) * sum(k1 - k0 for k0, k1 in keys) for q0, q1, keys in meta.blocks)
    return pairs, sum(len(keys) for _, _, keys in meta.blocks), len(meta.blocks)


def slow_work(own, blocks, window: int, last: int) -> tuple[int, int, int, int]:
    """(pairs, key blocks, query blocks, calls): queries picked token by token, blocks by
    the runtime's own metadata."""
    doc, pos = shard_rows(own)
    total = np.array(counted(build_masked_meta(doc, pos, doc, pos, window=window)) + (1,))
    for block in blocks[:last]:
        k_doc, k_pos = shard_rows(block)
        rows = [q for q in range(len(doc))
                if any(k_doc[j] == doc[q] and pos[q] - window < k_pos[j] <= pos[q]
                       for j in range(len(k_doc)))]
        if rows:
            meta = build_masked_meta(doc[rows], pos[rows], k_doc, k_pos, window=window)
            total += np.array(counted(meta) + (1,))
    return tuple(int(x) for x in total)


def test_per_rank_and_group_forms_against_the_reference_and_the_causal_ring() -> None:
    causal_checked = 0
    for seed in range(8):
        n = 2 + seed % 4
        plan = random_plan(seed, n)
        group = plan.groups[0]
        arrays = cost.shard_arrays(group.shards)
        tpr = plan.metrics.tokens_per_rank
        for window in (1, 3, 7, 10**6):
            sched = ww.ring_schedule_of(arrays, window)
            volumes = ww.window_comm_volumes_of(arrays, window)
            recv = ww.recv_tokens("p2p_ring", volumes, tpr, sched)
            kw = dict(tokens_per_rank=tpr, num_ranks=n, comm_mode="p2p_ring", model=MODEL,
                      kernel=KERNEL, link=LINK)
            g = group_steps(arrays, recv_tokens=np.asarray(recv), window=window, **kw)
            for i, shards in enumerate(group.shards):
                blocks = [group.shards[(i - s) % n] for s in range(1, n)]
                t = rank_terms(shards, recv_tokens=recv[i], window=window, ring_blocks=blocks, **kw)
                w = t.work
                assert (w.pairs, w.tiles, w.row_blocks, w.calls) == slow_work(
                    shards, blocks, window, sched.steps_run)
                assert t.passes == (3 * sched.steps_run if recv[i] else 0)
                for name in ("kernel_ms", "copy_ms", "comm_ms", "linear_ms"):
                    assert getattr(g, name)[i] == pytest.approx(float(getattr(t, name)),
                                                                rel=1e-9, abs=1e-12)
                if window == 10**6 and sched.steps_run == n - 1:
                    causal = rank_terms(shards, recv_tokens=(n - 1) * tpr, ring_blocks=blocks, **kw)
                    assert recv[i] == (n - 1) * tpr
                    assert t == causal
                    causal_checked += 1
    assert causal_checked > 0


def test_a_windowed_ring_too_large_to_price_is_refused_naming_comm_mode() -> None:
    from planner_service.core.errors import FieldError
    from planner_service.core.mask import AttentionMask
    from planner_service.core.request import PlanRequest
    from planner_service.solvers.registry import solve

    request = PlanRequest(doc_lengths=(131072,), cp_size=256, context_length=None,
                          strategy="llama3", comm_mode="p2p_ring", kernel="cpu-torch",
                          mask=AttentionMask.uniform(65536))
    with pytest.raises(FieldError, match="comm_mode: a windowed p2p_ring layer"):
        solve(request, check=False)
