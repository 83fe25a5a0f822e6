"""Sliding-window layers on every runtime path, float64, against a dense masked reference.

Kernels: the block kernel's, the reference segment kernel's and the aten stand-in's
windowed masks against a dense mask. Worlds (gloo, 2, 3, 5 and 8 ranks): every comm mode,
the torch kernel (lean path, ring) and the reference segment kernel (the segments path and
the segment ring, natively: halo bytes, the ring's steps_run steps), windows 1, 7, 128 and 4,096 on docs
long enough for each window to bite, GQA; forward and backward within 1e-10 of the
reference; ``window=None`` identical to no window (outputs, gradients and bytes).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import pytest
import torch
from aten_flash_standin import variant
from runtime_cases import (
    MULTI_GROUPS,
    NoPositionSegments,
    max_abs,
    multi_group_plan,
    random_plan,
    solve_any,
)

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.halo_map import halo_transfers_of
from planner_service.core.mask import AttentionMask
from planner_service.core.metrics import group_metrics
from planner_service.core.paths import ExecutionPath
from planner_service.core.plan import Plan
from worker_runtime import ContextParallelAttention, build_layout, reference_attention
from worker_runtime.aten_flash import AtenSegments
from worker_runtime.kernels import build_masked_meta, build_meta, varlen_attention
from worker_runtime.paths import windowed_path
from worker_runtime.paths.segment_kernels import ReferenceSegments
from worker_runtime.reference import document_mask
from worker_runtime.testing import run_distributed
from worker_runtime.window_map import build_window_comm_map, ring_steps, window_transfers

TOL = 1e-10
HEADS, KV_HEADS, DIM = 4, 2, 8
WINDOWS = (1, 7, 128)
BIG_WINDOW = 4096
FULL_WINDOW = 1 << 20
"""A window at least every document of the world cases."""


def blocked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                      window: int | None, block: int = 512) -> torch.Tensor:
    """Dense masked attention computed per (doc, query block) against the doc's keys, so a
    4,096-token window needs no S x S matrix; differentiable."""
    h, g = q.shape[1], k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    outs, off = [], 0
    for n in lengths:
        for a in range(0, n, block):
            b = min(a + block, n)
            lo = 0 if window is None else max(0, a - window + 1)
            qb = q[off + a: off + b]
            kb = k[off + lo: off + b].repeat_interleave(h // g, dim=1)
            vb = v[off + lo: off + b].repeat_interleave(h // g, dim=1)
            qp = torch.arange(a, b)[:, None]
            kp = torch.arange(lo, b)[None, :]
            mask = kp <= qp
            if window is not None:
                mask &= kp > qp - window
            s = torch.einsum("qhd,khd->hqk", qb, kb) * scale
            p = torch.softmax(s.masked_fill(~mask, -math.inf), dim=-1)
            outs.append(torch.einsum("hqk,khd->qhd", p, vb))
        off += n
    return torch.cat(outs)


def tensors(total: int, seed: int, heads: int = HEADS, kv_heads: int = KV_HEADS) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(total, heads, DIM), (total, kv_heads, DIM), (total, kv_heads, DIM), (total, heads, DIM)]
    return tuple(torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes)


# -- kernels --------------------------------------------------------------------------------


def test_document_mask_matches_transformers_convention() -> None:
    """Query p sees keys p - W + 1 .. p: ``kv_idx > q_idx - sliding_window``."""
    mask = document_mask([10], window=3)
    assert mask[5].nonzero().flatten().tolist() == [3, 4, 5]
    assert mask[1].nonzero().flatten().tolist() == [0, 1]
    assert torch.equal(document_mask([4, 6], window=100), document_mask([4, 6]))


@pytest.mark.parametrize("window", [1, 3, 7, 40])
def test_block_kernels_windowed(window: int) -> None:
    """build_meta (bottom-right segments) and build_masked_meta (any key set) under a window
    against the dense reference, forward and backward, with tiny blocks so that blocks fall
    wholly outside windows."""
    lengths = [13, 1, 50, 7]
    total = sum(lengths)
    q, k, v, w = tensors(total, window)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*leaves, lengths, window=window)
    ref_grads = torch.autograd.grad((ref * w).sum(), leaves)
    assert max_abs(blocked_reference(q, k, v, lengths, window, block=8) - ref) < TOL
    cu = np.concatenate(([0], np.cumsum(lengths)))
    doc = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths])
    metas = [build_meta(cu, cu, window=window, block_q=8, block_k=4),
             build_masked_meta(doc, pos, doc, pos, window=window, block_q=8, block_k=4)]
    for meta in metas:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = varlen_attention(*leaves, meta, 1.0 / math.sqrt(DIM), "torch")
        grads = torch.autograd.grad((out * w).sum(), leaves)
        assert max_abs(out - ref) < TOL
        assert max(max_abs(a - b) for a, b in zip(grads, ref_grads, strict=True)) < TOL


@pytest.mark.parametrize("window", [1, 4, 9])
def test_segment_kernels_windowed(window: int) -> None:
    """ReferenceSegments and the aten stand-in (window_size_left = W - 1, right 0) on a
    bottom-right causal call with Lq < Lk, against a dense bottom-right windowed mask."""
    cu_q, cu_k = np.array([0, 3, 5, 5, 20]), np.array([0, 5, 8, 11, 30])
    nq, nk = int(cu_q[-1]), int(cu_k[-1])
    gen = torch.Generator().manual_seed(window)
    q, do = (torch.randn(nq, HEADS, DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(nk, KV_HEADS, DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    scale = DIM**-0.5
    want = torch.zeros(nq, HEADS, DIM, dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]))
        if q1 == q0:
            continue
        t = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
        s_ = torch.arange(k1 - k0)[None, :]
        mask = (s_ <= t) & (s_ > t - window)
        kk = k[k0:k1].repeat_interleave(HEADS // KV_HEADS, dim=1)
        vv = v[k0:k1].repeat_interleave(HEADS // KV_HEADS, dim=1)
        sc = torch.einsum("qhd,khd->hqk", q[q0:q1], kk) * scale
        want[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(sc.masked_fill(~mask, -math.inf), -1), vv)
    ref = ReferenceSegments()
    outs = []
    for kern in (ref, AtenSegments(variant())):
        meta = kern.meta(cu_q, cu_k, True, torch.device("cpu"), window=window)
        out, lse = kern.forward(q, k, v, meta, scale)
        assert max_abs(out.double() - want) < 1e-6 if kern is not ref else max_abs(out - want) < TOL
        outs.append((out.double(), lse.double()))
        assert kern.meta(cu_q, cu_k, True, torch.device("cpu")).window is None
    assert max_abs(outs[0][1] - outs[1][1]) < 1e-5
    with pytest.raises(ValueError, match="window"):
        ref.meta(cu_q, cu_k, False, torch.device("cpu"), window=3)
    with pytest.raises(ValueError, match="window"):
        ref.meta(cu_q, cu_k, True, torch.device("cpu"), window=0)


# -- the exchange of a window ---------------------------------------------------------------


def window_expectations(plan: Plan, window: int, group: int = 0) -> tuple[cost.CommVolumes, ww.RingSchedule]:
    arrays = cost.shard_arrays(plan.groups[group].shards)
    assert arrays is not None
    return ww.window_comm_volumes_of(arrays, window), ww.ring_schedule_of(arrays, window)


@pytest.mark.parametrize("seed", range(12))
def test_window_maps_match_the_planner(seed: int) -> None:
    """The runtime's transfers are core/halo_map.py's; per rank, the all-to-all-v receive
    and the compact all-gather send are core/window_work.py's; the ring's useful steps and
    steps run are its RingSchedule's; every halo key of a rank's windows is in its remote
    keys exactly once."""
    cp_size = 2 + seed % 4
    plan = random_plan(seed, cp_size)
    arrays = cost.shard_arrays(plan.groups[0].shards)
    assert arrays is not None
    for window in (1, 2, 5, 13, 100):
        layout = build_layout(plan, 0)
        a = layout.arrays
        tr = window_transfers(a, window)
        got = sorted(zip(tr.receiver.tolist(), tr.sender.tolist(), a.docs[tr.dd].tolist(),
                         tr.lo.tolist(), tr.hi.tolist(), strict=True))
        ht = halo_transfers_of(arrays, window)
        want = sorted(zip(ht.receiver.tolist(), ht.sender.tolist(), ht.doc.tolist(), ht.lo.tolist(),
                          ht.hi.tolist(), strict=True))
        assert got == want
        volumes, ring = window_expectations(plan, window)
        useful, steps = ring_steps(layout, window)
        assert np.array_equal(useful, ring.useful) and steps == ring.steps_run
        for rank in range(cp_size):
            lay = build_layout(plan, rank)
            a2a = build_window_comm_map(lay, "alltoallv", window)
            gather = build_window_comm_map(lay, "compact_allgather", window)
            assert a2a.recv_rows == volumes.alltoallv_recv[rank]
            assert len(gather.send_index) == volumes.allgather_send[rank]
            assert gather.buffer_rows == max(volumes.allgather_send)
            r = lay.num_real
            needed = {(int(d), p) for d, s0, _ in lay.shards for p in range(max(0, s0 - window + 1), s0)}
            needed -= set(zip(lay.doc_ids[:r].tolist(), lay.positions[:r].tolist(), strict=True))
            for comm in (a2a, gather):
                keys = list(zip(comm.remote_doc.tolist(), comm.remote_pos.tolist(), strict=True))
                assert keys == sorted(needed)
                assert len(set(comm.remote_index.tolist())) == len(keys)


# -- worlds ---------------------------------------------------------------------------------

RUNS = (("full", None), ("compact_allgather", None), ("alltoallv", None), ("p2p_ring", None),
        ("compact_allgather", "reference"), ("alltoallv", "reference"), ("p2p_ring", "reference"),
        ("p2p_ring", "flash"))
"""(comm mode, segment kernel): the torch kernel's lean path and ring, the segments path and
the segment ring on the exact reference segment kernel, the segment ring's gathered form on
a flash-like kernel (the reference without positional masks)."""


def segment_kernel(name: str | None):
    """The run's segment kernel: None (the torch kernel), the reference or a flash-like one."""
    if name is None:
        return None
    return ReferenceSegments() if name == "reference" else NoPositionSegments()


def _run(attn: ContextParallelAttention, glob: tuple[torch.Tensor, ...], window: int | None,
         pass_window: bool = True) -> tuple[torch.Tensor, list[torch.Tensor], tuple[int, int]]:
    q, k, v, w = glob
    attn.counter.reset()
    local = [attn.dispatch(t).requires_grad_() for t in (q, k, v)]
    out = attn(*local, window=window) if pass_window else attn(*local)
    (out * attn.dispatch(w)).sum().backward()
    grads = [t.grad for t in local]
    return out.detach(), grads, (attn.counter.forward_bytes, attn.counter.backward_bytes)


BIG_RUNS = (("alltoallv", None), ("alltoallv", "reference"))
"""The runs of the 4,096-token window (a few thousand tokens on the block kernel)."""


class WorldCase(NamedTuple):
    plan_json: str
    windows: list[int | None]
    runs: tuple[tuple[str, str | None], ...]
    heads: tuple[int, int] = (HEADS, KV_HEADS)


def case_tensors(case: WorldCase, seed: int) -> tuple[torch.Tensor, ...]:
    return tensors(sum(Plan.from_json(case.plan_json).doc_lengths), seed, *case.heads)


def case_references(cases: list[WorldCase]) -> dict:
    """Per (case, window): the reference output and gradients, as numpy (computed once, in
    the parent process, for every rank)."""
    refs = {}
    for ci, case in enumerate(cases):
        glob = case_tensors(case, ci)
        lengths = list(Plan.from_json(case.plan_json).doc_lengths)
        for window in case.windows:
            leaves = [t.clone().requires_grad_() for t in glob[:3]]
            ref = blocked_reference(*leaves, lengths, window)
            grads = torch.autograd.grad((ref * glob[3]).sum(), leaves)
            refs[(ci, window)] = [ref.detach().numpy(), *(g.numpy() for g in grads)]
    return refs


def world_worker(rank: int, world_size: int, cases: list[WorldCase], refs: dict) -> dict:
    """Per (case, run, window): max error of output and gradients against the reference;
    for window None also whether the call equals one without the argument."""
    results: dict = {}
    for ci, case in enumerate(cases):
        text, windows, runs = case.plan_json, case.windows, case.runs
        plan = Plan.from_json(text)
        glob = case_tensors(case, ci)
        for window in windows:
            ref, *ref_grads = (torch.from_numpy(x) for x in refs[(ci, window)])
            for mode, seg in runs:
                kernel = segment_kernel(seg)
                if seg == "flash" and window is not None:
                    assert windowed_path(ExecutionPath.SEGMENT_RING, kernel) == ExecutionPath.GATHERED
                attn = ContextParallelAttention(plan, comm_mode=mode, segment_kernel=kernel)
                out, grads, nbytes = _run(attn, glob, window)
                errors = [max_abs(out - attn.dispatch(ref))]
                errors += [max_abs(g - attn.dispatch(r)) for g, r in zip(grads, ref_grads, strict=True)]
                entry: dict = {"errors": errors, "bytes": nbytes,
                               "tokens": attn.counter.forward_tokens,
                               "peak": attn.counter.kv_tokens_peak}
                if window is not None and attn.layout.group_index >= 0:
                    volumes, ring = window_expectations(plan, window, attn.layout.group_index)
                    slot, t = attn.layout.slot, attn.num_tokens
                    # The segments path and segment ring run natively on the reference
                    # kernel: the halo maps' bytes, the ring's steps_run steps; the segment
                    # ring's gathered form on a flash kernel the blocks of those steps.
                    entry["want_tokens"] = ww.recv_tokens(mode, volumes, t, ring)[slot]
                    ringed = mode == "p2p_ring" and seg != "flash"
                    entry["want_backward"] = (2 * nbytes[0] if ringed else
                                              nbytes[0] if seg == "flash" else None)
                if window is not None and attn.layout.group_index >= 0:
                    # KV held at once: own rows and the distinct halo (gather modes; the
                    # segments path keeps only its halo gaps of a compact all-gather); own
                    # rows and up to two blocks of a ring that runs steps_run steps.
                    own = attn.layout.num_real
                    if mode == "p2p_ring" and seg == "flash":
                        pass  # the gathered form's one call: its keys, not a held count
                    elif mode == "p2p_ring":
                        entry["want_peak"] = own + t * min(ring.steps_run, 2)
                    elif mode != "full":
                        entry["want_peak"] = own + volumes.alltoallv_recv[slot]
                if window is None:
                    out2, grads2, nbytes2 = _run(attn, glob, None, pass_window=False)
                    entry["same"] = (torch.equal(out, out2) and nbytes == nbytes2
                                     and all(torch.equal(a, b) for a, b in zip(grads, grads2, strict=True)))
                results[(ci, mode, seg, window)] = entry
    return results


def world_cases(world_size: int) -> list[WorldCase]:
    rng = np.random.default_rng(world_size)
    lengths = [int(x) for x in rng.integers(1, 40, size=2 * world_size)] + [300, 1, 150]
    rng.shuffle(lengths)
    # Fewer plans on the larger worlds: each world spawns its ranks on a shared machine.
    names = {2: ("flashcp", "contiguous_halo"), 3: ("flashcp",), 5: ("contiguous_halo",)}
    # The first plan also under a window at least every document (the causal figures).
    cases = [WorldCase(solve_any(lengths, world_size, name).to_json(),
                       [*WINDOWS, *([FULL_WINDOW] if i == 0 else []), None], RUNS)
             for i, name in enumerate(names.get(world_size, ("flashcp",)))]
    cases.append(WorldCase(random_plan(world_size, world_size).to_json(), [1, 2, 7], RUNS))
    if world_size == 3:  # two groups, one with its ranks out of order, as FCP plans them
        grouped = multi_group_plan(lengths, MULTI_GROUPS[3], 3).to_json()
        cases.append(WorldCase(grouped, [1, 7, 128, None], RUNS))
    if world_size == 2:
        big = solve_any([BIG_WINDOW + 100, 40], world_size, "flashcp").to_json()
        cases.append(WorldCase(big, [BIG_WINDOW], BIG_RUNS, heads=(2, 1)))
    return cases


def plan_ring_tokens(plan: Plan, group: int, window: int) -> int:
    """The KV tokens per rank of one ``window`` layer of ``plan``'s group run as
    ``p2p_ring``, as a plan made for that mask reports them (``metrics.group_metrics``)."""
    g = plan.groups[group]
    m, _ = group_metrics(g.shards, g.padding, comm_mode="p2p_ring", model=plan.model,
                         kernel=plan.kernel, link=plan.link, mask=AttentionMask.uniform(window, 1))
    assert m.layers is not None
    return m.layers[0].comm_tokens


@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
def test_windowed_worlds(world_size: int) -> None:
    cases = world_cases(world_size)
    results = run_distributed(world_worker, world_size, cases, case_references(cases), timeout_s=300)
    plans = [Plan.from_json(case.plan_json) for case in cases]
    for rank, res in enumerate(results):
        for key, entry in res.items():
            assert max(entry["errors"]) < TOL, (rank, key, entry["errors"])
            ci, mode, _, window = key
            gi = next((i for i, g in enumerate(plans[ci].groups) if rank in g.ranks), -1)
            if mode == "p2p_ring" and window is not None and gi >= 0:
                # Every kernel's ring form moves what the plan's window layer says.
                assert entry["tokens"] == plan_ring_tokens(plans[ci], gi, window), (rank, key)
            if "want_tokens" in entry:
                assert entry["tokens"] == entry["want_tokens"], (rank, key)
            if entry.get("want_backward") is not None:
                # Backward: the K/V blocks and their dK/dV accumulators, steps_run each.
                assert entry["bytes"][1] == entry["want_backward"], (rank, key, entry["bytes"])
            if "want_peak" in entry:
                assert entry["peak"] == entry["want_peak"], (rank, key, entry["peak"], entry["want_peak"])
            if key[-1] is None:
                assert entry["same"], (rank, key)


def mismatch_worker(rank: int, world_size: int, plan_json: str) -> str:
    from worker_runtime.safety import CollectiveCheckError

    plan = Plan.from_json(plan_json)
    attn = ContextParallelAttention(plan)
    q, k, v, _ = tensors(sum(plan.doc_lengths), 0)
    try:
        attn(*(attn.dispatch(t) for t in (q, k, v)), window=4 if rank == 0 else None)
    except CollectiveCheckError as exc:
        return str(exc)
    return "ran"


def test_ranks_on_different_windows_are_refused_on_every_rank() -> None:
    plan = solve_any([30, 9, 14], 2, "flashcp")
    for message in run_distributed(mismatch_worker, 2, plan.to_json(), timeout_s=120):
        assert "window differs across ranks" in message, message
