"""The attention mask of a model: which layers attend causally, which through a window.

A layer of window ``W`` lets the query at document position p attend the keys at
positions ``[max(0, p - W + 1), p]`` (``min(p + 1, W)`` keys): transformers'
``sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``) on a causal mask, the
``window_size_left = W - 1`` of flash-attn. A causal layer (``window=None``) attends the
whole prefix ``[0, p]``. Documents never see each other in either.

An :class:`AttentionMask` is a multiset of layer groups (window, layer count), held in
canonical form: one group per window, windows ascending, the causal group last. Two
masks with the same layers per window therefore compare and hash equal, whatever order
or split they were given in. Counts are kept as given, not reduced to a ratio: 10 local
and 2 global layers is a different model from 5 and 1, with the same per-layer mix
(:meth:`AttentionMask.weights`).

Shapes accepted from callers (:func:`parse_mask`): ``window=W`` (every layer, ``None``
causal), ``layers=[{"window": 1024, "count": 5}, {"window": null, "count": 1}]``, and the
CLI string ``"5x1024,1xfull"`` (:func:`parse_layers_text`); :func:`from_hf_config` reads a
transformers config (``layer_types``, ``sliding_window``, ``use_sliding_window``,
``max_window_layers``). Bad input raises :class:`FieldError` naming the field and range.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from planner_service.core.errors import FieldError

MAX_WINDOW = 2**31 - 1
"""Largest window: a request holds at most this many tokens (core/request.py MAX_TOKENS),
so a larger window attends exactly what this one does."""
MAX_GROUPS = 64
"""Most distinct windows one mask holds."""
MAX_LAYERS = 1 << 16
"""Most layers one group (and one mask) counts."""
MAX_MASK_TEXT = 4096
"""Longest ``--layers`` string parsed."""


def check_window(value: Any, field: str) -> int | None:
    """``value`` if it is None (causal) or an integer (not bool) in [1, MAX_WINDOW], else
    FieldError(field)."""
    if value is None:
        return None
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise FieldError(field, f"{field} must be an integer in [1, {MAX_WINDOW}] or null "
                         f"(causal), got {value!r}")
    value = int(value)
    if not 1 <= value <= MAX_WINDOW:
        raise FieldError(field, f"{field} must be in [1, {MAX_WINDOW}] or null (causal), "
                         f"got {value}")
    return value


def check_count(value: Any, field: str) -> int:
    """``value`` if it is an integer (not bool) in [1, MAX_LAYERS], else FieldError(field)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise FieldError(field, f"{field} must be an integer in [1, {MAX_LAYERS}], "
                         f"got {value!r}")
    value = int(value)
    if not 1 <= value <= MAX_LAYERS:
        raise FieldError(field, f"{field} must be in [1, {MAX_LAYERS}], got {value}")
    return value


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """``layers`` layers that attend through a window of ``window`` keys (None: causal)."""

    window: int | None
    layers: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "window", check_window(self.window, "window"))
        object.__setattr__(self, "layers", check_count(self.layers, "count"))

    @property
    def is_causal(self) -> bool:
        return self.window is None

    def to_dict(self) -> dict[str, int | None]:
        return {"window": self.window, "count": self.layers}


def _order(group: LayerGroup) -> tuple[int, int]:
    # Windows ascending, the causal group last.
    return (1, 0) if group.window is None else (0, group.window)


@dataclass(frozen=True, slots=True)
class AttentionMask:
    """The layers of a model by window, in canonical form (module docstring).

    Built from any iterable of :class:`LayerGroup`; groups of the same window merge.
    FieldError on ``layers`` for an empty mix, more than MAX_GROUPS windows or more than
    MAX_LAYERS layers in all.
    """

    groups: tuple[LayerGroup, ...]

    def __post_init__(self) -> None:
        given = tuple(self.groups) if isinstance(self.groups, Iterable) else None
        if given is None or not all(isinstance(g, LayerGroup) for g in given):
            raise FieldError("layers", "layers must be a list of (window, count) groups")
        if not given:
            raise FieldError("layers", "layers must not be empty: give at least one "
                             "(window, count) group")
        merged: dict[int | None, int] = {}
        for group in given:
            merged[group.window] = merged.get(group.window, 0) + group.layers
        if len(merged) > MAX_GROUPS:
            raise FieldError("layers", f"layers must hold at most {MAX_GROUPS} distinct "
                             f"windows, got {len(merged)}")
        total = sum(merged.values())
        if total > MAX_LAYERS:
            raise FieldError("layers", f"layers must count at most {MAX_LAYERS} layers in "
                             f"all, got {total}")
        canonical = sorted((LayerGroup(w, c) for w, c in merged.items()), key=_order)
        object.__setattr__(self, "groups", tuple(canonical))

    @classmethod
    def uniform(cls, window: int | None, layers: int = 1) -> AttentionMask:
        """Every layer with the same window (None: causal)."""
        return cls((LayerGroup(window, layers),))

    @property
    def num_layers(self) -> int:
        return sum(g.layers for g in self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct windows, canonical order (causal last)."""
        return tuple(g.window for g in self.groups)

    @property
    def is_causal(self) -> bool:
        """Causal in every layer (any layer count)."""
        return self.windows == (None,)

    def weights(self) -> tuple[float, ...]:
        """Each group's share of the layers, in group order (sums to 1)."""
        total = self.num_layers
        return tuple(g.layers / total for g in self.groups)

    def to_list(self) -> list[dict[str, int | None]]:
        """The ``layers`` JSON shape, canonical order."""
        return [g.to_dict() for g in self.groups]

    def to_text(self) -> str:
        """The ``--layers`` CLI shape: ``5x1024,1xfull``."""
        return ",".join(f"{g.layers}x{'full' if g.window is None else g.window}"
                        for g in self.groups)


CAUSAL = AttentionMask.uniform(None)
"""Causal attention in every layer: what a request without a mask means."""


def parse_layers(value: Any, field: str = "layers") -> AttentionMask:
    """The ``layers`` JSON shape: a non-empty list of ``{"window": W | null, "count": n}``.
    FieldError naming ``layers``, ``layers.i`` or ``layers.i.window`` / ``.count``."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise FieldError(field, f"{field} must be a non-empty list of "
                         '{"window": W or null, "count": n} objects')
    if len(value) > MAX_GROUPS:
        raise FieldError(field, f"{field} must hold at most {MAX_GROUPS} groups, "
                         f"got {len(value)}")
    groups = []
    for i, item in enumerate(value):
        where = f"{field}.{i}"
        if not isinstance(item, Mapping):
            raise FieldError(where, f'{where} must be an object {{"window": W or null, '
                             f'"count": n}}, got {item!r}')
        extra = sorted(set(map(str, item)) - {"window", "count"})
        if extra:
            raise FieldError(f"{where}.{extra[0]}", f"{where}.{extra[0]} is not a field "
                             "of a layer group (window, count)")
        if "count" not in item:
            raise FieldError(f"{where}.count", f"{where}.count is required: an integer "
                             f"in [1, {MAX_LAYERS}]")
        window = check_window(item.get("window"), f"{where}.window")
        groups.append(LayerGroup(window, check_count(item["count"], f"{where}.count")))
    return AttentionMask(tuple(groups))


def parse_layers_text(text: Any, field: str = "layers") -> AttentionMask:
    """The CLI shape ``COUNTxWINDOW[,COUNTxWINDOW...]`` with WINDOW an integer or ``full``
    (causal), e.g. ``5x1024,1xfull``. FieldError naming ``field`` (the flag's field)."""
    shape = f"{field} must look like 5x1024,1xfull (COUNTxWINDOW, WINDOW an integer or full)"
    if not isinstance(text, str) or not text.strip() or len(text) > MAX_MASK_TEXT:
        raise FieldError(field, f"{shape}, got {text!r}"[:300])
    items = text.split(",")
    if len(items) > MAX_GROUPS:
        raise FieldError(field, f"{field} must hold at most {MAX_GROUPS} groups, "
                         f"got {len(items)}")
    groups = []
    for item in items:
        count, sep, window = item.strip().lower().partition("x")
        if not sep or not count.isdigit() or not (window == "full" or window.isdigit()):
            raise FieldError(field, f"{shape}, got {item.strip()!r}"[:300])
        try:
            groups.append(LayerGroup(None if window == "full" else check_window(
                int(window), "window"), check_count(int(count), "count")))
        except FieldError as exc:
            raise FieldError(field, f"{field}: {exc} in {item.strip()!r}"[:300]) from None
    return AttentionMask(tuple(groups))


def parse_mask(*, window: Any = None, layers: Any = None, has_window: bool = False
               ) -> AttentionMask:
    """The mask of a request's ``window`` / ``layers`` fields: ``layers`` (a JSON list or
    the CLI string) if given, else ``window`` for every layer (``has_window`` tells an
    explicit ``window: null``, causal, from an absent one, also causal); CAUSAL when
    neither is given. FieldError on ``layers`` when both are."""
    if layers is not None:
        if window is not None or has_window:
            raise FieldError("layers", "layers and window are exclusive: give window for "
                             "every layer, or layers for a mix")
        return parse_layers_text(layers) if isinstance(layers, str) else parse_layers(layers)
    return AttentionMask.uniform(check_window(window, "window"))


SLIDING, FULL = "sliding_attention", "full_attention"
"""The ``layer_types`` entries of transformers configs this module reads."""


def from_hf_config(config: Any) -> AttentionMask:
    """The mask of a transformers ``PretrainedConfig`` (a multimodal config's text part).

    With ``layer_types`` (Qwen2/3, Gemma 2/3, GPT-OSS, Cohere2, Ministral, ... all derive
    it in ``__post_init__``): layer i attends through ``sliding_window`` if its type is
    ``sliding_attention``, causally if ``full_attention``, as their attention modules set
    ``self.sliding_window``. Qwen2's ``use_sliding_window`` / ``max_window_layers`` are
    already in it (windowed layers are those with index >= max_window_layers, and none
    unless use_sliding_window, which unsets ``sliding_window``). Without it (Mistral,
    Mixtral, Phi-3, Llama): ``sliding_window`` on every one of ``num_hidden_layers``
    layers, causal where unset. One layer per layer of the model.

    ValueError naming the field for what the planner cannot represent: another layer type
    (``linear_attention``, ``chunked_attention``, ...), a sliding layer with no
    ``sliding_window``, bidirectional attention (Gemma 3's ``use_bidirectional_attention``).
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if getattr(config, "use_bidirectional_attention", False):
        raise FieldError("use_bidirectional_attention", "use_bidirectional_attention is set: "
                         "the planner plans causal and sliding-window attention only")
    window = getattr(config, "sliding_window", None)
    if window is not None:
        window = check_window(window, "sliding_window")
    types = getattr(config, "layer_types", None)
    if types is None:
        layers = getattr(config, "num_hidden_layers", None)
        return AttentionMask.uniform(window, check_count(layers, "num_hidden_layers"))
    if isinstance(types, str) or not isinstance(types, Sequence) or not types:
        raise FieldError("layer_types", f"layer_types must be a non-empty list, got {types!r}")
    counts: dict[int | None, int] = {}
    for i, kind in enumerate(types):
        if kind == SLIDING:
            if window is None:
                raise FieldError(f"layer_types.{i}", f"layer_types[{i}] is {SLIDING} but "
                                 "sliding_window is unset")
            layer_window: int | None = window
        elif kind == FULL:
            layer_window = None
        else:
            raise FieldError(f"layer_types.{i}", f"layer_types[{i}] is {kind!r}: the "
                             f"planner plans {SLIDING} and {FULL} layers only")
        counts[layer_window] = counts.get(layer_window, 0) + 1
    return AttentionMask(tuple(LayerGroup(w, c) for w, c in counts.items()))
