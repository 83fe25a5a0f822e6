"""Varlen kernels: the exact PyTorch kernel against dense per-segment attention (CPU),
flash-attn against the float64 reference (GPU, bf16, TransformerEngine's CP tolerance)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_cases import bf16_against_reference

from planner_service.core.request import PlanRequest
from planner_service.solvers.registry import solve
from worker_runtime import (
    GATHER_MODES,
    build_meta,
    flash_attn_available,
    reference_attention,
    varlen_attention,
)
from worker_runtime.simulate import simulate_plan

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_flash = pytest.mark.skipif(
    not (torch.cuda.is_available() and flash_attn_available(torch.device("cuda"))),
    reason="needs CUDA and flash-attn",
)


def dense_segments(q, k, v, lq, lk, scale):
    """Each segment alone: bottom-right causal attention, the obvious way."""
    outs, q0, k0 = [], 0, 0
    r = q.shape[1] // k.shape[1]
    for nq, nk in zip(lq, lk, strict=True):
        qs, ks, vs = q[q0 : q0 + nq], k[k0 : k0 + nk], v[k0 : k0 + nk]
        s = torch.einsum("qhd,khd->hqk", qs, ks.repeat_interleave(r, 1)) * scale
        allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
        p = torch.softmax(s.masked_fill(~allowed, -math.inf), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vs.repeat_interleave(r, 1)))
        q0, k0 = q0 + nq, k0 + nk
    return torch.cat(outs)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 20), st.integers(0, 15)), min_size=1, max_size=6),
    st.sampled_from([(2, 1), (4, 2), (3, 3)]),
    st.integers(1, 9),
    st.integers(1, 13),
)
def test_torch_kernel_equals_dense_segments_forward_and_backward(segments, heads, block_q, block_k):
    lq = [nq for nq, _ in segments]
    lk = [nq + extra for nq, extra in segments]
    h, g = heads
    gen = torch.Generator().manual_seed(sum(lq))
    q = torch.randn(sum(lq), h, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(sum(lk), g, 5, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv")
    meta = build_meta(np.cumsum([0, *lq]), np.cumsum([0, *lk]), block_q=block_q, block_k=block_k)
    out = varlen_attention(q, k, v, meta, 0.37, "torch")
    ref = dense_segments(q, k, v, lq, lk, 0.37)
    assert (out - ref).abs().max().item() <= 1e-12
    w = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max().item() <= 1e-12


def test_torch_kernel_passes_gradcheck() -> None:
    gen = torch.Generator().manual_seed(0)
    meta = build_meta(np.array([0, 3, 4]), np.array([0, 5, 9]), block_q=2, block_k=3)
    q = torch.randn(4, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(9, 1, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv")
    assert torch.autograd.gradcheck(lambda *t: varlen_attention(*t, meta, 0.5, "torch"), (q, k, v))


def test_rejects_more_queries_than_keys_and_unknown_kernel() -> None:
    with pytest.raises(ValueError, match="every segment Lq <= Lk"):
        build_meta(np.array([0, 4]), np.array([0, 3]))
    meta = build_meta(np.array([0, 1]), np.array([0, 1]))
    x = torch.zeros(1, 1, 2)
    with pytest.raises(ValueError, match="kernel must be one of"):
        varlen_attention(x, x, x, meta, 1.0, "xformers")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="kernel='flash' needs CUDA"):
            varlen_attention(x, x, x, meta, 1.0, "flash")


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("strategy", ["per_doc", "flashcp", "llama3"])
@pytest.mark.parametrize("mode", GATHER_MODES)
def test_flash_attn_forward_backward_bf16_matches_reference(strategy: str, mode: str) -> None:
    bf16_against_reference(
        strategy, lambda plan, *qkv: simulate_plan(plan, mode, *qkv, kernel="flash").output,
        f"{strategy} {mode}")


@pytest.mark.gpu
@cuda
def test_torch_kernel_on_cuda_float64_is_exact() -> None:
    lengths = [3, 70, 1, 129]
    plan = solve(PlanRequest(doc_lengths=lengths, cp_size=2, strategy="per_doc"))
    q, k, v = (torch.randn(203, h, 16, device="cuda", dtype=torch.float64) for h in (4, 2, 2))
    sim = simulate_plan(plan, "alltoallv", q, k, v, kernel="torch")
    assert (sim.output - reference_attention(q, k, v, lengths)).abs().max().item() <= 1e-10
