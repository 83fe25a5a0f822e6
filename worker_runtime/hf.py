"""Hugging Face transformers integration (optional extra ``hf``).

``enable_cp_attention(model)`` registers the context-parallel attention in transformers'
``AttentionInterface`` under ``"cp_planner"`` and switches the model to it. During a
forward pass the active runtime comes from ``use_cp_attention(attn)`` (a context
variable) or from a ``cp_attention=attn`` keyword passed to the model call (transformers
forwards extra keywords to the attention function).

Each rank feeds its local tokens as a batch of one (``prepare_batch``): local input ids,
doc-relative position ids (RoPE restarts at every doc), and next-token labels computed
in the global order before dispatch, so a doc's last token never predicts the next doc.
transformers builds no mask for a custom attention; the plan is the mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from worker_runtime.attention import ContextParallelAttention

ATTN_IMPLEMENTATION = "cp_planner"
IGNORE_INDEX = -100
_ACTIVE: ContextVar[ContextParallelAttention | None] = ContextVar("cp_attention", default=None)


def cp_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cp_attention: ContextParallelAttention | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, H, T, D]``, ``key/value [1, G, T, D]``
    -> ``([1, T, H, D], None)``.

    Raises RuntimeError if no runtime is active, ValueError for batch size != 1, dropout,
    a sliding window or a dense attention mask (the plan defines the document mask).
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
    if kwargs.get("sliding_window") is not None:
        raise ValueError("sliding-window attention is not supported by the CP runtime (causal only)")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = attn(q, k, v, softmax_scale=scaling)
    return out.unsqueeze(0), None


def register_cp_attention(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register ``cp_attention_forward`` in transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, cp_attention_forward)
    return name


def enable_cp_attention(model: Any, name: str = ATTN_IMPLEMENTATION) -> Any:
    """Register the CP attention and switch ``model`` to it; returns the model."""
    model.set_attn_implementation(register_cp_attention(name))
    return model


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
