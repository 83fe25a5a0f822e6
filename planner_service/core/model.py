"""Model shape that turns token counts into bytes and FLOPs."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from planner_service.core.errors import FieldError

MAX_DIM = 1 << 20
"""Largest head count, head dimension or layer width a ModelSpec accepts."""
DTYPE_BYTES = (1, 2, 4, 8)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Attention and linear-layer shape of one transformer layer.

    The default is Llama-3-8B (32 query heads, 8 KV heads, head_dim 128, bf16).
    """

    num_heads: int = 32
    """Query heads per layer (per tensor-parallel rank if TP > 1)."""
    num_kv_heads: int = 8
    """Key/value heads (GQA); must divide num_heads."""
    head_dim: int = 128
    """Dimension of one head."""
    dtype_bytes: int = 2
    """Bytes per element of K and V on the wire (2 for bf16/fp16, 4 for fp32)."""
    hidden_size: int = 4096
    """Model width; used only for the linear-layer time."""
    ffn_hidden_size: int = 14336
    """SwiGLU inner width; used only for the linear-layer time."""

    def __post_init__(self) -> None:
        """Raises FieldError (``model.<name>``) for a value out of range."""
        for name in ("num_heads", "num_kv_heads", "head_dim", "hidden_size", "ffn_hidden_size"):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= MAX_DIM:
                raise FieldError(f"model.{name}", f"model.{name} must be an integer in "
                                 f"[1, {MAX_DIM}], got {value!r}")
        if type(self.dtype_bytes) is not int or self.dtype_bytes not in DTYPE_BYTES:
            raise FieldError("model.dtype_bytes", f"model.dtype_bytes must be one of "
                             f"{', '.join(map(str, DTYPE_BYTES))}, got {self.dtype_bytes!r}")
        if self.num_heads % self.num_kv_heads:
            raise FieldError("model.num_kv_heads", f"model.num_kv_heads ({self.num_kv_heads}) "
                             f"must divide model.num_heads ({self.num_heads})")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K plus V for one token of one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def linear_flops_per_token(self) -> int:
        """Forward+backward FLOPs of one layer's linear layers per token.

        6 x parameters (2 forward, 4 backward; Kaplan et al. 2020, as in nanoGPT's
        ``estimate_mfu``). Parameters: QKV and output projections plus a SwiGLU MLP.
        """
        q_out = self.num_heads * self.head_dim
        kv_out = 2 * self.num_kv_heads * self.head_dim
        attn_params = self.hidden_size * (q_out + kv_out) + q_out * self.hidden_size
        mlp_params = 3 * self.hidden_size * self.ffn_hidden_size
        return 6 * (attn_params + mlp_params)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # scalars: no deep copy

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """Raises FieldError for an unknown or bad field."""
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise FieldError(f"model.{min(unknown)}", f"model has unknown fields "
                             f"{sorted(unknown)}; valid: {', '.join(cls.__dataclass_fields__)}")
        return cls(**data)
