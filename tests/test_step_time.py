"""The step-time model describes what the runtime runs, and its profile follows the kernel.

The PyTorch kernel's blocks (core/step_time/blocks.py) are checked against the runtime's own
metadata, the vectorised group forms against the rank-by-rank references, and the overlap
and ring terms against their formulas written out by hand.
"""

from __future__ import annotations

import dataclasses
import inspect
import random

import numpy as np
import pytest

from planner_service.core import cost, profiles
from planner_service.core.build import GroupLayout, Layout, build_plan, canonical_shards
from planner_service.core.metrics import group_metrics
from planner_service.core.model import ModelSpec
from planner_service.core.paths import FLASH_PATHS, RUNTIME_FLASH_PATH
from planner_service.core.plan import Shard
from planner_service.core.profiles import (
    KERNEL_PROFILES,
    LINK_PROFILES,
    default_kernel_profile,
    kernel_profile_from_dict,
)
from planner_service.core.request import PlanRequest
from planner_service.core.seeing import rows_seeing
from planner_service.core.step_time import (
    RUNTIME_OVERLAP,
    KernelWork,
    Rows,
    attention_tiles_of,
    copy_ms,
    execution_path,
    forward_share,
    group_steps,
    kernel_ms,
    key_rows,
    lean_window_rows,
    merge_rows,
    plan_rank_terms,
    rank_step,
    rank_terms,
    ring_shift_ms,
    transfer_ms,
)
from planner_service.core.step_time import segment_calls as sgw
from planner_service.core.step_time.blocks import NO_BLOCKS
from planner_service.core.step_time.lean import group_lean_work, lean_work
from planner_service.core.step_time.ring import group_ring_work, ring_step_work
from planner_service.core.step_time.runs import ring_pairs, sort_shards
from planner_service.solvers.registry import solve
from worker_runtime import ContextParallelAttention, build_comm_map, build_layout
from worker_runtime.attention import FLASH_PATHS as RUNTIME_FLASH_PATHS
from worker_runtime.kernels import BLOCK_K, BLOCK_Q, build_masked_meta
from worker_runtime.paths.lean import remote_query_rows
from worker_runtime.paths.pieces import build_segment_plan
from worker_runtime.paths.ring_steps import slot_rows

MODEL = ModelSpec()
CPU_MODEL = ModelSpec(num_heads=4, num_kv_heads=2, head_dim=32, dtype_bytes=4, hidden_size=128,
                      ffn_hidden_size=256)
FA2, NVLINK = KERNEL_PROFILES["h100-fa2"], LINK_PROFILES["nvlink"]
TORCH, GLOO = KERNEL_PROFILES["cpu-torch"], LINK_PROFILES["gloo-local"]
MODES = ("full", "compact_allgather", "alltoallv", "p2p_ring")


def step(shards, *, recv=0, tokens=None, n=2, mode="full", kernel=FA2, overlap=True,
         flash_path=RUNTIME_FLASH_PATH):
    tokens = tokens if tokens is not None else sum(s.end - s.start for s in shards)
    return rank_step(shards, recv_tokens=recv, tokens_per_rank=tokens, num_ranks=n, comm_mode=mode,
                     model=MODEL, kernel=kernel, link=NVLINK, overlap=overlap,
                     flash_path=flash_path)


def random_group(rng: random.Random, n: int, docs: int, longest: int) -> list[list[Shard]]:
    """Docs cut at random points, pieces on random ranks, canonical per rank (as plans)."""
    per: list[list[Shard]] = [[] for _ in range(n)]
    for d in range(docs):
        length = rng.randint(1, longest)
        cuts = sorted(rng.sample(range(1, length), min(length - 1, rng.randint(0, 2 * n))))
        bounds = [0, *cuts, length]
        for a, b in zip(bounds, bounds[1:], strict=False):
            per[rng.randrange(n)].append(Shard(d, a, b))
    return [list(canonical_shards(rank)) for rank in per]


# -- paths ----------------------------------------------------------------------------------


def test_the_path_follows_the_kernel_as_the_runtime_chooses():
    assert [execution_path(FA2, m) for m in MODES] == ["segments"] * 3 + ["segment_ring"]
    assert {m: execution_path(FA2, m, "gathered") for m in MODES} == dict.fromkeys(MODES, "gathered")
    for flash_path in FLASH_PATHS:
        assert [execution_path(TORCH, m, flash_path) for m in MODES] == ["lean", "lean", "lean", "ring"]
    with pytest.raises(ValueError, match="flash_path must be one of segments, gathered"):
        execution_path(FA2, "full", "ring")


def test_model_defaults_are_the_runtimes():
    params = inspect.signature(ContextParallelAttention).parameters
    assert RUNTIME_OVERLAP is params["overlap"].default is True
    assert RUNTIME_FLASH_PATH == params["flash_path"].default == "segments"
    assert FLASH_PATHS == RUNTIME_FLASH_PATHS
    # The PyTorch kernel's profile counts the runtime's block pairs.
    assert (TORCH.tile_q, TORCH.tile_k) == (BLOCK_Q, BLOCK_K)


# -- the PyTorch kernel's blocks against the runtime's metadata --------------------------------


def _meta_counts(meta):
    pairs = sum((q1 - q0) * (keys[-1][1] - keys[0][0]) for q0, q1, keys in meta.blocks if keys)
    return pairs, sum(len(keys) for _, _, keys in meta.blocks), len(meta.blocks)


@pytest.mark.parametrize("strategy", ["flashcp", "per_doc", "llama3", "zigzag", "ring", "fcp"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_lean_and_ring_blocks_equal_the_runtime_metadata(strategy, n):
    bq, bk = 16, 64
    plan = solve(PlanRequest(doc_lengths=(300, 41, 700, 5, 129, 64), cp_size=n, strategy=strategy,
                             kernel="cpu-torch", link="gloo-local"))
    for rank in range(n):
        lay = build_layout(plan, rank)
        if lay.group_index < 0:
            continue
        comm = build_comm_map(lay, "alltoallv")
        r = lay.num_real
        doc, pos = lay.doc_ids[:r], lay.positions[:r]
        rows = remote_query_rows(lay, comm)
        lean = lean_work(lay.shards, bq, bk)
        assert lean.local[:3] == _meta_counts(build_masked_meta(doc, pos, doc, pos, block_q=bq, block_k=bk))
        remote = build_masked_meta(doc[rows], pos[rows], comm.remote_doc, comm.remote_pos,
                                   block_q=bq, block_k=bk)
        assert lean.remote[:3] == _meta_counts(remote)
        assert (lean.remote.queries, lean.remote_keys) == (len(rows), len(comm.remote_index))
        group = plan.groups[lay.group_index]
        for s in range(1, lay.num_ranks):
            slot = (lay.slot - s) % lay.num_ranks
            key_doc, key_pos = slot_rows(lay, slot)
            seen = rows_seeing(doc, pos, key_doc, key_pos)
            meta = build_masked_meta(doc[seen], pos[seen], key_doc, key_pos, block_q=bq, block_k=bk)
            got = ring_step_work(lay.shards, group.shards[slot], bq, bk)
            assert (got[:3], got.queries) == (_meta_counts(meta), len(seen)), (rank, s)


@pytest.mark.parametrize("seed", range(40))
def test_group_blocks_equal_the_per_rank_reference(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    shards = random_group(rng, n, rng.randint(1, 6), 400)
    bq, bk = rng.choice([4, 16, 256]), rng.choice([8, 64, 1024])
    a = cost.shard_arrays(shards)
    s = sort_shards(a.rank, a.doc, a.start, a.end, n)
    lean = group_lean_work(s, bq, bk)
    ring = group_ring_work(s, bq, bk)
    entries = {(int(i), int(st)): k for k, (i, st) in enumerate(zip(ring.rank, ring.step, strict=True))}
    for i in range(n):
        want = lean_work(shards[i], bq, bk)
        assert tuple(int(x[i]) for x in lean.local) == tuple(want.local)
        assert tuple(int(x[i]) for x in lean.remote) == tuple(want.remote)
        assert int(lean.remote_keys[i]) == want.remote_keys
        for st in range(1, n):
            want_step = ring_step_work(shards[i], shards[(i - st) % n], bq, bk)
            k = entries.get((i, st))
            got = NO_BLOCKS if k is None else tuple(int(x[k]) for x in ring.blocks)
            assert tuple(got) == tuple(want_step), (i, st)


# -- group_steps against rank_step ---------------------------------------------------------------


def _assert_group_steps_equal_rank_step(rng, shards, kernel, mode, flash_path=RUNTIME_FLASH_PATH):
    n = len(shards)
    link = rng.choice([GLOO, NVLINK, dataclasses.replace(NVLINK, bandwidth_gbps=2.0)])
    model = rng.choice([CPU_MODEL, MODEL])
    overlap = rng.random() < 0.5
    tokens = max(sum(s.end - s.start for s in rank) for rank in shards) + rng.randint(0, 9)
    recv = cost.recv_tokens_by_mode(mode, cost.comm_volumes(shards), tokens)
    got = group_steps(cost.shard_arrays(shards), recv_tokens=np.array(recv), tokens_per_rank=tokens,
                      num_ranks=n, comm_mode=mode, model=model, kernel=kernel, link=link,
                      overlap=overlap, flash_path=flash_path)
    want = [rank_step(shards[i], recv_tokens=recv[i], tokens_per_rank=tokens, num_ranks=n,
                      comm_mode=mode, model=model, kernel=kernel, link=link, overlap=overlap,
                      ring_blocks=[shards[(i - s) % n] for s in range(1, n)],
                      flash_path=flash_path) for i in range(n)]
    for field in ("kernel_ms", "copy_ms", "comm_ms", "linear_ms", "total_ms"):
        np.testing.assert_allclose(getattr(got, field), [getattr(w, field) for w in want],
                                   rtol=1e-9, atol=0, err_msg=field)


@pytest.mark.parametrize("seed", range(120))
def test_group_steps_equal_rank_step(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    shards = random_group(rng, n, rng.randint(1, 6), 400)
    kernel = dataclasses.replace(KERNEL_PROFILES[rng.choice(["cpu-torch", "h100-fa2", "h100-fa3"])],
                                 tile_q=rng.choice([8, 64, 128]), tile_k=rng.choice([16, 64, 256]))
    _assert_group_steps_equal_rank_step(rng, shards, kernel, rng.choice(MODES),
                                        rng.choice(FLASH_PATHS))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("flash_path", FLASH_PATHS)
def test_group_steps_equal_rank_step_on_the_flash_paths(seed, mode, flash_path):
    # Many shards of a doc per rank (up to 2N + 1 cuts), tiles that do and do not divide.
    rng = random.Random(1000 + seed)
    n = rng.randint(1, 6)
    shards = random_group(rng, n, rng.randint(1, 8), 600)
    kernel = dataclasses.replace(KERNEL_PROFILES[rng.choice(["h100-fa2", "h100-fa3"])],
                                 tile_q=rng.choice([16, 128]), tile_k=rng.choice([16, 24, 64]))
    _assert_group_steps_equal_rank_step(rng, shards, kernel, mode, flash_path)


@pytest.mark.parametrize("seed", range(30))
def test_group_metrics_with_the_torch_kernel_equal_rank_step_metrics(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    shards = random_group(rng, n, rng.randint(1, 5), 300)
    tokens = [sum(s.end - s.start for s in rank) for rank in shards]
    padding = [max(tokens) - t for t in tokens]
    mode = rng.choice(MODES)
    metrics, _ = group_metrics(shards, padding, comm_mode=mode, model=CPU_MODEL,
                               kernel="cpu-torch", link="gloo-local")
    recv = cost.recv_tokens_by_mode(mode, cost.comm_volumes(shards), max(tokens))
    steps = [rank_step(shards[i], recv_tokens=recv[i], tokens_per_rank=max(tokens), num_ranks=n,
                       comm_mode=mode, model=CPU_MODEL, kernel=TORCH, link=GLOO,
                       ring_blocks=[shards[(i - s) % n] for s in range(1, n)]) for i in range(n)]
    slowest = max(range(n), key=lambda i: (steps[i].total_ms, -i))
    assert (metrics.est_step_ms, metrics.est_attn_ms, metrics.est_comm_ms, metrics.est_linear_ms) == (
        steps[slowest].total_ms, steps[slowest].attn_ms, steps[slowest].comm_ms,
        steps[slowest].linear_ms)


def test_ties_go_to_the_lowest_rank():
    shards = [[Shard(0, 0, 64)], [Shard(1, 0, 64)], [Shard(2, 0, 64)]]
    for kernel in ("h100-fa2", "cpu-torch"):
        m, _ = group_metrics(shards, [0, 0, 0], comm_mode="alltoallv", model=MODEL, kernel=kernel,
                             link="nvlink")
        want = step(shards[0], n=3, kernel=KERNEL_PROFILES[kernel], mode="alltoallv")
        assert m.est_step_ms == want.total_ms


# -- the gathered path (flash-attn, opt-out) ----------------------------------------------------


def test_flash_runs_a_ring_plan_as_the_full_all_gather_without_overlap():
    shards = [Shard(0, 0, 4096)]
    kw = dict(recv=3 * 4096, n=4, flash_path="gathered")
    ring = step(shards, mode="p2p_ring", **kw)
    assert ring == step(shards, mode="full", **kw) == step(shards, mode="p2p_ring", overlap=False, **kw)
    nbytes = 3 * 4096 * MODEL.kv_bytes_per_token
    assert ring.comm_ms == pytest.approx(2 * (NVLINK.latency_us * 1e-3 + nbytes / NVLINK.bandwidth_gbps / 1e6))
    assert ring.total_ms == pytest.approx(ring.kernel_ms + ring.copy_ms + ring.comm_ms + ring.linear_ms)


def test_padding_costs_copies_and_linear_not_kernel():
    shards = [Shard(0, 0, 1000)]
    for kernel, flash_path in ((FA2, "segments"), (FA2, "gathered"), (TORCH, "segments")):
        bare = step(shards, tokens=1000, kernel=kernel, flash_path=flash_path)
        padded = step(shards, tokens=1500, kernel=kernel, flash_path=flash_path)
        assert padded.kernel_ms == bare.kernel_ms
        assert padded.copy_ms > bare.copy_ms and padded.linear_ms > bare.linear_ms


def test_key_gathers_are_charged():
    # Same queries; the late shard gathers 8K keys, the early one 1K.
    late, early = [Shard(0, 7168, 8192)], [Shard(0, 0, 1024)]
    assert key_rows(late) == 8192 and key_rows(early) == 1024
    assert step(late, flash_path="gathered").copy_ms > step(early, flash_path="gathered").copy_ms


# -- the segments path (flash-attn, the runtime's default) ---------------------------------------


def _runtime_call_counts(seg, tq, tk):
    """The counts of the runtime's own SegmentPlan (local calls, remote calls, hollow calls)."""
    def summed(calls):
        tiles = segs = blocks = queries = keys = 0
        for c in calls:
            lq, lk = np.diff(c.cu_q.astype(np.int64)), np.diff(c.cu_k.astype(np.int64))
            if c.causal:
                assert (lq == lk).all()
                tiles += int(attention_tiles_of(np.zeros_like(lq), lq, tq, tk).sum())
            else:
                tiles += int((-(-lq // tq) * -(-lk // tk)).sum())
            segs, blocks = segs + len(lq), blocks + int((-(-lq // tq)).sum())
            queries, keys = queries + int(lq.sum()), keys + int(lk.sum())
        return sgw.Calls(tiles * tq * tk, tiles, segs, blocks, len(calls), queries, keys)

    local = [c for c in seg.calls if not c.remote]
    remote = [c for c in seg.calls if c.remote]
    return summed(local), summed(remote), sum(len(c.empty) > 0 for c in remote)


def _random_plan(seed, n):
    rng = random.Random(seed)
    shards = random_group(rng, n, rng.randint(1, 7), 300)
    lengths = [max([s.end for rank in shards for s in rank if s.doc == d], default=1)
               for d in range(1 + max(s.doc for rank in shards for s in rank))]
    return build_plan(Layout([GroupLayout(tuple(range(n)), shards)], {}), strategy="random_test",
                      cp_size=n, doc_lengths=lengths, context_length=None, comm_mode="alltoallv",
                      model=MODEL, kernel="h100-fa2", link="nvlink")


@pytest.mark.parametrize("case", [*[("random", s) for s in range(40)],
                                  *[(s, 0) for s in ("flashcp", "per_doc", "llama3", "zigzag", "fcp")]])
@pytest.mark.parametrize("tiles", [(128, 64), (16, 24)])
def test_segment_work_equals_the_runtime_calls(case, tiles):
    tq, tk = tiles
    kind, seed = case
    n = 2 + seed % 4 if kind == "random" else 4
    plan = _random_plan(seed, n) if kind == "random" else solve(PlanRequest(
        doc_lengths=(3000, 41, 700, 5, 1290, 64), cp_size=n, strategy=kind, kernel="h100-fa2"))
    for rank in range(n):
        lay = build_layout(plan, rank)
        comm = build_comm_map(lay, "alltoallv")
        seg = build_segment_plan(lay, comm)
        got = sgw.segment_work(lay.shards, tq, tk)
        local, remote, hollow = _runtime_call_counts(seg, tq, tk)
        assert (got.local, got.remote, got.hollow_calls) == (local, remote, hollow), rank
        assert got.in_place == seg.in_place
        assert got.remote_keys == len(seg.remote_order) == len(comm.remote_index)
        assert got.pieces == len(seg.group_bounds) - 1 == sum(c.causal for c in seg.calls)


@pytest.mark.parametrize("seed", range(60))
def test_group_segment_work_equals_the_reference(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    shards = random_group(rng, n, rng.randint(1, 8), 500)
    if rng.random() < 0.3:  # a rank's shards in another local-row order than (doc, start)
        shards = [rng.sample(rank, len(rank)) for rank in shards]
    if seed % 5 == 0:  # what metrics may be given: empty, repeated and overlapping shards
        shards = [[*rank, Shard(0, 3, 3), *rank[:1], Shard(0, 5, 40)] for rank in shards]
    tq, tk = rng.choice([(128, 64), (128, 128), (16, 24), (8, 8), (64, 128)])
    a = cost.shard_arrays(shards)
    got = sgw.group_segment_work(a.rank, a.doc, a.start, a.end, n, tq, tk)
    for i in range(n):
        want = sgw.segment_work(shards[i], tq, tk)
        assert tuple(int(x[i]) for x in got.local) == tuple(want.local)
        assert tuple(int(x[i]) for x in got.remote) == tuple(want.remote)
        assert tuple(x[i].item() for x in got[2:]) == tuple(want[2:]), i


def test_segment_work_written_out_hollow_gap():
    # Three docs with one shard each; doc 1 from position 0 has no gap but lies between
    # the gaps of docs 0 and 2: the remote call spans it (a hollow segment).
    work = sgw.segment_work([Shard(0, 10, 20), Shard(1, 0, 30), Shard(2, 5, 25)], 128, 64)
    # Local: one causal call, 3 square segments of one tile each.
    assert work.local == sgw.Calls(3 * 128 * 64, 3, 3, 3, 1, 60, 60)
    # Remote: one call over all three docs; keys 10 + 0 + 5; doc 1 costs its query tile.
    assert work.remote == sgw.Calls(2 * 128 * 64, 2, 3, 3, 1, 60, 15)
    assert (work.hollow_calls, work.hollow_rows, work.remote_keys) == (1, 60, 15)
    assert (work.pieces, work.merge_rows, work.whole_local, work.whole_remote) == (1, 0, 1, 1)
    assert work.in_place
    # Docs with two shards come first: (doc 1 twice, doc 0 once) -> not in place.
    assert not sgw.segment_work([Shard(0, 0, 5), Shard(1, 0, 4), Shard(1, 9, 12)], 128, 64).in_place


def test_segments_zigzag_rank_written_out():
    # One doc of 4 x 1024 on 2 ranks, zigzag: rank 0 holds S_1 = [0, 1024), S_2 = [3072, 4096)
    # (G_1 empty, G_2 = [1024, 3072) from rank 1); rank 1 holds [1024, 3072).
    group = [[Shard(0, 0, 1024), Shard(0, 3072, 4096)], [Shard(0, 1024, 3072)]]
    t, n, mode = 2048, 2, "alltoallv"
    slow = dataclasses.replace(NVLINK, bandwidth_gbps=5.0)  # the exchange outlasts the local calls
    kw = dict(tokens_per_rank=t, num_ranks=n, comm_mode=mode, model=MODEL, kernel=FA2, link=slow)
    recv = cost.recv_tokens_by_mode(mode, cost.comm_volumes(group), t)
    assert tuple(recv) == (2048, 1024)
    terms = rank_terms(group[0], recv_tokens=2048, **kw)
    # Calls: A(1,1), A(2,2) causal 1024^2; A(2,1) full 1024 x 1024; B(2,2) full 1024 x 2048;
    # B(1,1), B(2,1) skipped (G_1 empty). Tiles (128 x 64): a causal 1024 square reads
    # 2 + 4 + ... + 16 = 72, A(2,1) 8 x 16 = 128, B(2,2) 8 x 32 = 256.
    local = KernelWork(272 * 128 * 64, 272, 3, 24, 3)
    remote = KernelWork(256 * 128 * 64, 256, 1, 8, 1)
    assert terms.work == KernelWork(528 * 128 * 64, 528, 4, 32, 4)
    k_loc = kernel_ms(local, MODEL, FA2)
    assert terms.kernel_ms == pytest.approx(k_loc + kernel_ms(remote, MODEL, FA2))
    # Copies (r = T = F = R = 2048, in place): all-to-all-v send and return (2 x R, 4 ops);
    # forward window: accumulators zeroed and the two groups' first parts (2r each kind),
    # A(2,1)'s merge (1024 rows: 4 and 6); after it: B(2,2)'s merge, the remote K/V select
    # (F), the output's zero fill and cast (T + r); backward window: local dK/dV zeroed
    # (r), 3 calls' lse slices and adds (queries 3072, keys 3072), dQ/dK/dV back (T + r);
    # after it: dQ (r) and remote dK/dV (F) zeroed, B(2,2)'s lse and adds (1024 queries,
    # 2048 keys), the return buffer (R) with the cast and index_copy of F rows.
    fw = Rows(0, 0, 0, 2 + 2 * 2 + 10, 0, 2 * 2048 + 4 * 1024, 2 * 2048 + 6 * 1024)
    bw = Rows(4096, 4096, 0, 2 + 4 * 3 + 6, 2048 + 3072, 3072, 3072)
    want = (Rows(2 * 2048, 0, 0, 4) + fw + Rows(2048, 4096, 0, 10 + 4, 0, 4 * 1024, 6 * 1024)
            + bw + Rows(2048 + 2 * 2048, 0, 0, 3 + 4 + 6, 2048 + 2048, 2048 + 1024, 1024))
    assert terms.rows == want
    h, d, acc = MODEL.num_heads, MODEL.head_dim, 4
    assert want.bytes(MODEL) == (want.kv * MODEL.kv_bytes_per_token + want.q * h * d * 2
                                 + want.acc_kv * 2 * MODEL.num_kv_heads * d * acc
                                 + want.acc_q * h * d * acc + want.acc_lse * h * acc)
    assert terms.copy_ms == pytest.approx(copy_ms(want.bytes(MODEL), FA2, want.ops))
    # Comm: two collectives (K, V) each way; forward hides behind phi x the local calls and
    # the forward window's copies, backward behind the rest of them and its window.
    x = transfer_ms(2048 * MODEL.kv_bytes_per_token, slow, 1, 2)
    phi = forward_share(FA2)
    hide_f = phi * k_loc + copy_ms(fw.bytes(MODEL), FA2, fw.ops)
    hide_b = (1 - phi) * k_loc + copy_ms(bw.bytes(MODEL), FA2, bw.ops)
    assert x > hide_f and x > hide_b
    assert (terms.passes, terms.peer_steps, terms.transfer_ms) == (4, 4, pytest.approx(2 * x))
    assert terms.comm_ms == pytest.approx((x - hide_f) + (x - hide_b))
    assert rank_step(group[0], recv_tokens=2048, overlap=False, **kw).comm_ms == pytest.approx(2 * x)
    # Rank 1: one causal call over all its rows and one remote call over all of them (no
    # lse copy in backward for either); M = 1, so the local buffer is in place.
    # Tiles: the causal 2048 square 2 + 4 + ... + 32 = 272, B(1,1) 2048 x 1024: 16 x 16.
    one = rank_terms(group[1], recv_tokens=1024, **kw)
    assert one.work == KernelWork(528 * 128 * 64, 528, 2, 32, 2)
    assert one.rows.acc_lse == 2 * 2048 + 6 * 2048  # the forward's alone


def test_segments_and_gathered_price_the_same_plan_differently():
    plan = solve(PlanRequest(doc_lengths=(8192, 4096, 4096, 300), cp_size=4, strategy="per_doc",
                             kernel="h100-fa2"))
    seg = plan_rank_terms(plan, FA2, NVLINK)
    gat = plan_rank_terms(plan, FA2, NVLINK, flash_path="gathered")
    assert {t.path for t in seg} == {"segments"} and {t.path for t in gat} == {"gathered"}
    assert all(s.work.calls > 1 for s in seg) and all(g.work.calls == 1 for g in gat)
    # The plan's own metrics are the runtime's default path.
    assert plan.metrics.est_step_ms == pytest.approx(max(t.estimate.total_ms for t in seg))


# -- the lean path (PyTorch kernel, gather modes) -------------------------------------------------


def test_lean_overlap_hides_the_exchange_behind_the_local_call_exactly():
    # Rank 1 of 2: doc 0 [512, 1024) (needs the remote [0, 512)) and doc 1 whole (local).
    shards = [Shard(0, 512, 1024), Shard(1, 0, 2048)]
    tokens, recv, n = 2560 + 7, 512, 2
    kw = dict(recv_tokens=recv, tokens_per_rank=tokens, num_ranks=n, comm_mode="alltoallv",
              model=CPU_MODEL, kernel=TORCH, link=GLOO)
    on, off = rank_step(shards, **kw), rank_step(shards, **kw, overlap=False)
    terms = rank_terms(shards, **kw)
    lean = lean_work(shards, TORCH.tile_q, TORCH.tile_k)
    assert lean.remote.queries == 512 and lean.remote_keys == 512
    local = KernelWork(lean.local.pairs, lean.local.tiles, 2, lean.local.row_blocks, 1)
    remote = KernelWork(lean.remote.pairs, lean.remote.tiles, 0, lean.remote.row_blocks, 1)
    # Two calls, each paying the call overhead.
    assert terms.work.calls == 2
    assert on.kernel_ms == pytest.approx(kernel_ms(local, CPU_MODEL, TORCH) + kernel_ms(remote, CPU_MODEL, TORCH))
    # Two collectives (K and V) each way.
    x = transfer_ms(recv * CPU_MODEL.kv_bytes_per_token, GLOO, n - 1, 2)
    assert (terms.passes, off.comm_ms) == (4, pytest.approx(2 * x))
    k_loc, phi = kernel_ms(local, CPU_MODEL, TORCH), forward_share(TORCH)
    win = lean_window_rows(tokens, 2560, 512)
    hide_b = (1 - phi) * k_loc + copy_ms(win.bytes(CPU_MODEL), TORCH, win.ops)
    assert on.comm_ms == pytest.approx(max(0.0, x - phi * k_loc) + max(0.0, x - hide_b))
    assert on.comm_ms < off.comm_ms
    assert (on.kernel_ms, on.copy_ms) == (off.kernel_ms, off.copy_ms)


def test_lean_rank_with_only_local_keys_makes_one_call_and_hides_most():
    shards = [Shard(0, 0, 4096)]  # holds its doc from 0: no remote key, no remote call
    kw = dict(recv_tokens=3 * 4096, tokens_per_rank=4096, num_ranks=4, comm_mode="full",
              model=CPU_MODEL, kernel=TORCH, link=GLOO)
    terms = rank_terms(shards, **kw)
    assert terms.work.calls == 1
    assert rank_step(shards, **kw).comm_ms < rank_step(shards, **kw, overlap=False).comm_ms


# -- the ring (PyTorch kernel, p2p_ring) -------------------------------------------------------


def test_ring_terms_written_out():
    # One doc of 4 x 512 over 4 ranks: rank 3 sees every block; step s brings slot 3 - s.
    group = [[Shard(0, 512 * i, 512 * (i + 1))] for i in range(4)]
    n, t = 4, 512
    blocks = [group[(3 - s) % n] for s in range(1, n)]
    kw = dict(recv_tokens=(n - 1) * t, tokens_per_rank=t, num_ranks=n, comm_mode="p2p_ring",
              model=CPU_MODEL, kernel=TORCH, link=GLOO, ring_blocks=blocks)
    on, off = rank_step(group[3], **kw), rank_step(group[3], **kw, overlap=False)
    terms = rank_terms(group[3], **kw)
    assert terms.work.calls == n  # the local call and one per step: every block is seen
    shift = ring_shift_ms(t, CPU_MODEL, GLOO)
    assert (terms.passes, off.comm_ms) == (3 * (n - 1), pytest.approx(3 * (n - 1) * shift))
    phi = forward_share(TORCH)
    local = lean_work(group[3], TORCH.tile_q, TORCH.tile_k).local
    k_loc = kernel_ms(KernelWork(local.pairs, local.tiles, 1, local.row_blocks, 1), CPU_MODEL, TORCH)
    fwd = max(0.0, shift - phi * k_loc)
    for s in (1, 2):  # steps 1..N-2 hide the next shift; step N-1 sends nothing
        b = ring_step_work(group[3], blocks[s - 1], TORCH.tile_q, TORCH.tile_k)
        m = merge_rows(b.queries)
        w = phi * kernel_ms(KernelWork(b.pairs, b.tiles, 0, b.row_blocks, 1), CPU_MODEL, TORCH) + copy_ms(
            m.bytes(CPU_MODEL), TORCH, m.ops)
        fwd += max(0.0, shift - w)
    bwd = max(0.0, shift - (1 - phi) * k_loc) + shift  # the last accumulator, after the loop
    for s in (2, 3):  # steps 2..N-1 hide the previous step's accumulator behind their call
        b = ring_step_work(group[3], blocks[s - 1], TORCH.tile_q, TORCH.tile_k)
        k_s = kernel_ms(KernelWork(b.pairs, b.tiles, 0, b.row_blocks, 1), CPU_MODEL, TORCH)
        bwd += max(0.0, shift - (1 - phi) * k_s)
    assert on.comm_ms == pytest.approx(fwd + bwd)
    # Rank 0 sees no earlier block: one call; its forward hides only shift 0.
    first = rank_terms(group[0], **{**kw, "ring_blocks": [group[(0 - s) % n] for s in range(1, n)]})
    assert first.work.calls == 1


def test_ring_needs_its_blocks():
    with pytest.raises(ValueError, match="ring_blocks must list the 2 blocks"):
        rank_step([Shard(0, 0, 8)], recv_tokens=16, tokens_per_rank=8, num_ranks=3,
                  comm_mode="p2p_ring", model=CPU_MODEL, kernel=TORCH, link=GLOO)


# -- profiles --------------------------------------------------------------------------------


def test_plan_estimate_uses_the_named_profile():
    req = dict(doc_lengths=(8192, 4096, 4096), cp_size=4, strategy="flashcp")
    fa2 = solve(PlanRequest(**req, kernel="h100-fa2"))
    fa3 = solve(PlanRequest(**req, kernel="h100-fa3"))
    assert (fa2.kernel, fa3.kernel) == ("h100-fa2", "h100-fa3")
    assert fa2.metrics.est_attn_ms > fa3.metrics.est_attn_ms


def test_fa2_and_fa3_profiles_differ():
    assert FA2.fwd_tflops < KERNEL_PROFILES["h100-fa3"].fwd_tflops
    assert (FA2.tile_q, FA2.tile_k) == (128, 64)
    assert kernel_profile_from_dict(FA2.to_dict()) == FA2


@pytest.mark.parametrize(("env", "runtime", "want"), [
    ({}, None, "h100-aten-fa2"),
    ({}, ("FA2", "NVIDIA H100 80GB HBM3"), "h100-aten-fa2"),
    ({}, ("FA2", "NVIDIA H200"), "h200-aten-fa2"),
    ({}, ("FA3", "NVIDIA H100 80GB HBM3"), "h100-fa3"),
    ({}, ("FA4", "NVIDIA H200"), "h200-aten-fa2"),
    ({}, ("FA2", "NVIDIA A100-SXM4-80GB"), "h100-aten-fa2"),
    ({"PLANNER_KERNEL_PROFILE": "h100-fa3"}, ("FA2", "NVIDIA H200"), "h100-fa3"),
])
def test_default_profile_follows_the_kernel_that_runs_or_the_declared_one(env, runtime, want):
    name, why = default_kernel_profile(env, runtime)
    assert name == want and why
    if runtime and runtime[0] == "FA4":
        assert "no profile" in why


@pytest.mark.parametrize(("env", "installed", "want"), [
    (None, "3.1.0", "h100-aten-fa2"),  # flash-attn is opt-in: installed is not running
    (None, None, "h100-aten-fa2"),
    ("h100-fa3", None, "h100-fa3"),
    ("h100-fa2", None, "h100-fa2"),
    ("cpu-torch", "3.1.0", "cpu-torch"),
])
def test_a_request_without_a_kernel_resolves_it_at_construction(monkeypatch, env, installed, want):
    monkeypatch.setattr(profiles, "flash_attn_version", lambda: installed)
    monkeypatch.setattr(profiles, "_this_process", lambda: None)
    if env is None:
        monkeypatch.delenv("PLANNER_KERNEL_PROFILE", raising=False)
    else:
        monkeypatch.setenv("PLANNER_KERNEL_PROFILE", env)
    request = PlanRequest(doc_lengths=(3000, 1000, 96), cp_size=2)
    assert request.kernel == want
    plan = solve(request)
    assert plan.kernel == want and plan.to_dict()["kernel"] == want  # recorded in the plan
    # Same environment, same plan, byte for byte.
    assert solve(PlanRequest(doc_lengths=(3000, 1000, 96), cp_size=2)).to_json() == plan.to_json()
    # An explicit kernel is kept whatever the environment says.
    assert PlanRequest(doc_lengths=(5,), cp_size=1, kernel="h100-fa3").kernel == "h100-fa3"


def test_pytorch_fa2_profiles_price_plans_as_the_cited_fa2_rates():
    """Same kernels as flash-attn 2 (PyTorch vendors them): same coefficients, so the same
    plan body apart from the kernel name; H200 differs in the copy rate only."""
    aten, h200 = KERNEL_PROFILES["h100-aten-fa2"], KERNEL_PROFILES["h200-aten-fa2"]
    assert {**aten.to_dict(), "name": FA2.name, "source": FA2.source} == FA2.to_dict()
    assert h200.copy_gbps > aten.copy_gbps
    assert {**h200.to_dict(), "name": aten.name, "source": aten.source, "copy_gbps": aten.copy_gbps} \
        == aten.to_dict()
    assert "not measured here" in aten.source and "not measured here" in h200.source
    lengths = (3000, 1000, 96)
    fa2 = solve(PlanRequest(doc_lengths=lengths, cp_size=2, kernel="h100-fa2")).to_dict()
    torch_fa2 = solve(PlanRequest(doc_lengths=lengths, cp_size=2, kernel="h100-aten-fa2")).to_dict()
    assert fa2["groups"] == torch_fa2["groups"]


def test_declared_profile_must_exist():
    with pytest.raises(ValueError, match="kernel profile 'nope' is unknown"):
        default_kernel_profile({"PLANNER_KERNEL_PROFILE": "nope"}, None)


def test_bad_profile_field_is_named():
    with pytest.raises(ValueError, match="kernel.tiling"):
        kernel_profile_from_dict({**FA2.to_dict(), "tiling": "diagonal"})
    with pytest.raises(ValueError, match="kernel.copy_gbps"):
        kernel_profile_from_dict({**FA2.to_dict(), "copy_gbps": 0.0})


def test_a_ring_too_large_to_model_is_refused_by_both_forms(monkeypatch):
    shards = [[Shard(0, 8 * i, 8 * i + 8), Shard(1, 8 * i, 8 * i + 8)] for i in range(4)]
    assert ring_pairs(np.repeat(np.arange(4), 2), np.tile([0, 1], 4)) == 8 * 3
    monkeypatch.setattr("planner_service.core.step_time.runs.MAX_RING_PAIRS", 23)
    kw = dict(tokens_per_rank=16, num_ranks=4, comm_mode="p2p_ring", model=CPU_MODEL, kernel=TORCH,
              link=GLOO)
    for kernel in (TORCH, FA2):  # the PyTorch kernel's ring and flash-attn's segment ring
        kw["kernel"] = kernel
        with pytest.raises(ValueError, match="comm_mode: .* at most 23 .* this group has 24"):
            group_steps(cost.shard_arrays(shards), recv_tokens=np.full(4, 48), **kw)
        with pytest.raises(ValueError, match="comm_mode: .* at most 23 .* this group has 24"):
            rank_step(shards[0], recv_tokens=48, ring_blocks=shards[1:], **kw)
    monkeypatch.setattr("planner_service.core.step_time.runs.MAX_RING_PAIRS", 24)
    for kernel in (TORCH, FA2):
        kw["kernel"] = kernel
        group_steps(cost.shard_arrays(shards), recv_tokens=np.full(4, 48), **kw)
