"""A tiny Llama (random weights, nothing downloaded) trains with context parallelism on 4
gloo ranks exactly as it trains in one process with document masks.

transformers is imported where a model is built, so that collecting this module (every
pytest-xdist worker collects every module) does not pay for it.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from timing import scaled

from planner_service.core.model import ModelSpec
from planner_service.core.plan import Plan
from planner_service.core.request import PlanRequest
from planner_service.solvers.registry import solve
from worker_runtime import ContextParallelAttention
from worker_runtime.hf import (
    enable_cp_attention,
    next_token_labels,
    prepare_batch,
    use_cp_attention,
)
from worker_runtime.testing import run_distributed

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                       reason="transformers is not installed (pip install -e '.[hf]')"),
    pytest.mark.slow,  # five processes import torch and transformers
]

DOC_LENGTHS = [23, 1, 9, 61, 4, 17, 2, 30, 11]
WORLD_SIZE = 4
STEPS = 3
LR = 0.5
VOCAB = 64


def tiny_model(attn_implementation: str = "sdpa") -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attn_implementation=attn_implementation,
    )
    return LlamaForCausalLM(config).float()


def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (sum(DOC_LENGTHS),), generator=torch.Generator().manual_seed(1))


def sgd_step(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
            p.grad = None


def cp_training_worker(rank: int, world_size: int, plan_json: str) -> dict:
    import torch.distributed as dist

    model = enable_cp_attention(tiny_model())
    attn = ContextParallelAttention(Plan.from_json(plan_json))
    batch = prepare_batch(attn, input_ids())
    losses = []
    for _ in range(STEPS):
        with use_cp_attention(attn):
            loss = model(**batch).loss
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # local losses are summands of the global mean loss
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
        sgd_step(model)
    return {"losses": losses, "params": {k: v.numpy() for k, v in model.state_dict().items()}}


def reference_training() -> tuple[list[float], dict[str, np.ndarray]]:
    """One process, whole packed sequence; transformers builds the document mask itself
    from position ids that restart at every doc."""
    model = tiny_model("sdpa")
    ids = input_ids()
    labels = next_token_labels(ids, DOC_LENGTHS)[None]
    positions = torch.cat([torch.arange(n) for n in DOC_LENGTHS])[None]
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids[None], position_ids=positions, labels=labels, shift_labels=labels,
                     num_items_in_batch=int((labels != -100).sum()), use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        sgd_step(model)
    return losses, {k: v.numpy() for k, v in model.state_dict().items()}


def test_tiny_llama_trains_with_cp_like_single_process() -> None:
    model_spec = ModelSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype_bytes=4)
    plan = solve(PlanRequest(doc_lengths=DOC_LENGTHS, cp_size=WORLD_SIZE, strategy="flashcp",
                             model=model_spec))
    assert plan.metrics.num_split_docs > 0, "the test needs docs split across ranks"
    ref_losses, ref_params = reference_training()
    per_rank = run_distributed(cp_training_worker, WORLD_SIZE, plan.to_json(),
                               timeout_s=scaled(150.0))
    assert ref_losses[-1] < ref_losses[0], "training should reduce the loss"
    for res in per_rank:
        np.testing.assert_allclose(res["losses"], ref_losses, rtol=1e-5, atol=0)
        for name, want in ref_params.items():
            np.testing.assert_allclose(res["params"][name], want, rtol=0, atol=1e-6, err_msg=name)
