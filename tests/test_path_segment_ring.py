"""The segment ring (``p2p_ring`` plans on the flash path): its decomposition (brute force on
random layouts, a worked example, whole plans simulated in one process), the path it runs
on, the flash probe's zero-query and hollow segments, and the ring itself on spawned gloo
worlds of 3, 5 and 8 ranks with the exact reference segment kernel in float64 (outputs,
gradients, bytes per step and the KV counter against the plan). GPU: the flash segment ring
in bf16 against the reference.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_cases import (
    KV_ROW_ELEMS,
    MODEL,
    bf16_against_reference,
    covered_pairs,
    flash_standin,
    flash_standin_backward,
    install_flash,
    max_abs,
    needs_flash,
    random_plan,
    rank_path_state,
    reference_case,
    run_against_reference,
    solve_any,
)
from timing import scaled

from planner_service.core.build import GroupLayout, Layout, build_plan
from planner_service.core.plan import Plan, Shard
from planner_service.core.request import PlanRequest
from planner_service.core.step_time.segment_ring import segment_ring_calls
from planner_service.core.validate import validate_plan
from planner_service.solvers.registry import solve
from worker_runtime import (
    ContextParallelAttention,
    build_comm_map,
    build_layout,
    planned_kv_tokens_peak,
    planned_recv_tokens,
)
from worker_runtime.paths import PATHS
from worker_runtime.paths.ring_steps import slot_rows
from worker_runtime.paths.segment_kernels import ReferenceSegments, flash_segments, probe
from worker_runtime.paths.segment_ring import build_segment_ring_plan, query_groups
from worker_runtime.simulate import simulate_segment_ring
from worker_runtime.testing import run_distributed

TOL = 1e-10
SOURCES = ("random", "per_doc", "zigzag", "flashcp", "ring", "llama3")


# -- the decomposition ---------------------------------------------------------------------


def step_pairs(layout, ring, step: int) -> list[tuple[int, int, int]]:
    """Every (doc, query position, key position) step ``step``'s calls compute, once per
    computation; checks each call's shape on the way."""
    r = layout.num_real
    q_doc = layout.doc_ids[:r][ring.local.local_rows]
    q_pos = layout.positions[:r][ring.local.local_rows]
    k_doc, k_pos = slot_rows(layout, (layout.slot - step) % layout.num_ranks)
    real = int((k_doc >= 0).sum())
    pairs = []
    for c in ring.steps[step - 1]:
        assert c.remote and not c.causal
        assert c.cu_q.dtype == c.cu_k.dtype == np.int32 and c.cu_q[0] == c.cu_k[0] == 0
        assert (c.q_hi - c.q_lo, c.k_hi - c.k_lo) == (c.cu_q[-1], c.cu_k[-1])
        assert 0 <= c.k_lo < c.k_hi <= real, "keys are real rows of the block"
        lq, lk = np.diff(c.cu_q), np.diff(c.cu_k)
        assert ((lq > 0) | (lk > 0)).all(), "no segment without queries and keys"
        assert lq[0] > 0 < lk[0] and lq[-1] > 0 < lk[-1], "a call starts and ends with keys seen"
        want_hollow = [x for b in np.flatnonzero(lk == 0) for x in range(c.cu_q[b], c.cu_q[b + 1])]
        assert c.empty.tolist() == want_hollow
        for b in range(len(lq)):
            for qrow in range(c.q_lo + int(c.cu_q[b]), c.q_lo + int(c.cu_q[b + 1])):
                for krow in range(c.k_lo + int(c.cu_k[b]), c.k_lo + int(c.cu_k[b + 1])):
                    assert k_doc[krow] == q_doc[qrow], "a segment pairs one doc"
                    pairs.append((int(q_doc[qrow]), int(q_pos[qrow]), int(k_pos[krow])))
    groups = [c.group for c in ring.steps[step - 1]]
    assert groups == sorted(groups), "calls in group order"
    return pairs


def source_plan(seed: int, cp_size: int, source: str) -> Plan:
    if source == "random":
        return random_plan(seed, cp_size)
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(1, 30, size=int(rng.integers(1, 2 + 2 * cp_size)))]
    return solve_any(lengths, cp_size, source)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 6), st.sampled_from(SOURCES))
def test_simulated_segment_ring_equals_reference_for_whole_plans(seed: int, cp_size: int,
                                                                  source: str) -> None:
    """Every rank's calls in one process (blocks read from the global K/V) against the
    dense float64 reference, forward and backward."""
    plan = source_plan(seed, cp_size, source)
    case = reference_case(plan, seed)
    leaves = [t.clone().requires_grad_() for t in (case.q, case.k, case.v)]
    out = simulate_segment_ring(plan, *leaves, ReferenceSegments())
    assert max_abs(out - case.ref) <= TOL
    grads = torch.autograd.grad((out * case.w).sum(), leaves)
    assert max(max_abs(a - b) for a, b in zip(grads, case.ref_grads, strict=True)) <= TOL


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(2, 8), st.sampled_from(SOURCES))
def test_ring_calls_cover_every_document_mask_pair_exactly_once(seed: int, cp_size: int,
                                                                source: str) -> None:
    plan = source_plan(seed, cp_size, source)
    for group in plan.groups:
        for rank in group.ranks:
            lay = build_layout(plan, rank)
            ring = build_segment_ring_plan(lay)
            assert len(ring.steps) == lay.num_ranks - 1
            mask = sorted((d, p, kp) for d, s, e in lay.shards for p in range(s, e) for kp in range(p + 1))
            # Step 0: the local calls, own keys (segments.py's calls without the remote ones).
            assert all(not c.remote for c in ring.local.calls)
            got = covered_pairs(lay, build_comm_map(lay, "full"), ring.local)
            for step in range(1, lay.num_ranks):
                k_doc, k_pos = slot_rows(lay, (lay.slot - step) % lay.num_ranks)
                block = set(zip(k_doc.tolist(), k_pos.tolist(), strict=True))
                pairs = step_pairs(lay, ring, step)
                assert sorted(pairs) == [x for x in mask if (x[0], x[2]) in block], f"step {step}"
                got += pairs
                classes = sum(len(g.classes) - 1 for g in query_groups(lay, ring.local))
                assert len(ring.steps[step - 1]) <= classes
            assert sorted(got) == mask


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.integers(2, 8), st.sampled_from(SOURCES))
def test_the_models_ring_calls_are_the_runtimes(seed: int, cp_size: int, source: str) -> None:
    """core/step_time/segment_ring.segment_ring_calls (what the step-time model prices) lists,
    per rank and step, the runtime's calls: same query group, first query and key row,
    and query and key rows per segment."""
    plan = source_plan(seed, cp_size, source)
    for group in plan.groups:
        n = len(group.ranks)
        for slot, rank in enumerate(group.ranks):
            ring = build_segment_ring_plan(build_layout(plan, rank))
            blocks = [group.shards[(slot - s) % n] for s in range(1, n)]
            model = segment_ring_calls(group.shards[slot], blocks)
            for step, (runtime_calls, model_calls) in enumerate(zip(ring.steps, model, strict=True), 1):
                got = [(c.group, c.q_lo, c.k_lo, tuple(np.diff(c.cu_q).tolist()),
                        tuple(np.diff(c.cu_k).tolist())) for c in runtime_calls]
                want = [(c.group, c.q_lo, c.k_lo, c.queries, c.keys) for c in model_calls]
                assert got == want, f"rank {rank}, step {step}"


def test_worked_example_has_hollow_and_zero_query_segments() -> None:
    """Rank 0 holds docs 0, 1, 2 once each; rank 1's block is doc 0 at 0, 1, 4, 5, doc 1
    at 3, 4, doc 2 at 0, 1. Rank 0's shard of doc 1 starts at 0: it sees nothing (hollow);
    doc 0's positions 4, 5 lie between the keys of doc 0 and doc 2 (a zero-query segment)."""
    shards = [[Shard(0, 2, 4), Shard(1, 0, 3), Shard(2, 2, 4)],
              [Shard(0, 0, 2), Shard(0, 4, 6), Shard(1, 3, 5), Shard(2, 0, 2)]]
    plan = build_plan(Layout([GroupLayout((0, 1), shards)], {}), strategy="ring_test", cp_size=2,
                      doc_lengths=[6, 5, 4], context_length=None, comm_mode="p2p_ring",
                      model=MODEL, kernel="h100-fa3", link="nvlink")
    validate_plan(plan)
    (call,) = build_segment_ring_plan(build_layout(plan, 0)).steps[0]
    assert (call.q_lo, call.q_hi, call.k_lo, call.k_hi) == (0, 7, 0, 8)
    assert call.cu_q.tolist() == [0, 2, 5, 5, 7] and call.cu_k.tolist() == [0, 2, 2, 6, 8]
    assert call.empty.tolist() == [2, 3, 4]
    # Rank 1: doc 0 (two shards here) is a class of its own, docs 1 and 2 another; group 1
    # is doc 0's second shard [4, 6), which sees rank 0's [2, 4).
    calls = build_segment_ring_plan(build_layout(plan, 1)).steps[0]
    assert [(c.group, c.piece, c.cu_q.tolist(), c.k_lo, c.cu_k.tolist()) for c in calls] == [
        (0, 1, [0, 2], 2, [0, 3]), (1, 0, [0, 2], 0, [0, 2])]


# -- the path, the probe ---------------------------------------------------------------------


def one_rank_plan() -> Plan:
    plan = solve_any([5, 3, 9], 1, "ring")
    assert plan.comm_mode == "p2p_ring"
    return plan


def test_ring_plans_take_the_segment_ring_where_the_segments_path_would_run(monkeypatch) -> None:
    plan = one_rank_plan()
    kern = ReferenceSegments()
    q = torch.zeros(17, 4, 16, dtype=torch.bfloat16)
    assert ContextParallelAttention(plan, segment_kernel=kern).execution_path(q) == ("segment_ring", kern)
    for mode in ("full", "alltoallv", "compact_allgather"):
        attn = ContextParallelAttention(plan, comm_mode=mode, segment_kernel=kern)
        assert attn.execution_path(q) == ("segments", kern)
    assert ContextParallelAttention(plan).execution_path(q.float()) == ("ring", None)
    install_flash(monkeypatch, flash_standin, flash_standin_backward)
    path, found = ContextParallelAttention(plan, kernel="flash").execution_path(q)
    assert path == "segment_ring" and found is not None and found.name == "flash"
    assert ContextParallelAttention(plan, kernel="flash", flash_path="gathered").execution_path(q) == (
        "gathered", None)


def test_one_rank_segment_ring_equals_autograd_reference() -> None:
    """N = 1: the local calls alone (no step, no transfer)."""
    plan = one_rank_plan()
    case = reference_case(plan, 0)
    attn = ContextParallelAttention(plan, segment_kernel=ReferenceSegments())
    _, errors = run_against_reference(attn, case)
    assert max(errors) <= TOL
    assert attn.counter.history == [] and attn.counter.kv_tokens_peak == sum(plan.doc_lengths)


def test_probe_refuses_a_kernel_that_gives_zero_query_keys_gradients(monkeypatch) -> None:
    def leaky_backward(*args, **kwargs):
        flash_standin_backward(*args, **kwargs)
        cu_q, cu_k = kwargs["cu_seqlens_q"].numpy(), kwargs["cu_seqlens_k"].numpy()
        for b in np.flatnonzero(np.diff(cu_q) == 0):
            kwargs["dk"][cu_k[b] : cu_k[b + 1]] = 1.0
        return torch.zeros(1)

    leaky_backward.__signature__ = inspect.signature(flash_standin_backward)  # type: ignore[attr-defined]
    install_flash(monkeypatch, flash_standin, leaky_backward)
    with pytest.warns(RuntimeWarning, match=r"probe: dk differs .* cu_q=\[0, 2, 2, 5, 6\]"):
        assert flash_segments(torch.device("cpu"), torch.float32, 16) is None
    probe(ReferenceSegments(), torch.device("cpu"), torch.float32, 16)


# -- spawned gloo worlds ---------------------------------------------------------------------

RING_STRATEGIES = (("ring", {}), ("zigzag", {}), ("fcp", {"intra": "zigzag"}))
"""Ring plans, and an FCP plan on zigzag groups (several groups) run as a ring."""


def plans_for(world_size: int) -> list[Plan]:
    rng = np.random.default_rng(400 + world_size)
    lengths = [1, 2, *rng.integers(1, 20, size=4 + world_size).tolist(), int(rng.integers(30, 50))]
    return [solve(PlanRequest(doc_lengths=lengths, cp_size=world_size, strategy=name, model=MODEL,
                              options=options)) for name, options in RING_STRATEGIES]


def worker(rank: int, world_size: int, plan_jsons: list[str]) -> dict:
    results = {}
    kern = ReferenceSegments()
    for ci, text in enumerate(plan_jsons):
        plan = Plan.from_json(text)
        case = reference_case(plan, ci)
        for overlap in (True, False):
            attn = ContextParallelAttention(plan, comm_mode="p2p_ring", overlap=overlap,
                                            segment_kernel=kern)
            _, errors = run_against_reference(attn, case)
            c = attn.counter
            results[(ci, overlap)] = {
                "errors": errors, "bytes": (c.forward_bytes, c.backward_bytes),
                "history": list(c.history), "peak": c.kv_tokens_peak, "tokens": attn.num_tokens,
                "path": attn.execution_path(attn.dispatch(case.q))[0],
            }
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 5, 8])
def test_segment_ring_is_exact_with_ring_bytes_and_kv_peak(world_size: int) -> None:
    plans = plans_for(world_size)
    per_rank = run_distributed(worker, world_size, [p.to_json() for p in plans], timeout_s=scaled(240.0))
    row_bytes = KV_ROW_ELEMS * 8
    for ci, plan in enumerate(plans):
        for overlap in (True, False):
            for rank, res in enumerate(per_rank):
                got = res[(ci, overlap)]
                where = f"{plan.strategy} overlap={overlap} rank {rank}"
                assert got["path"] == "segment_ring", where
                assert max(got["errors"]) <= TOL, f"{where}: errors {got['errors']}"
                want = planned_recv_tokens(plan, rank, "full") * row_bytes
                assert got["bytes"] == (want, 2 * want), f"{where}: {got['bytes']} != {want}"
                size = len(next((g.ranks for g in plan.groups if rank in g.ranks), ()))
                steps = [b for d, b in got["history"] if d == "forward"]
                assert steps == [got["tokens"] * row_bytes] * max(size - 1, 0), f"{where}: {steps}"
                assert got["peak"] == planned_kv_tokens_peak(plan, rank, "p2p_ring"), where


# -- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("strategy", ["ring", "zigzag", "flashcp"])
def test_segment_ring_with_flash_matches_reference_in_bf16(strategy: str) -> None:
    """A 4-rank plan's segment ring, ranks one after another on one GPU (blocks read from
    the global K/V), the flash adapter in every call (hollow and zero-query segments
    included), against the float64 reference on the same bf16 inputs."""
    kern = flash_segments(torch.device("cuda"), torch.bfloat16, 128)
    assert kern is not None
    bf16_against_reference(strategy, lambda plan, *qkv: simulate_segment_ring(plan, *qkv, kern),
                           f"{strategy} segment ring")


@pytest.mark.parametrize("seed", range(6))
def test_planned_calls_are_the_local_and_step_calls(seed: int) -> None:
    """The path lists the local piece calls on the local buffer, then every step's calls on
    its ``T``-row block, and 3 shifts of a block per step."""
    plan = random_plan(seed, 4)
    for rank in range(plan.cp_size):
        lay = build_layout(plan, rank)
        ring_plan = build_segment_ring_plan(lay)
        state = rank_path_state(plan, rank, "segment_ring", "p2p_ring", ReferenceSegments())
        want = [("local", c.q_lo, c.q_hi, c.k_lo, c.k_hi) for c in ring_plan.local.calls]
        want += [("block", c.q_lo, c.q_hi, c.k_lo, c.k_hi) for step in ring_plan.steps for c in step]
        assert [c[2:] for c in PATHS["segment_ring"].planned_calls(state)] == want
        assert PATHS["segment_ring"].buffers(state)["block"] == lay.num_tokens
        transfers = PATHS["segment_ring"].planned_transfers(state)
        assert [tuple(t) for t in transfers] == [("shift", lay.num_tokens, 3 * (lay.num_ranks - 1))]
