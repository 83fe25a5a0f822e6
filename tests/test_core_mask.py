"""The attention mask type (core/mask.py): canonical form, field errors, the request and
CLI shapes, and the masks of real transformers configs (built without weights)."""

import pytest
import transformers

from planner_service.core.errors import FieldError
from planner_service.core.mask import (
    CAUSAL,
    MAX_GROUPS,
    MAX_LAYERS,
    MAX_WINDOW,
    AttentionMask,
    LayerGroup,
    from_hf_config,
    parse_layers,
    parse_layers_text,
    parse_mask,
)


def gemma3_like() -> AttentionMask:
    return AttentionMask((LayerGroup(1024, 5), LayerGroup(None, 1)))


def test_equal_masks_compare_and_hash_equal_whatever_the_order_or_split():
    a = gemma3_like()
    b = AttentionMask((LayerGroup(None, 1), LayerGroup(1024, 2), LayerGroup(1024, 3)))
    assert a == b and hash(a) == hash(b)
    assert a.groups == (LayerGroup(1024, 5), LayerGroup(None, 1))
    assert a.num_layers == 6 and a.windows == (1024, None)
    assert a.weights() == pytest.approx((5 / 6, 1 / 6))
    # Counts are layer counts, not a ratio.
    assert AttentionMask((LayerGroup(1024, 10), LayerGroup(None, 2))) != a


def test_canonical_order_is_windows_ascending_causal_last():
    mask = AttentionMask((LayerGroup(None, 2), LayerGroup(4096, 1), LayerGroup(128, 3)))
    assert mask.windows == (128, 4096, None)
    assert mask.to_text() == "3x128,1x4096,2xfull"
    assert parse_layers_text(mask.to_text()) == mask
    assert parse_layers(mask.to_list()) == mask


def test_causal_constant():
    assert CAUSAL.is_causal and CAUSAL.groups == (LayerGroup(None, 1),)
    assert AttentionMask.uniform(None, 32).is_causal
    assert not AttentionMask.uniform(4096).is_causal
    assert parse_mask() == CAUSAL


@pytest.mark.parametrize("window,message", [
    (0, "window must be in [1, 2147483647] or null"),
    (-3, "window must be in [1,"),
    (MAX_WINDOW + 1, "window must be in [1,"),
    (1.5, "window must be an integer"),
    (True, "window must be an integer"),
    ("128", "window must be an integer"),
])
def test_rejects_bad_window(window, message):
    with pytest.raises(FieldError, match=message.replace("[", r"\[")) as info:
        parse_mask(window=window)
    assert info.value.field == "window"


@pytest.mark.parametrize("layers,field,message", [
    ([], "layers", "layers must not be empty"),
    ("", "layers", "layers must look like"),
    ({"window": 1}, "layers", "layers must be a non-empty list"),
    ([{"window": 1024}], "layers.0.count", "layers.0.count is required"),
    ([{"window": 1024, "count": 0}], "layers.0.count", "layers.0.count must be in [1, 65536]"),
    ([{"window": 1024, "count": 2.0}], "layers.0.count", "layers.0.count must be an integer"),
    ([{"window": 1024, "count": True}], "layers.0.count", "layers.0.count must be an integer"),
    ([{"window": None, "count": 1}, {"window": 0, "count": 1}], "layers.1.window",
     "layers.1.window must be in"),
    ([{"window": 8, "count": 1, "sinks": 4}], "layers.0.sinks", "layers.0.sinks is not a field"),
    ([3], "layers.0", "layers.0 must be an object"),
    ([{"window": w, "count": 1} for w in range(1, MAX_GROUPS + 2)], "layers",
     "at most 64 groups"),
    ([{"window": 8, "count": MAX_LAYERS}, {"window": None, "count": 1}], "layers",
     "at most 65536 layers"),
])
def test_rejects_bad_layers(layers, field, message):
    with pytest.raises(FieldError) as info:
        parse_mask(layers=layers)
    assert info.value.field == field
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("text", ["5x", "x1024", "5*1024", "5x1024,", "ax1", "5x-1", "5xnone",
                                  "0x8", "1x0", "5x1024;1xfull", "x" * 5000])
def test_rejects_bad_layers_text(text):
    with pytest.raises(FieldError) as info:
        parse_layers_text(text)
    assert info.value.field == "layers"
    assert str(info.value).startswith("layers") and len(str(info.value)) < 400


def test_parses_the_three_request_shapes():
    assert parse_mask(window=4096) == AttentionMask.uniform(4096)
    assert parse_mask(window=None, has_window=True) == CAUSAL
    json_shape = [{"window": 1024, "count": 5}, {"window": None, "count": 1}]
    assert parse_mask(layers=json_shape) == gemma3_like()
    assert parse_mask(layers="5x1024,1xfull") == gemma3_like()
    assert parse_mask(layers=" 5X1024 , 1xFULL ") == gemma3_like()


def test_rejects_window_and_layers_together():
    with pytest.raises(FieldError, match="layers and window are exclusive") as info:
        parse_mask(window=8, layers="1x8")
    assert info.value.field == "layers"


def test_rejects_a_mask_of_no_groups_or_foreign_items():
    with pytest.raises(FieldError, match="must not be empty"):
        AttentionMask(())
    with pytest.raises(FieldError, match="list of"):
        AttentionMask(((8, 1),))  # type: ignore[arg-type]


# transformers configs, constructed (no weights): family -> the mask the modeling code runs.
FAMILIES = [
    ("llama", lambda: transformers.LlamaConfig(num_hidden_layers=4), [(None, 4)]),
    ("mistral", lambda: transformers.MistralConfig(num_hidden_layers=4), [(4096, 4)]),
    ("mistral no window", lambda: transformers.MistralConfig(num_hidden_layers=3,
                                                             sliding_window=None), [(None, 3)]),
    ("mixtral", lambda: transformers.MixtralConfig(num_hidden_layers=2, sliding_window=512),
     [(512, 2)]),
    ("phi3", lambda: transformers.Phi3Config(num_hidden_layers=4, sliding_window=2047),
     [(2047, 4)]),
    ("phi3 default", lambda: transformers.Phi3Config(num_hidden_layers=4), [(None, 4)]),
    ("qwen2 default", lambda: transformers.Qwen2Config(num_hidden_layers=6), [(None, 6)]),
    ("qwen2 window off", lambda: transformers.Qwen2Config(
        num_hidden_layers=6, use_sliding_window=False, max_window_layers=2), [(None, 6)]),
    ("qwen2 sliding", lambda: transformers.Qwen2Config(
        num_hidden_layers=6, use_sliding_window=True, sliding_window=4096, max_window_layers=2),
     [(4096, 4), (None, 2)]),
    ("qwen2 all sliding", lambda: transformers.Qwen2Config(
        num_hidden_layers=6, use_sliding_window=True, sliding_window=128, max_window_layers=0),
     [(128, 6)]),
    ("gemma2", lambda: transformers.Gemma2Config(num_hidden_layers=6), [(4096, 3), (None, 3)]),
    ("gemma3 text", lambda: transformers.Gemma3TextConfig(num_hidden_layers=12,
                                                          sliding_window=1024),
     [(1024, 10), (None, 2)]),
    ("gemma3 multimodal", lambda: transformers.Gemma3Config(), [(4096, 22), (None, 4)]),
    ("gpt-oss", lambda: transformers.GptOssConfig(num_hidden_layers=6), [(128, 3), (None, 3)]),
    ("cohere2", lambda: transformers.Cohere2Config(num_hidden_layers=8), [(4096, 6), (None, 2)]),
    ("ministral", lambda: transformers.MinistralConfig(num_hidden_layers=3), [(4096, 3)]),
]


@pytest.mark.parametrize("name,make,expected", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_mask_of_transformers_config(name, make, expected):
    config = make()
    mask = from_hf_config(config)
    assert mask == AttentionMask(tuple(LayerGroup(w, c) for w, c in expected))
    text = config.get_text_config()
    assert mask.num_layers == text.num_hidden_layers
    # Layer by layer, the window the modeling code gives the attention call.
    types = getattr(text, "layer_types", None) or ["sliding_attention"] * text.num_hidden_layers
    windows = [getattr(text, "sliding_window", None) if t == "sliding_attention" else None
               for t in types]
    assert sorted(windows, key=lambda w: (w is None, w or 0)) == [
        w for g in mask.groups for w in [g.window] * g.layers]


def test_qwen2_windows_the_layers_from_max_window_layers_on():
    config = transformers.Qwen2Config(num_hidden_layers=5, use_sliding_window=True,
                                      sliding_window=64, max_window_layers=3)
    assert config.layer_types == ["full_attention"] * 3 + ["sliding_attention"] * 2
    assert from_hf_config(config) == AttentionMask((LayerGroup(64, 2), LayerGroup(None, 3)))


@pytest.mark.parametrize("make,field,message", [
    (lambda: transformers.Qwen3NextConfig(num_hidden_layers=4), "layer_types.0",
     "layer_types[0] is 'linear_attention'"),
    (lambda: transformers.Llama4TextConfig(num_hidden_layers=4), "layer_types.0",
     "layer_types[0] is 'chunked_attention'"),
    (lambda: transformers.Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True),
     "use_bidirectional_attention", "use_bidirectional_attention is set"),
])
def test_refuses_configs_it_cannot_plan(make, field, message):
    with pytest.raises(FieldError) as info:
        from_hf_config(make())
    assert info.value.field == field and message in str(info.value)
    assert "\n" not in str(info.value)


def test_refuses_sliding_layers_without_a_window():
    config = transformers.Gemma2Config(num_hidden_layers=2)
    config.sliding_window = None
    with pytest.raises(FieldError, match=r"layer_types\[0\] is sliding_attention but "
                       "sliding_window is unset"):
        from_hf_config(config)
