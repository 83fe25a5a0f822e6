"""What the CP attention can run exactly in a transformers model, found before the first
step: every refusal is one ``ValueError`` line naming the option, the layer and the config
field to change.

``inspect_model(model)`` (called by ``hf.enable_cp_attention``) refuses:

- layers that are not attention (config ``layer_types`` entries other than
  ``full_attention``/``sliding_attention``; modules of linear attention, state-space,
  recurrent or convolution mixers): the runtime shards the sequence for attention only, so
  such a mixer would see only its rank's tokens;
- attention soft-capping (``attn_logit_softcapping``): no kernel of the runtime applies it;
- bidirectional or encoder-decoder models (``is_causal``, ``is_encoder_decoder``);
- families whose attention does not go through transformers' ``AttentionInterface``
  (``_supports_attention_backend`` False: hand-written attention, ALiBi or learned
  positions computed from the local sequence).

Sliding windows are recorded per layer (``ModelSupport.windows``); the attention function
runs each layer's ``sliding_window`` exactly (``ContextParallelAttention.attention(window=)``),
whatever the documents' lengths.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
"""``config.layer_types`` entries the runtime runs (a sliding layer with its window)."""

MIXER_NAME = re.compile(
    r"Mamba|Rwkv|RWKV|LSTM|Lstm|DeltaNet|GatedDelta|KimiDelta|Lightning|ShortConv|Hyena|"
    r"Retention|Recurrent|Rglru|LinearAttention|LinearAttn|(?<![a-z])Ssm|SSM")
"""CamelCase words of module class names that mark sequence mixers other than attention
(case-sensitive, so that ``GptOssModel`` is not a state-space model)."""

HYBRID_FIELDS = ("layer_types", "layers_block_type", "hybrid_override_pattern", "block_types",
                 "attn_layer_indices", "attn_layer_period", "layers_type", "full_attn_idxs",
                 "linear_attn_config", "mamba_layers")
"""Config fields that place non-attention mixers (named in a refusal when present)."""


class LayerWindow(NamedTuple):
    """One sliding-window attention layer."""

    layer: int
    window: int
    """Tokens a query sees, itself included (transformers: key j visible iff i - W < j <= i)."""
    field: str
    """The config field that sets its size."""
    typed: bool = False
    """Whether ``config.layer_types`` makes this layer a sliding one."""


class ModelSupport(NamedTuple):
    """What ``inspect_model`` found in a model the runtime can run."""

    num_layers: int
    windows: tuple[LayerWindow, ...]


def text_config(model: Any) -> Any:
    config = model.config
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _layer_of(name: str) -> str:
    found = re.search(r"\.(\d+)(?:\.|$)", name)
    return f"layer {found.group(1)}" if found else f"module {name or '(root)'}"


def _hybrid_field(config: Any) -> str:
    present = [f for f in HYBRID_FIELDS if getattr(config, f, None) is not None]
    return (f"config.{present[0]}" if present
            else f"the model family itself ({type(config).__name__}: every layer has this mixer)")


def _mixer_problem(model: Any, config: Any) -> str | None:
    import torch

    types = getattr(config, "layer_types", None)
    if types is not None:
        for i, t in enumerate(types):
            if t not in ATTENTION_LAYER_TYPES:
                return (f"layer {i} is {t!r}, which the CP runtime does not implement (it runs "
                        f"{' and '.join(ATTENTION_LAYER_TYPES)} layers; a linear-attention, state-space "
                        f"or convolution mixer would see only its rank's tokens); change "
                        f"config.layer_types[{i}] or run this model without CP")
    for name, module in model.named_modules():
        cls = type(module).__name__
        conv = isinstance(module, torch.nn.Conv1d)
        if conv or MIXER_NAME.search(cls):
            kind = "a convolution over the sequence" if conv else "a non-attention sequence mixer"
            return (f"{_layer_of(name)} has {kind} ({cls} at {name}): the CP runtime shards the "
                    f"sequence for attention only, so it would see only its rank's tokens; change "
                    f"{_hybrid_field(config)} or run this model without CP")
    return None


def _windows(config: Any, num_layers: int) -> tuple[LayerWindow, ...]:
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return ()
    if types is not None:
        return tuple(LayerWindow(i, int(window), "config.sliding_window", typed=True)
                     for i, t in enumerate(types) if t == "sliding_attention")
    if getattr(config, "use_sliding_window", True) is False:
        return ()
    return tuple(LayerWindow(i, int(window), "config.sliding_window") for i in range(num_layers))


def inspect_model(model: Any) -> ModelSupport:
    """The model's sliding windows; raises ValueError (one line: option, layer, config field)
    for anything the CP runtime cannot run exactly (module docstring)."""
    config = text_config(model)
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("is_encoder_decoder: encoder-decoder models are not supported by the CP "
                         "runtime (causal self-attention only); config.is_encoder_decoder must be False")
    if getattr(config, "is_causal", True) is False:
        raise ValueError("is_causal: bidirectional attention is not implemented by the CP runtime "
                         "(causal only); set config.is_causal = True")
    problem = _mixer_problem(model, config)
    if problem:
        raise ValueError(problem)
    if getattr(model, "_supports_attention_backend", True) is False:
        raise ValueError(f"attn_implementation: {type(model).__name__} does not route its attention "
                         f"through transformers' AttentionInterface (_supports_attention_backend is "
                         f"False: its own attention code, masks or positions would run on each rank's "
                         f"tokens alone); use a family that supports attention backends")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        raise ValueError(f"attn_logit_softcapping: attention soft-capping ({softcap}, every layer from "
                         f"layer 0) is not implemented by the CP runtime's kernels; set "
                         f"config.attn_logit_softcapping = None")
    num_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    return ModelSupport(num_layers, _windows(config, num_layers))
