"""PyTorch's own FlashAttention kernels on CUDA (``gpu``-marked; skipped without CUDA): the
adapter per call against the float32 reference on the same bf16 inputs (hollow and
zero-query segments, GQA 4:1), every path of whole 4-rank plans against the float64
reference within TransformerEngine's bf16 CP tolerance, and the runtime choosing this
kernel by default. No flash-attn needed. The CPU tests of the same contract:
test_runtime_aten.py (a stand-in of the ops).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_cases import bf16_against_reference

from bench.gpu_check_stages import simulate_gathered
from planner_service.core.model import ModelSpec
from planner_service.core.request import PlanRequest
from planner_service.solvers.registry import solve
from worker_runtime import ContextParallelAttention
from worker_runtime.aten_flash import AtenSegments, aten_segments
from worker_runtime.paths.segment_kernels import ReferenceSegments
from worker_runtime.simulate import simulate_segment_ring, simulate_segments

TE_BF16_TOL = 2.5e-2
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def kernel() -> AtenSegments:
    found = aten_segments(CUDA, torch.bfloat16, 128)
    assert found is not None, "PyTorch's FlashAttention refused on this GPU (see the warning)"
    return found


@pytest.mark.parametrize(("lq", "lk", "causal"), [
    ([1, 300, 77, 513], [1, 429, 80, 1213], True),
    ([3, 200, 0, 64], [5, 0, 1000, 64], False),  # a hollow and a zero-query segment
])
def test_aten_segments_match_reference_in_bf16(lq, lk, causal) -> None:
    kern, ref = kernel(), ReferenceSegments()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(sum(lq), 8, 128, generator=gen, device=CUDA).to(torch.bfloat16) for _ in "qd")
    k, v = (torch.randn(sum(lk), 2, 128, generator=gen, device=CUDA).to(torch.bfloat16) for _ in "kv")
    cu_q, cu_k = np.cumsum([0, *lq]), np.cumsum([0, *lk])
    meta, ref_meta = kern.meta(cu_q, cu_k, causal, CUDA), ref.meta(cu_q, cu_k, causal, CUDA)
    out, lse = kern.forward(q, k, v, meta, 0.09)
    want_out, want_lse = ref.forward(q.float(), k.float(), v.float(), ref_meta, 0.09)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (8, sum(lq))
    seen = torch.from_numpy(np.repeat(np.array(lk) > 0, lq)).to(CUDA)
    assert torch.isinf(lse[:, ~seen]).all() and (lse[:, ~seen] > 0).all()  # +inf on hollow rows
    torch.testing.assert_close(out[seen].float(), want_out[seen], atol=TE_BF16_TOL, rtol=TE_BF16_TOL)
    torch.testing.assert_close(lse[:, seen], want_lse[:, seen], atol=TE_BF16_TOL, rtol=TE_BF16_TOL)
    merged_out = torch.where(seen[:, None, None], want_out, 0.0)
    merged_lse = torch.where(seen[None, :], want_lse, 0.0)
    got = kern.backward(do, q, k, v, merged_out.to(torch.bfloat16), merged_lse, meta, 0.09)
    want = ref.backward(do.float(), q.float(), k.float(), v.float(), merged_out, merged_lse, ref_meta, 0.09)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        a, b = (a[seen], b[seen]) if name == "dq" else (a, b)
        torch.testing.assert_close(a.float(), b, atol=TE_BF16_TOL, rtol=TE_BF16_TOL, msg=name)


@pytest.mark.parametrize("strategy", ["per_doc", "flashcp", "llama3", "zigzag"])
@pytest.mark.parametrize("path", ["segments", "segment_ring", "gathered"])
def test_every_path_on_the_aten_kernel_matches_reference_in_bf16(strategy: str, path: str) -> None:
    kern = kernel()
    run = {"segments": simulate_segments, "segment_ring": simulate_segment_ring,
           "gathered": simulate_gathered}[path]
    bf16_against_reference(strategy, lambda plan, *qkv: run(plan, *qkv, kern), f"{strategy} {path}")


def test_the_runtime_runs_the_aten_kernel_by_default() -> None:
    plan = solve(PlanRequest(doc_lengths=[700, 33, 5], cp_size=1, strategy="flashcp",
                             model=ModelSpec(num_heads=8, num_kv_heads=2, head_dim=128)))
    attn = ContextParallelAttention(plan)
    q = torch.zeros(attn.num_tokens, 8, 128, dtype=torch.bfloat16, device=CUDA)
    record = attn.kernel_record(q)
    assert record["kernel"] == "aten" and record["path"] == "segments", record
