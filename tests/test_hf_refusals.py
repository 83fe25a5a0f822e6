"""What the CP attention cannot run exactly is refused in one line naming the option, the
layer and the config field: at ``enable_cp_attention`` (non-attention mixers, soft-capping,
families that bypass the attention interface), or by the attention function itself (unknown
keywords, soft-capping, bidirectional calls, a padding mask with zeros). One process, a
one-rank plan.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from hf_reference import KeepFloat64

from planner_service.core.model import ModelSpec
from planner_service.core.plan import Plan
from planner_service.core.request import PlanRequest
from planner_service.solvers.registry import solve
from worker_runtime import ContextParallelAttention
from worker_runtime.hf import (
    HARMLESS_KEYWORDS,
    check_plan,
    cp_attention_forward,
    enable_cp_attention,
    prepare_batch,
    use_cp_attention,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install -e '.[hf]')")

SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "max_position_embeddings": 128, "pad_token_id": 0}


def one_rank_plan(lengths: list[int]) -> Plan:
    return solve(PlanRequest(doc_lengths=lengths, cp_size=1, strategy="per_doc",
                             model=ModelSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype_bytes=8)))


def model_of(name: str, **fields: Any) -> Any:
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{name}Config")(**{**SMALL, **fields})
    return getattr(transformers, f"{name}ForCausalLM")(config).to(torch.float64).eval()


def test_rejects_soft_capping_at_enable_naming_the_config_field() -> None:
    with pytest.raises(ValueError, match=r"^attn_logit_softcapping: .*set config\.attn_logit_softcapping = None$"):
        enable_cp_attention(model_of("Gemma2"))


def test_rejects_linear_attention_layers_at_enable_naming_layer_and_field() -> None:
    model = model_of("Qwen3Next", num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                     layer_types=["full_attention", "linear_attention"])
    with pytest.raises(ValueError, match=r"^layer 1 is 'linear_attention', which the CP runtime does not implement .*config\.layer_types\[1\]"):
        enable_cp_attention(model)


def test_rejects_a_convolution_mixer_naming_its_layer() -> None:
    model = model_of("Llama")
    model.model.layers[1].short_conv = torch.nn.Conv1d(32, 32, 3, groups=32)
    with pytest.raises(ValueError, match=r"^layer 1 has a convolution over the sequence \(Conv1d at "
                                         r"model\.layers\.1\.short_conv\)"):
        enable_cp_attention(model)


def test_rejects_a_family_that_bypasses_the_attention_interface() -> None:
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4))
    with pytest.raises(ValueError, match=r"^attn_implementation: BloomForCausalLM does not route its attention"):
        enable_cp_attention(model)


def test_runs_a_window_shorter_than_a_document_exactly() -> None:
    """Window 8 on documents of 5 and 17 tokens: equal to each document alone (eager,
    transformers' own sliding-window mask); check_plan accepts the plan."""
    model = model_of("Mistral", sliding_window=8)
    ids = torch.randint(3, 64, (22,), generator=torch.Generator().manual_seed(0))
    model.set_attn_implementation("eager")
    with torch.no_grad(), KeepFloat64():
        want = torch.cat([model(input_ids=ids[None, lo:hi], position_ids=torch.arange(hi - lo)[None]).logits[0]
                          for lo, hi in ((0, 5), (5, 22))])
        causal = model_of("Mistral", sliding_window=None)
        causal.set_attn_implementation("eager")
        unwindowed = causal(input_ids=ids[None, 5:22], position_ids=torch.arange(17)[None]).logits[0]
    assert (unwindowed - want[5:]).abs().max().item() > 1e-6, "the window must change the logits"
    enable_cp_attention(model)
    plan = one_rank_plan([5, 17])
    check_plan(model, plan)
    attn = ContextParallelAttention(plan)
    with torch.no_grad(), KeepFloat64(), use_cp_attention(attn):
        got = model(**prepare_batch(attn, ids)).logits[0]
    assert (got - want).abs().max().item() <= 1e-12


def test_check_plan_needs_an_enabled_model() -> None:
    with pytest.raises(ValueError, match=r"^check_plan: the model was not passed to enable_cp_attention"):
        check_plan(model_of("Mistral", sliding_window=8), one_rank_plan([5, 17]))


class _Module(torch.nn.Module):
    layer_idx = 3


def _call(**kwargs: Any) -> Any:
    attn = ContextParallelAttention(one_rank_plan([4, 6]))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 10, 8, dtype=torch.float64, generator=gen)
    k = torch.randn(1, 2, 10, 8, dtype=torch.float64, generator=gen)
    return cp_attention_forward(_Module(), q, k, k.clone(), None, cp_attention=attn, **kwargs)


def test_attention_function_refuses_unknown_keywords_naming_them() -> None:
    with pytest.raises(ValueError, match=r"^position_bias: attention keyword not implemented by the CP runtime \(layer 3"):
        _call(position_bias=torch.zeros(1))
    with pytest.raises(ValueError, match=r"^softcap: attention soft-capping \(30.0, layer 3\)"):
        _call(softcap=30.0)
    with pytest.raises(ValueError, match=r"^is_causal: bidirectional attention \(layer 3\)"):
        _call(is_causal=False)
    with pytest.raises(ValueError, match=r"^sliding_window: the window of layer 3 must be None or an integer >= 1, got 0"):
        _call(sliding_window=0)
    assert not torch.equal(_call()[0], _call(sliding_window=5)[0])  # a window that bites runs
    # Harmless keywords pass and change nothing; so do a causal flag, no soft-cap, a wide window.
    plain = _call()[0]
    harmless = {k: None for k in HARMLESS_KEYWORDS}
    same = _call(**harmless, is_causal=True, softcap=None, sliding_window=6, output_attentions=False)[0]
    assert torch.equal(plain, same)


def test_refuses_a_padding_mask_with_zeros_and_allows_an_all_ones_one() -> None:
    model = enable_cp_attention(model_of("Llama"))
    attn = ContextParallelAttention(one_rank_plan([5, 17]))
    batch = prepare_batch(attn, torch.randint(3, 64, (22,), generator=torch.Generator().manual_seed(0)))
    ones = torch.ones_like(batch["input_ids"])
    with torch.no_grad(), use_cp_attention(attn):
        plain = model(**batch).logits
        assert torch.equal(model(**batch, attention_mask=ones).logits, plain)
        ones[0, 3] = 0
        with pytest.raises(ValueError, match=r"^attention_mask: a padding mask with zeros is not implemented"):
            model(**batch, attention_mask=ones)
