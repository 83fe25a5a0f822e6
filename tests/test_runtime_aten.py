"""PyTorch's own FlashAttention as the runtime's segment kernel, pinned on CPU through a
stand-in with the aten ops' exact contract (tests/aten_flash_standin.py): the stand-in's
signatures against this PyTorch's op schemas, the schema feature checks, the probe
(accepting the faithful stand-in, refusing a top-left causal alignment, a base-2 LSE and
dK on zero-query keys), the kernel choice with its one warning and the kernel record, and
the segments path, the segment ring and the gathered path on a spawned gloo world through
``AtenSegments`` against the float64 reference. The real kernels: test_runtime_aten_gpu.py.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from aten_flash_standin import STANDIN, variant
from runtime_cases import (
    MODEL,
    max_abs,
    random_doc_lengths,
    reference_case,
    run_against_reference,
    solve_any,
)
from timing import scaled

from planner_service.core.plan import Plan
from planner_service.core.request import PlanRequest
from planner_service.solvers.registry import solve
from worker_runtime import ContextParallelAttention, aten_flash, reference_attention
from worker_runtime.aten_flash import (
    BACKWARD_ARGS,
    FORWARD_ARGS,
    AtenOps,
    AtenSegments,
    aten_segments,
    check_schema,
    choose_kernel,
    load_aten_ops,
    schema_args,
)
from worker_runtime.paths.segment_kernels import (
    FlashApiError,
    ReferenceSegments,
    SegmentVarlen,
    probe,
)
from worker_runtime.simulate import simulate_segments
from worker_runtime.testing import run_distributed

TOL = 2e-6
"""float64 inputs, but the LSE is float32 as the kernels' is: the merge and the backward
round it (relative 6e-8), so outputs and gradients agree to ~1e-7, not to float64."""
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    """Each test sees an empty probe cache and no earlier warning."""
    monkeypatch.setattr(aten_flash, "_ATEN", {})
    monkeypatch.setattr(aten_flash, "_WARNED", [])


def use_standin(monkeypatch, ops: AtenOps = STANDIN) -> None:
    monkeypatch.setattr(aten_flash, "load_aten_ops", lambda: ops)


# -- the contract ---------------------------------------------------------------------------


def test_standin_takes_the_aten_ops_arguments_in_order() -> None:
    aten = torch.ops.aten
    assert schema_args(STANDIN.forward) == schema_args(aten._flash_attention_forward)
    assert schema_args(STANDIN.backward) == schema_args(aten._flash_attention_backward)
    ops = load_aten_ops()  # this PyTorch's schemas pass the feature check
    assert ops.forward is aten._flash_attention_forward


def test_schema_check_names_what_differs() -> None:
    def reordered(query, key, value, cum_seq_k, cum_seq_q, max_q, max_k, dropout_p, is_causal,
                  return_debug_mask, *, scale=None):
        pass

    def no_scale(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                 return_debug_mask, softmax_scale=None):
        pass

    def philox(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
               dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        pass

    with pytest.raises(FlashApiError, match="takes .*cum_seq_k', 'cum_seq_q'"):
        check_schema(reordered, FORWARD_ARGS, "fwd")
    with pytest.raises(FlashApiError, match="no keyword 'scale'"):
        check_schema(no_scale, FORWARD_ARGS, "fwd")
    check_schema(philox, BACKWARD_ARGS, "bwd")  # older builds' rng argument names


def test_standin_semantics_hollow_rows_lse_layout_and_gqa() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 8, generator=gen) for n, h in ((5, 4), (9, 2), (9, 2)))
    cu_q, cu_k = torch.tensor([0, 2, 2, 5], dtype=torch.int32), torch.tensor([0, 0, 4, 9], dtype=torch.int32)
    out, lse, *_ = STANDIN.forward(q, k, v, cu_q, cu_k, 3, 5, 0.0, True, False, scale=0.3)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (4, 5)
    assert (out[:2] == 0).all() and torch.isinf(lse[:, :2]).all() and (lse[:, :2] > 0).all()
    # Bottom-right: the last query of segment 2 (3 queries, 5 keys) sees all 5 keys.
    s = torch.einsum("hd,khd->hk", q[4].double(), k[4:9].double().repeat_interleave(2, 1)) * 0.3
    assert torch.allclose(lse[:, 4].double(), torch.logsumexp(s, -1), atol=1e-6)
    dq, dk, dv = STANDIN.backward(torch.ones_like(out), q, k, v, out, lse, cu_q, cu_k, 3, 5, 0.0,
                                  True, torch.zeros(2, dtype=torch.uint64), torch.empty(0), scale=0.3)
    assert dk.shape == k.shape and dv.shape == v.shape and (dq[:2] == 0).all()
    assert (dk[:4] == 0).all() and (dv[:4] == 0).all()  # zero-query segment's keys


# -- the probe ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_accepts_the_faithful_standin(dtype) -> None:
    probe(AtenSegments(STANDIN), CPU, dtype, 16)


@pytest.mark.parametrize(("flags", "message"), [
    ({"top_left": True}, r"probe: out differs .*causal=True"),
    ({"base2": True}, r"probe: lse differs"),
    ({"zero_query_dk": True}, r"probe: dk differs .*cu_q=\[0, 2, 2, 5, 6\]"),
    ({"ignore_window": True}, r"probe: out differs .*window=2"),
])
def test_probe_refuses_a_kernel_whose_answers_differ(monkeypatch, flags, message) -> None:
    with pytest.raises(FlashApiError, match=message):
        probe(AtenSegments(variant(**flags)), CPU, torch.float32, 16)
    use_standin(monkeypatch, variant(**flags))
    with pytest.warns(RuntimeWarning, match="PyTorch's FlashAttention .* cannot be used"):
        assert aten_segments(CPU, torch.float32, 16) is None


def test_refusal_falls_back_to_the_torch_kernel_with_one_warning(monkeypatch) -> None:
    plan = solve(PlanRequest(doc_lengths=[5, 3], cp_size=1, strategy="flashcp", model=MODEL))
    q = torch.zeros(8, 4, 16)
    # This CPU build's real ops have no CPU kernel: the probe refuses them.
    with pytest.warns(RuntimeWarning, match="falling back") as record:
        assert ContextParallelAttention(plan, kernel="aten").execution_path(q) == ("lean", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert aten_segments(CPU, torch.float64, 16) is None  # no second warning
        ring = solve(PlanRequest(doc_lengths=[5, 3], cp_size=1, strategy="ring", model=MODEL))
        assert ContextParallelAttention(ring, kernel="aten").execution_path(q) == ("ring", None)
    assert len(record) == 1
    with pytest.raises(ValueError, match="kernel must be one of auto, aten, aten-fa3"):
        ContextParallelAttention(plan, kernel="fa2")


def test_head_dim_and_activation_refusals(monkeypatch) -> None:
    use_standin(monkeypatch)
    with pytest.warns(RuntimeWarning, match="head_dim 12 is not a multiple of 8"):
        assert aten_segments(CPU, torch.float32, 12) is None
    monkeypatch.setattr(aten_flash, "_WARNED", [])
    monkeypatch.setattr(aten_flash, "flash_impl", lambda: "FA2")
    import torch.nn.attention as tna

    monkeypatch.setattr(tna, "list_flash_attention_impls", lambda: ["FA3"], raising=False)
    with pytest.warns(RuntimeWarning, match="impl FA4 is not registered"):
        assert aten_segments(CPU, torch.float32, 16, "aten-fa4") is None


def test_choice_and_kernel_record(monkeypatch) -> None:
    plan = solve(PlanRequest(doc_lengths=[5, 3], cp_size=1, strategy="flashcp", model=MODEL))
    q = torch.zeros(8, 4, 16)
    # auto on CPU: the torch kernel, no probe, no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_kernel("auto", q, "segments") == (None, False)
        assert ContextParallelAttention(plan).kernel_record(q)["kernel"] == "torch"
    use_standin(monkeypatch)
    attn = ContextParallelAttention(plan, kernel="aten")
    path, found = attn.execution_path(q)
    assert path == "segments" and isinstance(found, AtenSegments) and found.name == "aten"
    record = attn.kernel_record(q)
    assert record["kernel"] == "aten" and record["impl"] == "FA2" and record["path"] == "segments"
    assert record["torch"] == torch.__version__
    gathered = ContextParallelAttention(plan, kernel="aten", flash_path="gathered")
    assert gathered.execution_path(q) == ("gathered", found)


def test_aten_kernel_runs_whole_plans_in_one_process() -> None:
    """Every path's calls through AtenSegments (hollow and zero-query segments, GQA) in
    float64 against the reference, one process (``simulate_segments``)."""
    kern = AtenSegments(STANDIN)
    for strategy in ("llama3", "flashcp", "zigzag"):
        lengths = [1, 30, 7, 52, 3, 19]
        plan = solve(PlanRequest(doc_lengths=lengths, cp_size=3, strategy=strategy, model=MODEL))
        gen = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(112, h, MODEL.head_dim, generator=gen, dtype=torch.float64)
                   for h in (MODEL.num_heads, MODEL.num_kv_heads, MODEL.num_kv_heads))
        w = torch.randn(112, MODEL.num_heads, MODEL.head_dim, generator=gen, dtype=torch.float64)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = reference_attention(*leaves, lengths)
        want = torch.autograd.grad((ref * w).sum(), leaves)
        low = [x.clone().requires_grad_() for x in (q, k, v)]
        out = simulate_segments(plan, *low, kern)
        got = torch.autograd.grad((out * w).sum(), low)
        assert max_abs(out - ref) <= TOL, strategy
        assert max(max_abs(a - b) for a, b in zip(got, want, strict=True)) <= TOL, strategy


def test_segment_varlen_matches_the_reference_kernel() -> None:
    gen = torch.Generator().manual_seed(1)
    cu = np.array([0, 3, 10, 11])
    q, k, v = (torch.randn(11, h, 8, generator=gen, dtype=torch.float64).requires_grad_()
               for h in (4, 2, 2))
    grads = []
    for kern in (AtenSegments(STANDIN), ReferenceSegments()):
        out = SegmentVarlen.apply(q, k, v, kern, kern.meta(cu, cu, True, CPU), 8**-0.5)
        grads.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    assert max(max_abs(a - b) for a, b in zip(*grads, strict=True)) <= TOL


# -- a spawned gloo world -------------------------------------------------------------------

CASES = (("alltoallv", "segments", "segments"), ("full", "segments", "segments"),
         ("p2p_ring", "segments", "segment_ring"), ("alltoallv", "gathered", "gathered"),
         ("p2p_ring", "gathered", "gathered"))
"""(comm mode, flash path, the path it runs)."""


def worker(rank: int, world_size: int, plan_jsons: list[str]) -> dict:
    aten_flash.load_aten_ops = lambda: STANDIN  # this process only: the stand-in's ops
    results = {}
    for ci, text in enumerate(plan_jsons):
        plan = Plan.from_json(text)
        case = reference_case(plan, ci)
        for mode, flash_path, _ in CASES:
            attn = ContextParallelAttention(plan, comm_mode=mode, kernel="aten", flash_path=flash_path)
            _, errors = run_against_reference(attn, case)
            results[(ci, mode, flash_path)] = {
                "errors": errors, "record": attn.kernel_record(attn.dispatch(case.q))}
    return results


@pytest.mark.slow
def test_every_path_on_the_aten_kernel_matches_the_float64_reference() -> None:
    world_size = 3
    lengths = random_doc_lengths(700, world_size)
    plans = [solve_any(lengths, world_size, s) for s in ("flashcp", "zigzag", "llama3")]
    per_rank = run_distributed(worker, world_size, [p.to_json() for p in plans], timeout_s=scaled(240.0))
    for ci, plan in enumerate(plans):
        for mode, flash_path, path in CASES:
            for rank, res in enumerate(per_rank):
                got = res[(ci, mode, flash_path)]
                where = f"{plan.strategy} {mode} {flash_path} rank {rank}"
                assert got["record"]["path"] == path and got["record"]["kernel"] == "aten", where
                assert max(got["errors"]) <= TOL, f"{where}: errors {got['errors']}"
