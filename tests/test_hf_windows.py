"""Sliding-window transformers models train under the CP runtime exactly: a tiny Mistral
(a window of 8 in every layer) and a tiny Qwen2 with ``use_sliding_window`` (layer 1
windowed, layer 0 full) on 2 gloo ranks, documents longer than the window split across the
ranks, on the lean, ring and segments paths: the loss and every parameter gradient within
1e-9 of each document run alone in one float64 process (transformers' own eager
sliding-window mask).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from hf_reference import KeepFloat64, lm_loss, per_document_reference
from timing import scaled

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                       reason="transformers is not installed (pip install -e '.[hf]')"),
    pytest.mark.slow,
]

DOC_LENGTHS = [23, 5, 40, 9]
WINDOW = 8
WORLD_SIZE = 2
VOCAB = 64
TOL = 1e-9
PATHS = ("lean", "ring", "segments")
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "max_position_embeddings": 128, "pad_token_id": 0, "use_cache": False,
         "sliding_window": WINDOW}
FAMILIES = {"Mistral": {}, "Qwen2": {"use_sliding_window": True, "max_window_layers": 1}}


def tiny(family: str) -> Any:
    import transformers

    config = getattr(transformers, f"{family}Config")(**SMALL, **FAMILIES[family])
    if family == "Qwen2":
        assert config.layer_types == ["full_attention", "sliding_attention"]
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(config).to(torch.float64).eval()


def input_ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (sum(DOC_LENGTHS),), generator=torch.Generator().manual_seed(2))


def reference(family: str) -> tuple[float, dict[str, torch.Tensor]]:
    return per_document_reference(tiny(family), input_ids(), DOC_LENGTHS)


def worker(rank: int, world_size: int, plan_json: str) -> dict[str, Any]:
    import torch.distributed as dist

    from planner_service.core.plan import Plan
    from worker_runtime import ContextParallelAttention
    from worker_runtime.hf import enable_cp_attention, prepare_batch, use_cp_attention
    from worker_runtime.paths.segment_kernels import ReferenceSegments

    plan = Plan.from_json(plan_json)
    results = {}
    for family in FAMILIES:
        model = enable_cp_attention(tiny(family))
        for path in PATHS:
            attn = ContextParallelAttention(plan, comm_mode="p2p_ring" if path == "ring" else "alltoallv",
                                            segment_kernel=ReferenceSegments() if path == "segments" else None)
            model.zero_grad(set_to_none=True)
            batch = prepare_batch(attn, input_ids())
            labels, total = batch.pop("labels")[0], batch.pop("num_items_in_batch")
            batch.pop("shift_labels")
            with KeepFloat64(), use_cp_attention(attn):
                loss = lm_loss(model(**batch).logits, labels, total)
                loss.backward()
            total_loss = loss.detach().clone()
            dist.all_reduce(total_loss)
            grads = {}
            for n, p in model.named_parameters():
                assert p.grad is not None, n
                dist.all_reduce(p.grad)
                grads[n] = p.grad.numpy().copy()  # numpy: tensors would cross as shared memory
            results[(family, path)] = {"loss": total_loss.item(), "grads": grads}
    return results


def test_sliding_window_models_train_exactly_on_every_path() -> None:
    from planner_service.core.model import ModelSpec
    from planner_service.core.request import PlanRequest
    from planner_service.solvers.registry import solve
    from worker_runtime.testing import run_distributed

    plan = solve(PlanRequest(doc_lengths=DOC_LENGTHS, cp_size=WORLD_SIZE, strategy="flashcp",
                             model=ModelSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype_bytes=8)))
    assert plan.metrics.num_split_docs > 0
    per_rank = run_distributed(worker, WORLD_SIZE, plan.to_json(), timeout_s=scaled(240.0))
    for family in FAMILIES:
        ref_loss, ref_grads = reference(family)
        for path in PATHS:
            got = per_rank[0][(family, path)]
            assert abs(got["loss"] - ref_loss) <= TOL, (family, path, got["loss"], ref_loss)
            for name, want in ref_grads.items():
                err = float(abs(got["grads"][name] - want.numpy()).max())
                assert err <= TOL, f"{family} {path} {name}: {err:.2e}"


def test_planner_fields_give_the_planner_the_models_mask() -> None:
    import transformers

    from planner_service.client import PlanClient
    from planner_service.core.mask import parse_mask
    from worker_runtime.hf import planner_fields

    assert planner_fields(tiny("Mistral")) == {"layers": [{"window": WINDOW, "count": 2}]}
    qwen = planner_fields(tiny("Qwen2"))
    assert parse_mask(layers=qwen["layers"]) == parse_mask(layers="1x8,1xfull")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: v for k, v in SMALL.items() if k != "sliding_window"}))
    assert planner_fields(llama) == {}
    client = PlanClient("embedded", cp_size=WORLD_SIZE, request_defaults=qwen)
    try:
        plan = client.plan(DOC_LENGTHS).plan
    finally:
        client.close()
    assert plan.mask == parse_mask(layers=qwen["layers"])
