"""The segment ring (flash-attn, ``p2p_ring``): its calls, their counts and its terms.

The per-rank reference (core/step_time/segment_ring.py) is checked against the document mask
by brute force and against hand-derived calls; the group form against the reference on
random groups; the terms against formulas written out by hand and ``group_steps``
against ``rank_step``.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from planner_service.core import cost
from planner_service.core.build import GroupLayout, Layout, build_plan
from planner_service.core.model import ModelSpec
from planner_service.core.paths import PATHS, RING_PATHS
from planner_service.core.plan import Shard
from planner_service.core.profiles import KERNEL_PROFILES, LINK_PROFILES
from planner_service.core.request import PlanRequest
from planner_service.core.step_time import (
    KernelWork,
    Rows,
    copy_ms,
    execution_path,
    forward_share,
    group_steps,
    held_kv_mode,
    kernel_ms,
    rank_step,
    rank_terms,
    ring_shift_ms,
    segment_merge_rows,
    segment_ring_rows,
)
from planner_service.core.step_time import segment_calls as sgw
from planner_service.core.step_time import segment_ring as srw
from planner_service.core.step_time.runs import sort_shards
from planner_service.solvers.registry import solve
from tests.test_step_time import random_group

MODEL = ModelSpec()
FA2, FA3, NVLINK = KERNEL_PROFILES["h100-fa2"], KERNEL_PROFILES["h100-fa3"], LINK_PROFILES["nvlink"]
TORCH = KERNEL_PROFILES["cpu-torch"]
MODES = ("full", "compact_allgather", "alltoallv", "p2p_ring")


def blocks_of(group, i):
    n = len(group)
    return [group[(i - s) % n] for s in range(1, n)]


def random_ring_group(rng: random.Random) -> list[list[Shard]]:
    """N 2..9, docs cut into up to 2N + 1 pieces on random ranks (several shards of a doc
    per rank), sometimes an empty rank."""
    n = rng.randint(2, 9)
    group = random_group(rng, n, rng.randint(1, 8), 500)
    if rng.random() < 0.3:
        group[rng.randrange(n)] = []
    return group


# -- paths ------------------------------------------------------------------------------------


def test_a_ring_plan_runs_as_a_segment_ring_on_the_segments_flash_path():
    assert "segment_ring" in PATHS and RING_PATHS == ("ring", "segment_ring")
    for kernel in (FA2, FA3):
        assert execution_path(kernel, "p2p_ring") == "segment_ring"
        assert execution_path(kernel, "p2p_ring", "segments") == "segment_ring"
        assert execution_path(kernel, "p2p_ring", "gathered") == "gathered"  # full all-gather
        assert [execution_path(kernel, m) for m in MODES[:3]] == ["segments"] * 3
    assert execution_path(TORCH, "p2p_ring") == "ring"
    # The KV a rank holds follows: the ring's own + two blocks on both kernels.
    for kernel in ("h100-fa2", "h100-fa3", "cpu-torch"):
        assert held_kv_mode(kernel, "p2p_ring") == "p2p_ring"
        assert [held_kv_mode(kernel, m) for m in MODES[:3]] == list(MODES[:3])


def test_a_ring_plans_kv_peak_under_flash_is_the_rings():
    lengths = (3000, 1200, 800, 600, 400)
    plan = solve(PlanRequest(doc_lengths=lengths, cp_size=4, strategy="zigzag", kernel="h100-fa3"))
    g = plan.groups[0]
    per_rank = max(x + p for x, p in zip(g.rank_stats.tokens, g.padding, strict=True))
    assert g.rank_stats.kv_tokens_peak == tuple(x + 2 * per_rank for x in g.rank_stats.tokens)
    volumes = cost.comm_volumes(g.shards)
    assert g.rank_stats.kv_tokens_peak == cost.kv_tokens_peak(
        "p2p_ring", volumes, list(g.rank_stats.tokens), per_rank)


# -- the calls ---------------------------------------------------------------------------------


def test_calls_written_out_with_a_hollow_and_a_zero_query_segment():
    # Rank A: doc 0 twice ([100, 200), [400, 500)), docs 1, 2, 3 once. Local buffer: group 0
    # = doc 0 S_1 (rows 0-100), doc 1 (100-150), doc 2 (150-180), doc 3 (180-210); group 1
    # = doc 0 S_2 (210-310). The block (rank B, (doc, start) order): doc 0 [0, 100) and
    # [200, 400) (rows 0-300), doc 1 [0, 50) (300-350), doc 2 [30, 60) (350-380), doc 3
    # [0, 60) (380-440).
    mine = [Shard(0, 100, 200), Shard(0, 400, 500), Shard(1, 50, 100), Shard(2, 0, 30),
            Shard(3, 60, 90)]
    block = [Shard(0, 0, 100), Shard(0, 200, 400), Shard(1, 0, 50), Shard(2, 30, 60),
             Shard(3, 0, 60)]
    (calls,) = srw.segment_ring_calls(mine, [block])
    assert calls == [
        # Group 0, class {doc 0}: S_1 sees the 100 tokens of doc 0 below 100.
        srw.RingSegmentCall(1, 0, 0, 0, (100,), (100,)),
        # Group 0, class {docs 1, 2, 3}: doc 1 sees 50 (rows 300-350), doc 2 none (hollow:
        # B's doc 2 starts at 30), doc 3 sees 60 (rows 380-440); rows 350-380 between them
        # are a zero-query segment.
        srw.RingSegmentCall(1, 0, 100, 300, (50, 30, 0, 30), (50, 0, 30, 60)),
        # Group 1: S_2 = [400, 500) sees doc 0's 300 tokens (rows 0-300).
        srw.RingSegmentCall(1, 1, 210, 0, (100,), (300,)),
    ]
    c = calls[1]
    assert (c.q_rows, c.key_rows, c.num_segments, c.hollow_rows) == (110, 140, 4, 30)
    # Tiles (128 x 64): 1 x 2; doc 1 1 x 1, doc 3 1 x 1 (hollow and zero-query: none);
    # 1 x 5. Query tiles 1 + 3 + 1.
    (work,) = srw.segment_ring_work(mine, [block], 128, 64)
    assert work == srw.RingStepCalls(sgw.Calls(9 * 128 * 64, 9, 6, 5, 3, 310, 540), 1, 110, 0, 1)
    # The group form, both ranks (B's doc 0 [200, 400) and doc 2 see A's rows below them).
    a = cost.shard_arrays([mine, block])
    got = srw.group_segment_ring_work(sort_shards(a.rank, a.doc, a.start, a.end, 2), 128, 64)
    assert (got.rank.tolist(), got.step.tolist()) == ([0, 1], [1, 1])
    (theirs,) = srw.segment_ring_work(block, [mine], 128, 64)
    for k, want in enumerate((work, theirs)):
        assert tuple(int(x[k]) for x in got.work.calls) == tuple(want.calls)
        assert tuple(int(x[k]) for x in got.work[1:]) == tuple(want[1:])


def _rows(shards):
    """(doc, position) of each row of ``shards`` in (doc, start) order."""
    return [(s.doc, p) for s in sorted(x for x in shards if x.end > x.start)
            for p in range(s.start, s.end)]


def _buffer_rows(shards):
    """(doc, position) of each local-buffer row: (piece j, shard count desc, doc, position)."""
    runs: dict[int, list[Shard]] = {}
    for s in sorted(x for x in shards if x.end > x.start):
        runs.setdefault(s.doc, []).append(s)
    docs = sorted(runs, key=lambda d: (-len(runs[d]), d))
    most = max((len(r) for r in runs.values()), default=0)
    return [(d, p) for j in range(most) for d in docs if len(runs[d]) > j
            for p in range(runs[d][j].start, runs[d][j].end)]


@pytest.mark.parametrize("seed", range(25))
def test_the_steps_calls_cover_the_remote_mask_exactly_once(seed):
    # Brute force on small groups: every (query row, key row of another rank) pair of the
    # document mask is in exactly one non-hollow segment of one step's call, and every
    # segment's pairs are in the mask (a full rectangle); zero-query segments and hollow
    # segments fill the call's contiguous key and query slices.
    rng = random.Random(seed)
    group = random_group(rng, rng.randint(2, 5), rng.randint(1, 5), 60)
    n = len(group)
    for i in range(n):
        queries = _buffer_rows(group[i])
        want = {(q, k) for q in queries for r in range(n) if r != i for k in _rows(group[r])
                if k[0] == q[0] and k[1] < q[1]}
        got = []
        for s, calls in enumerate(srw.segment_ring_calls(group[i], blocks_of(group, i)), start=1):
            keys = _rows(group[(i - s) % n])
            for c in calls:
                assert c.step == s
                qa, ka = c.q_lo, c.k_lo
                assert qa + c.q_rows <= len(queries) and ka + c.key_rows <= len(keys)
                for nq, nk in zip(c.queries, c.keys, strict=True):
                    assert nq or nk  # no empty segment
                    if nq and nk:
                        got += [(q, k) for q in queries[qa:qa + nq] for k in keys[ka:ka + nk]]
                    qa, ka = qa + nq, ka + nk
        assert len(got) == len(set(got)) and set(got) == want, i


@pytest.mark.parametrize("seed", range(60))
def test_group_segment_ring_work_equals_the_reference(seed):
    rng = random.Random(seed)
    group = random_ring_group(rng)
    n = len(group)
    tq, tk = rng.choice([(128, 64), (128, 128), (16, 24), (8, 8), (64, 128)])
    a = cost.shard_arrays(group)
    got = srw.group_segment_ring_work(sort_shards(a.rank, a.doc, a.start, a.end, n), tq, tk)
    assert list(zip(got.rank.tolist(), got.step.tolist(), strict=True)) == sorted(
        zip(got.rank.tolist(), got.step.tolist(), strict=True))
    entry = {(int(r), int(s)): k for k, (r, s) in enumerate(zip(got.rank, got.step, strict=True))}
    for i in range(n):
        want = srw.segment_ring_work(group[i], blocks_of(group, i), tq, tk)
        for s in range(1, n):
            k = entry.get((i, s))
            if k is None:
                assert want[s - 1].steps == 0 and want[s - 1].calls.calls == 0, (i, s)
                continue
            assert tuple(int(x[k]) for x in got.work.calls) == tuple(want[s - 1].calls), (i, s)
            assert tuple(int(x[k]) for x in got.work[1:]) == tuple(want[s - 1][1:]), (i, s)


def test_the_group_form_is_refused_above_the_ring_cap(monkeypatch):
    group = [[Shard(0, 8 * i, 8 * i + 8), Shard(1, 8 * i, 8 * i + 8)] for i in range(4)]
    a = cost.shard_arrays(group)
    s = sort_shards(a.rank, a.doc, a.start, a.end, 4)
    monkeypatch.setattr("planner_service.core.step_time.runs.MAX_RING_PAIRS", 23)
    with pytest.raises(ValueError, match="comm_mode: .* at most 23 .* this group has 24"):
        srw.group_segment_ring_work(s, 128, 64)


# -- the terms ---------------------------------------------------------------------------------


def test_segment_ring_terms_written_out():
    # One doc of 2048 over 2 ranks, a ring plan: rank 1 holds [1024, 2048) and at step 1
    # sees rank 0's whole block: one call, 1024 queries x 1024 keys, one segment.
    group = [[Shard(0, 0, 1024)], [Shard(0, 1024, 2048)]]
    t, n = 1024, 2
    slow = dataclasses.replace(NVLINK, bandwidth_gbps=5.0)  # the shifts outlast the calls
    kw = dict(recv_tokens=t, tokens_per_rank=t, num_ranks=n, comm_mode="p2p_ring", model=MODEL,
              kernel=FA2, link=slow)
    assert srw.segment_ring_calls(group[1], [group[0]]) == [
        [srw.RingSegmentCall(1, 0, 0, 0, (1024,), (1024,))]]
    assert srw.segment_ring_calls(group[0], [group[1]]) == [[]]  # rank 0 sees nothing
    terms = rank_terms(group[1], ring_blocks=[group[0]], **kw)
    # Kernel (128 x 64 tiles): the local causal 1024 square reads 2 + 4 + ... + 16 = 72
    # tiles; the step's call 8 x 16 = 128.
    local = KernelWork(72 * 128 * 64, 72, 1, 8, 1)
    step = KernelWork(128 * 128 * 64, 128, 1, 8, 1)
    assert terms.work == KernelWork(200 * 128 * 64, 200, 2, 16, 2)
    k_loc, k_1 = kernel_ms(local, MODEL, FA2), kernel_ms(step, MODEL, FA2)
    assert terms.kernel_ms == pytest.approx(k_loc + k_1)
    # Copies (r = T = 1024, in place, N = 2). Forward: accumulators zeroed and the first
    # part (2r each kind, 4 ops), the step's merge (4 and 6 per row, 10 ops), output zero
    # fill and cast (T + r, 2 ops). Backward: local dK/dV zeroed (r), the local call's adds
    # (dQ 1024, dK/dV 1024; its lse is the whole accumulator), dQ/dK/dV back (T + r each
    # of q and kv, 6 ops), dQ zeroed (r), the step call's dQ add (1024) and dK/dV adds
    # (1024 key rows), the accumulators: first zeros and final add (2T) and the step's
    # part added (T).
    want = (Rows(0, 0, 0, 4, 0, 2048, 2048) + Rows(0, 0, 0, 10, 0, 4096, 6144)
            + Rows(0, 2048, 0, 2) + Rows(2048, 2048, 0, 2 + 4 - 1 + 6, 2048, 1024, 0)
            + Rows(3072, 0, 0, 1 + 4 - 1 + 4 + 2, 1024, 2048, 0))
    assert terms.rows == want
    assert terms.copy_ms == pytest.approx(copy_ms(want.bytes(MODEL), FA2, want.ops))
    # Comm: 3 (N - 1) shifts of T rows; overlap on: shift 0 behind phi x the local call,
    # backward's shift 0 behind (1 - phi) x it, the last accumulator after the loop; no
    # middle step (N - 2 = 0).
    shift = ring_shift_ms(t, MODEL, slow)
    phi = forward_share(FA2)
    assert shift > k_loc
    assert (terms.passes, terms.transfer_ms) == (3, pytest.approx(3 * shift))
    assert terms.comm_ms == pytest.approx((shift - phi * k_loc) + (shift - (1 - phi) * k_loc) + shift)
    off = rank_step(group[1], ring_blocks=[group[0]], overlap=False, **kw)
    assert off.comm_ms == pytest.approx(3 * shift) and off.comm_ms > terms.comm_ms
    # Rank 0: the local call only; the same shifts.
    first = rank_terms(group[0], ring_blocks=[group[1]], **kw)
    assert first.work == local and first.comm_ms == pytest.approx(terms.comm_ms)


def test_segment_ring_middle_steps_hide_shifts_behind_their_calls():
    # One doc of 4 x 512 over 4 ranks, rank 3 sees every block: its steps 1 and 2 hide the
    # next shift behind phi x their call + their merge; steps 2 and 3 the previous step's
    # accumulator behind (1 - phi) x their call.
    group = [[Shard(0, 512 * i, 512 * (i + 1))] for i in range(4)]
    n, t = 4, 512
    blocks = blocks_of(group, 3)
    kw = dict(recv_tokens=(n - 1) * t, tokens_per_rank=t, num_ranks=n, comm_mode="p2p_ring",
              model=MODEL, kernel=FA3, link=NVLINK, ring_blocks=blocks)
    terms = rank_terms(group[3], **kw)
    shift, phi = ring_shift_ms(t, MODEL, NVLINK), forward_share(FA3)
    local = sgw.segment_work(group[3], FA3.tile_q, FA3.tile_k).local
    k_loc = kernel_ms(KernelWork(local.pairs, local.tiles, local.segments, local.row_blocks,
                                 local.calls), MODEL, FA3)
    steps = srw.segment_ring_work(group[3], blocks, FA3.tile_q, FA3.tile_k)
    assert [st.calls.calls for st in steps] == [1, 1, 1]
    fwd, bwd = max(0.0, shift - phi * k_loc), max(0.0, shift - (1 - phi) * k_loc) + shift
    for s, st in enumerate(steps, start=1):
        c = st.calls
        k_s = kernel_ms(KernelWork(c.pairs, c.tiles, c.segments, c.row_blocks, c.calls), MODEL, FA3)
        if s <= n - 2:
            m = segment_merge_rows(c.calls, c.queries, st.hollow_calls, st.masked_rows)
            fwd += max(0.0, shift - (phi * k_s + copy_ms(m.bytes(MODEL), FA3, m.ops)))
        if s >= 2:
            bwd += max(0.0, shift - (1 - phi) * k_s)
    assert terms.comm_ms == pytest.approx(fwd + bwd)
    assert terms.rows == segment_ring_rows(tokens_per_rank=t, real=t,
                                           work=sgw.segment_work(group[3], FA3.tile_q, FA3.tile_k),
                                           ring=srw.summed(steps), num_ranks=n)


@pytest.mark.parametrize("seed", range(40))
def test_group_steps_equal_rank_step_on_the_segment_ring(seed):
    rng = random.Random(seed)
    group = random_ring_group(rng)
    n = len(group)
    kernel = dataclasses.replace(rng.choice([FA2, FA3]), tile_q=rng.choice([16, 128]),
                                 tile_k=rng.choice([16, 24, 64]))
    link = rng.choice([NVLINK, dataclasses.replace(NVLINK, bandwidth_gbps=2.0)])
    overlap = rng.random() < 0.7
    tokens = max(sum(s.end - s.start for s in rank) for rank in group) + rng.randint(0, 9)
    recv = cost.recv_tokens_by_mode("p2p_ring", cost.comm_volumes(group), tokens)
    kw = dict(tokens_per_rank=tokens, num_ranks=n, comm_mode="p2p_ring", model=MODEL,
              kernel=kernel, link=link, overlap=overlap)
    got = group_steps(cost.shard_arrays(group), recv_tokens=np.array(recv), **kw)
    want = [rank_step(group[i], recv_tokens=recv[i], ring_blocks=blocks_of(group, i), **kw)
            for i in range(n)]
    for field in ("kernel_ms", "copy_ms", "comm_ms", "linear_ms", "total_ms"):
        np.testing.assert_allclose(getattr(got, field), [getattr(w, field) for w in want],
                                   rtol=1e-9, atol=0, err_msg=field)


def test_a_ring_plans_metrics_under_flash_are_the_segment_rings():
    lengths = [700, 300, 1200, 64]
    shards = [[Shard(0, 0, 350), Shard(2, 0, 200), Shard(2, 1000, 1200)],
              [Shard(0, 350, 700), Shard(2, 200, 500), Shard(3, 0, 64)],
              [Shard(1, 0, 300), Shard(2, 500, 1000)]]
    plan = build_plan(Layout([GroupLayout((0, 1, 2), shards)], {}), strategy="t", cp_size=3,
                      doc_lengths=lengths, context_length=None, comm_mode="p2p_ring", model=MODEL,
                      kernel="h100-fa2", link="nvlink")
    tokens = plan.metrics.tokens_per_rank
    steps = [rank_step(shards[i], recv_tokens=2 * tokens, tokens_per_rank=tokens, num_ranks=3,
                       comm_mode="p2p_ring", model=MODEL, kernel=FA2, link=NVLINK,
                       ring_blocks=blocks_of(shards, i)) for i in range(3)]
    assert plan.metrics.est_step_ms == pytest.approx(max(s.total_ms for s in steps))
    gathered = rank_step(shards[2], recv_tokens=2 * tokens, tokens_per_rank=tokens, num_ranks=3,
                         comm_mode="p2p_ring", model=MODEL, kernel=FA2, link=NVLINK,
                         flash_path="gathered")
    assert gathered != steps[2]  # the gathered flash path still runs it as the full all-gather
