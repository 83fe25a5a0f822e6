"""Sliding-window transformers models train under the CP runtime exactly: a tiny Mistral
(a window of 8 in every layer), a tiny Qwen2 with ``use_sliding_window`` (layer 1
windowed, layer 0 full) and a tiny Gemma 3 (layer 0 windowed, layer 1 full) on 2 gloo
ranks, documents longer than the window split across the ranks, on the lean, ring and
segments paths, two training steps (an SGD step between them): the loss and every
parameter gradient of both steps within 1e-9 of each document run alone in one float64
process (transformers' own eager sliding-window mask).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from hf_reference import cp_train_steps, reference_steps
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
FAMILIES = {"Mistral": {}, "Qwen2": {"use_sliding_window": True, "max_window_layers": 1},
            "Gemma3": {"layer_types": ["sliding_attention", "full_attention"]}}
CLASSES = {"Gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
"""transformers class names where they are not ``{family}Config`` / ``{family}ForCausalLM``."""
LAYER_TYPES = {"Qwen2": ["full_attention", "sliding_attention"],
               "Gemma3": ["sliding_attention", "full_attention"]}
STEPS = 2
LR = 0.5
"""SGD step between the two steps (large, so the second step runs on visibly new weights)."""


def tiny(family: str) -> Any:
    import transformers

    config_name, model_name = CLASSES.get(family, (f"{family}Config", f"{family}ForCausalLM"))
    config = getattr(transformers, config_name)(**SMALL, **FAMILIES[family])
    if family in LAYER_TYPES:
        assert config.layer_types == LAYER_TYPES[family]
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).to(torch.float64).eval()


def input_ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (sum(DOC_LENGTHS),), generator=torch.Generator().manual_seed(2))


def reference(family: str) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Each step's loss and gradients, every document alone in one process."""
    return reference_steps(tiny(family), input_ids(), DOC_LENGTHS, STEPS, LR)


def worker(rank: int, world_size: int, plan_json: str) -> dict[str, Any]:

    from planner_service.core.plan import Plan
    from worker_runtime import ContextParallelAttention
    from worker_runtime.hf import enable_cp_attention
    from worker_runtime.paths.segment_kernels import ReferenceSegments

    plan = Plan.from_json(plan_json)
    results = {}
    for family in FAMILIES:
        for path in PATHS:
            model = enable_cp_attention(tiny(family))
            attn = ContextParallelAttention(plan, comm_mode="p2p_ring" if path == "ring" else "alltoallv",
                                            segment_kernel=ReferenceSegments() if path == "segments" else None)
            steps = cp_train_steps(model, attn, input_ids(), STEPS, LR)
            results[(family, path)] = steps
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
        for step, (ref_loss, ref_grads) in enumerate(reference(family)):
            for path in PATHS:
                got = per_rank[0][(family, path)][step]
                assert abs(got["loss"] - ref_loss) <= TOL, (family, path, step, got["loss"], ref_loss)
                for name, want in ref_grads.items():
                    err = float(abs(got["grads"][name] - want.numpy()).max())
                    assert err <= TOL, f"{family} {path} step {step} {name}: {err:.2e}"


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
