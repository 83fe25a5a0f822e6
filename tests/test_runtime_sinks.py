"""Attention sinks (one logit per query head in every softmax denominator) on every
execution path, in float64 against a dense float64 reference with the sink as an extra
column of the scores: output, dQ, dK, dV and the sink's gradient (summed over the ranks),
GQA, on spawned gloo worlds of 2 and 3 ranks, plans of several strategies and a ring plan.
"""

from __future__ import annotations

import math

import pytest
import torch
from runtime_cases import max_abs, random_doc_lengths, solve_any
from timing import scaled

from planner_service.core.plan import Plan
from worker_runtime import ContextParallelAttention
from worker_runtime.paths.segment_kernels import ReferenceSegments
from worker_runtime.reference import document_mask
from worker_runtime.sinks import check_sink, merge_sink_, sink_grad
from worker_runtime.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns gloo worlds

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
TOL = 1e-10
STRATEGIES = ("flashcp", "per_doc", "zigzag", "ring")
PATHS = ("lean", "lean_no_overlap", "ring", "segments", "segment_ring", "gathered")
"""Every execution path: the torch kernel's gather modes (overlapped or not) and ring, the
segments path and segment ring with the exact reference segment kernel, and the gathered
path (forced; on CPU it runs the reference segment kernel)."""


def sink_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor,
                   doc_lengths: list[int]) -> torch.Tensor:
    """Dense document-masked attention with a sink column (logit ``sink[h]``, value 0)."""
    s, h, d = q.shape
    rep = h // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1)) / math.sqrt(d)
    scores = scores.masked_fill(~document_mask(doc_lengths), -math.inf)
    column = sink[:, None, None].expand(h, s, 1)
    probs = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(rep, 1))


def inputs(total: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(total, HEADS, HEAD_DIM), (total, KV_HEADS, HEAD_DIM), (total, KV_HEADS, HEAD_DIM),
              (total, HEADS, HEAD_DIM), (HEADS,)]
    q, k, v, w, sink = (torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes)
    return q, k, v, w, 2.0 * sink


def runtime(plan: Plan, path: str) -> ContextParallelAttention:
    ring = plan.comm_mode == "p2p_ring"
    mode = "p2p_ring" if path in ("ring", "segment_ring") else ("full" if ring else None)
    kern = ReferenceSegments() if path in ("segments", "segment_ring") else None
    attn = ContextParallelAttention(plan, comm_mode=mode, overlap=path != "lean_no_overlap",
                                    segment_kernel=kern)
    if path == "gathered":
        attn.execution_path = lambda q: ("gathered", None)  # type: ignore[method-assign]
    return attn


def worker(rank: int, world_size: int, plan_jsons: list[str]) -> dict:
    import torch.distributed as dist

    results = {}
    for ci, text in enumerate(plan_jsons):
        plan = Plan.from_json(text)
        q, k, v, w, sink = inputs(sum(plan.doc_lengths), ci)
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
        ref = sink_reference(*leaves, plan.doc_lengths)
        ref_grads = torch.autograd.grad((ref * w).sum(), leaves)
        for path in PATHS:
            attn = runtime(plan, path)
            local = [attn.dispatch(t).requires_grad_() for t in (q, k, v)]
            s = sink.clone().requires_grad_()
            out = attn(*local, sink=s)
            (out * attn.dispatch(w)).sum().backward()
            assert s.grad is not None
            d_sink = s.grad.clone()
            dist.all_reduce(d_sink)  # each rank's part: its own queries
            errors = [max_abs(out - attn.dispatch(ref.detach()))]
            errors += [max_abs(t.grad - attn.dispatch(g)) for t, g in zip(local, ref_grads[:3], strict=True)]
            errors.append(max_abs(d_sink - ref_grads[3]))
            results[(ci, path)] = {"errors": errors, "path": attn.execution_path(local[0])[0]}
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_sinks_are_exact_on_every_path_with_their_gradient(world_size: int) -> None:
    lengths = random_doc_lengths(300 + world_size, world_size)
    plans = [solve_any(lengths, world_size, s) for s in STRATEGIES]
    per_rank = run_distributed(worker, world_size, [p.to_json() for p in plans], timeout_s=scaled(180.0))
    for ci, plan in enumerate(plans):
        for path in PATHS:
            for rank, res in enumerate(per_rank):
                got = res[(ci, path)]
                where = f"{plan.strategy} {path} rank {rank}"
                want_path = "lean" if path == "lean_no_overlap" else path
                assert got["path"] == want_path, where
                assert max(got["errors"]) <= TOL, f"{where}: errors (out, dq, dk, dv, dsink) {got['errors']}"


def test_the_sink_changes_the_output_and_merges_by_log_sum_exp() -> None:
    """One rank, no distribution: the sink really enters (the output differs from no sink),
    a -inf sink is no sink, and the helper's gradient equals autograd through the merge."""
    lengths = [5, 17, 9]
    plan = solve_any(lengths, 1, "per_doc")
    q, k, v, w, sink = inputs(sum(lengths), 7)
    attn = ContextParallelAttention(plan)
    plain = attn(q, k, v)
    with_sink = attn(q, k, v, sink=sink)
    assert max_abs(with_sink - plain) > 1e-2
    assert max_abs(attn(q, k, v, sink=torch.full((HEADS,), -math.inf, dtype=torch.float64)) - plain) == 0.0
    assert max_abs(with_sink - sink_reference(q, k, v, sink, lengths)) <= TOL
    # merge_sink_ / sink_grad against autograd on a tiny (out, lse) pair.
    gen = torch.Generator().manual_seed(3)
    out, lse, dout = (torch.randn(s, generator=gen, dtype=torch.float64) for s in ((6, 4, 3), (6, 4), (6, 4, 3)))
    s = sink.clone().requires_grad_()
    merged = out * torch.exp(lse - torch.logaddexp(lse, s))[..., None]
    (auto,) = torch.autograd.grad((merged * dout).sum(), s)
    o2, l2 = out.clone(), lse.clone()
    merge_sink_(o2, l2, sink)
    assert max_abs(o2 - merged.detach()) <= 1e-15
    got = sink_grad(l2, (dout * o2).sum(-1), sink)
    assert got is not None and max_abs(got - auto) <= 1e-14


def test_rejects_a_sink_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match=r"sink must be a floating tensor of shape \[4\]"):
        check_sink(torch.zeros(3), 4)
    with pytest.raises(ValueError, match="sink must be a floating tensor"):
        check_sink(torch.zeros(4, dtype=torch.int64), 4)
