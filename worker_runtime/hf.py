"""Hugging Face transformers integration (optional extra ``hf``).

``enable_cp_attention(model)`` registers the context-parallel attention in transformers'
``AttentionInterface`` under ``"cp_planner"`` and switches the model to it. During a
forward pass the active runtime comes from ``use_cp_attention(attn)`` (a context
variable) or from a ``cp_attention=attn`` keyword passed to the model call (transformers
forwards extra keywords to the attention function).

Each rank feeds its local tokens as a batch of one (``prepare_batch``): local input ids,
doc-relative position ids (RoPE restarts at every doc), and next-token labels computed
in the global order before dispatch, so a doc's last token never predicts the next doc.
The plan is the mask: ``cp_attention_mask`` (registered as the mask function) builds none
and refuses a padding mask with zeros. ``enable_cp_attention`` refuses, before the first
step, what the runtime cannot run exactly (``hf_check.py``); the attention function refuses
any keyword it does not implement (HARMLESS_KEYWORDS lists the ones it may ignore).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from planner_service.core.mask import from_hf_config
from planner_service.core.plan import Plan
from worker_runtime.attention import ContextParallelAttention
from worker_runtime.hf_check import ModelSupport, inspect_model

ATTN_IMPLEMENTATION = "cp_planner"
IGNORE_INDEX = -100
SUPPORT_ATTRIBUTE = "_cp_planner_support"
_ACTIVE: ContextVar[ContextParallelAttention | None] = ContextVar("cp_attention", default=None)


HARMLESS_KEYWORDS = {
    "position_ids": "positions are applied (RoPE) before attention; the plan's are doc-relative",
    "cu_seq_lens_q": "packed-sequence metadata for other kernels: the plan's shards are the documents",
    "cu_seq_lens_k": "packed-sequence metadata for other kernels: the plan's shards are the documents",
    "max_length_q": "packed-sequence metadata for other kernels: the plan's shards are the documents",
    "max_length_k": "packed-sequence metadata for other kernels: the plan's shards are the documents",
    "seq_idx": "packed-sequence metadata for other kernels: the plan's shards are the documents",
    "num_items_in_batch": "loss normalisation, forwarded to every layer",
    "shift_labels": "loss labels, forwarded to every layer",
    "labels": "loss labels, forwarded to every layer",
    "output_hidden_states": "output option, forwarded to every layer",
    "output_router_logits": "MoE output option, forwarded to every layer",
    "use_cache": "output option (prepare_batch sets False)",
    "return_dict": "output option, forwarded to every layer",
}
"""Keywords transformers (5.x: ``TransformersKwargs``, ``FlashAttentionKwargs`` and the model
families' attention calls) passes to an attention function that do not change the
attention: accepted and ignored. Checked keywords: ``sliding_window`` (the layer's window,
run exactly: ``attention(window=)``; None: causal), ``s_aux`` (attention sinks, one logit per
head), ``softcap`` (refused unless None or 0), ``is_causal`` (refused if False),
``output_attentions`` (refused if true: no weights are formed). Any other keyword is
refused."""

CHECKED_KEYWORDS = ("sliding_window", "s_aux", "softcap", "is_causal", "output_attentions")


def _where(module: Any) -> str:
    layer = getattr(module, "layer_idx", None)
    return f"layer {layer}" if layer is not None else type(module).__name__


def _check_keywords(module: Any, attn: ContextParallelAttention, kwargs: dict[str, Any]) -> None:
    """Raise ValueError for a keyword the CP attention cannot honour (HARMLESS_KEYWORDS)."""
    where = _where(module)
    unknown = sorted(k for k in kwargs if k not in HARMLESS_KEYWORDS and k not in CHECKED_KEYWORDS)
    if unknown:
        raise ValueError(f"{unknown[0]}: attention keyword not implemented by the CP runtime ({where}, "
                         f"{type(module).__name__}); it would be dropped, so the model is refused "
                         f"(known: {', '.join(sorted((*HARMLESS_KEYWORDS, *CHECKED_KEYWORDS)))})")
    softcap = kwargs.get("softcap")
    if softcap:
        raise ValueError(f"softcap: attention soft-capping ({softcap}, {where}) is not implemented by "
                         f"the CP runtime's kernels; set config.attn_logit_softcapping = None")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise ValueError(f"is_causal: bidirectional attention ({where}) is not implemented by the CP "
                         f"runtime (causal only)")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions: the CP runtime forms no attention weights; pass "
                         "output_attentions=False")
    window = kwargs.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window: the window of {where} must be None or an integer >= 1, "
                         f"got {window!r}")


def cp_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cp_attention: ContextParallelAttention | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, H, T, D]``, ``key/value [1, G, T, D]``
    -> ``([1, T, H, D], None)``.

    ``s_aux`` (attention sinks, ``[H]``) is merged exactly (``sinks.py``). Raises
    RuntimeError if no runtime is active; ValueError for batch size != 1, dropout, an
    attention mask (the plan defines the document mask), a sliding window below 1,
    soft-capping, non-causal attention, or any keyword outside HARMLESS_KEYWORDS and
    CHECKED_KEYWORDS. A layer's ``sliding_window`` W runs exactly as the runtime's
    ``window=W`` (the query at p attends keys ``p - W + 1 .. p``, transformers' mask).
    """
    attn = cp_attention if cp_attention is not None else _ACTIVE.get()
    if attn is None:
        raise RuntimeError(
            "no ContextParallelAttention is active: wrap the model call in "
            "`with use_cp_attention(attn):` or pass cp_attention=attn"
        )
    if query.shape[0] != 1:
        raise ValueError(f"batch size must be 1 (one packed sequence per rank), got {query.shape[0]}")
    if dropout:
        raise ValueError(f"attention dropout must be 0 with context parallelism, got {dropout}")
    if attention_mask is not None:
        raise ValueError("attention_mask must be None: the plan's shards define the document mask")
    _check_keywords(module, attn, kwargs)
    head_dim_v = value.shape[-1]
    if head_dim_v > key.shape[-1]:
        raise ValueError(f"value head dim {head_dim_v} exceeds the query/key head dim {key.shape[-1]} "
                         f"({_where(module)}): not implemented by the CP runtime")
    if head_dim_v < key.shape[-1]:
        # Latent attention (MLA): zero columns of V give zero output columns; exact.
        value = torch.nn.functional.pad(value, (0, key.shape[-1] - head_dim_v))
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = attn(q, k, v, softmax_scale=scaling, sink=kwargs.get("s_aux"), window=kwargs.get("sliding_window"))
    return out[..., :head_dim_v].unsqueeze(0), None


def cp_attention_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    """transformers mask function for ``cp_planner``: no mask (the plan is the mask); a
    2-D padding mask with zeros is refused (ValueError), an all-ones one passes."""
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("attention_mask: a padding mask with zeros is not implemented by the CP "
                         "runtime (the plan's shards define the document mask); pack the real "
                         "tokens only and pass attention_mask=None")
    return None


def register_cp_attention(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register ``cp_attention_forward`` in transformers' AttentionInterface and
    ``cp_attention_mask`` in its AttentionMaskInterface (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, cp_attention_forward)
    AttentionMaskInterface.register(name, cp_attention_mask)
    return name


def enable_cp_attention(model: Any, name: str = ATTN_IMPLEMENTATION) -> Any:
    """Check ``model`` (``hf_check.inspect_model``), register the CP attention and switch
    ``model`` to it; returns the model. Raises ValueError, one line naming the option, the
    layer and the config field, for what the runtime cannot run exactly (non-attention
    mixers, soft-capping, bidirectional attention). Sliding-window layers run exactly, each
    call's ``sliding_window`` passed to the runtime."""
    support = inspect_model(model)
    model.set_attn_implementation(register_cp_attention(name))
    for module in model.modules():
        # A plain attribute (not a parameter or buffer): the attention function finds the
        # model's windows from whichever attention module it is called with.
        object.__setattr__(module, SUPPORT_ATTRIBUTE, support)
    return model


def planner_fields(model: Any) -> dict[str, Any]:
    """The request fields that give the planner ``model``'s attention, read from its config
    (``core.mask.from_hf_config``: ``layer_types``, ``sliding_window``): ``{"layers": [...]}``
    to merge into a client's ``request_defaults`` or a request body, ``{}`` when every layer
    is causal (so the request and its plan stay those of a request without a mask).
    ValueError naming the config field for what the planner cannot represent."""
    mask = from_hf_config(model.config)
    return {} if mask.is_causal else {"layers": mask.to_list()}


def check_plan(support: ModelSupport | Any, plan: Plan) -> None:
    """Check, before the first step, that ``plan`` can run ``support`` (a model passed to
    ``enable_cp_attention`` or its ``ModelSupport``). Every sliding window runs exactly
    whatever the documents' lengths, so nothing in a plan is refused; ValueError if the
    model was not passed to ``enable_cp_attention``."""
    if not isinstance(support, ModelSupport) and getattr(support, SUPPORT_ATTRIBUTE, None) is None:
        raise ValueError("check_plan: the model was not passed to enable_cp_attention")


@contextmanager
def use_cp_attention(attn: ContextParallelAttention) -> Iterator[ContextParallelAttention]:
    """Make ``attn`` the runtime every cp_planner attention call uses inside the block."""
    token = _ACTIVE.set(attn)
    try:
        yield attn
    finally:
        _ACTIVE.reset(token)


def next_token_labels(input_ids: torch.Tensor, doc_lengths: list[int] | tuple[int, ...]) -> torch.Tensor:
    """Global ``[S]`` labels: the next token inside the same doc, IGNORE_INDEX at doc ends."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:-1] = input_ids[1:]
    ends = torch.cumsum(torch.as_tensor(list(doc_lengths), device=input_ids.device), 0) - 1
    labels[ends] = IGNORE_INDEX
    return labels


def prepare_batch(attn: ContextParallelAttention, input_ids: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments for a causal-LM call on this rank's tokens of the global packed
    ``input_ids [S]``: local ids and doc-relative positions (batch of one), labels already
    shifted (``labels``/``shift_labels``), and ``num_items_in_batch`` = the global label
    count, so the local losses sum to the global mean loss."""
    labels = next_token_labels(input_ids, attn.plan.doc_lengths)
    local_labels = attn.dispatch(labels, pad_value=IGNORE_INDEX)[None]
    return {
        "input_ids": attn.dispatch(input_ids, pad_value=0)[None],
        "position_ids": torch.from_numpy(attn.positions).to(input_ids.device)[None],
        "labels": local_labels,
        "shift_labels": local_labels,
        "num_items_in_batch": int((labels != IGNORE_INDEX).sum()),
        "use_cache": False,
    }
