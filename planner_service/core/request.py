"""A planning request and the validation of everything a caller can get wrong."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from planner_service.core.model import ModelSpec
from planner_service.core.profiles import get_kernel_profile, get_link_profile

MAX_CP_SIZE = 1024
MAX_TOKENS = 2**31 - 1
"""Total tokens of one request: local token indices are int32 in the runtime."""
COMM_MODES = ("full", "compact_allgather", "alltoallv", "p2p_ring")
DEFAULT_IMBALANCE_TARGET = 1.05


def check_int(value: Any, name: str, lo: int, hi: int) -> int:
    """Return value if it is an int (not bool) in [lo, hi], else raise ValueError naming it."""
    if type(value) is not int:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def check_doc_lengths(doc_lengths: Any, name: str = "doc_lengths") -> tuple[int, ...]:
    """Validate a non-empty list of positive integer lengths."""
    if isinstance(doc_lengths, (str, bytes)) or not isinstance(doc_lengths, Sequence):
        raise ValueError(f"{name} must be a non-empty list of positive integers")
    if len(doc_lengths) == 0:
        raise ValueError(f"{name} must not be empty")
    out = []
    for i, length in enumerate(doc_lengths):
        # numpy integers are fine; bools and floats are not.
        if isinstance(length, bool) or not hasattr(length, "__index__"):
            raise ValueError(f"{name}[{i}] must be a positive integer, got {length!r}")
        length = int(length)
        if not 1 <= length <= MAX_TOKENS:
            raise ValueError(f"{name}[{i}] must be in [1, {MAX_TOKENS}], got {length}")
        out.append(length)
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRequest:
    """One packed sequence to shard over ``cp_size`` ranks.

    Raises ValueError naming the field for any invalid value.
    """

    doc_lengths: tuple[int, ...]
    """Document lengths in tokens, in packing order."""
    cp_size: int
    """Number of CP ranks N, 1 to 1024."""
    strategy: str = "flashcp"
    """Solver name from the registry."""
    context_length: int | None = None
    """Context window C; the lengths must sum to at most C. None: no window."""
    truncate: bool = False
    """If the lengths exceed C: keep docs in order, cut the last one at C, drop the rest
    (recorded in the plan's info) instead of raising."""
    imbalance_target: float = DEFAULT_IMBALANCE_TARGET
    """Target R for max/mean workload (flashcp, ilp)."""
    comm_mode: str | None = None
    """KV exchange; None picks the strategy's own."""
    model: ModelSpec = field(default_factory=ModelSpec)
    kernel: str = "h100-fa3"
    """Kernel profile name (core/profiles.py)."""
    link: str = "nvlink"
    """Link profile name (core/profiles.py)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Strategy-specific options (e.g. ilp time_limit_s); each strategy validates its own."""
    max_kv_tokens_per_rank: int | None = None
    """Bound on every rank's ``kv_tokens_peak`` (own tokens plus the remote KV held at once
    per layer, ``cost.kv_tokens_peak``); None: no bound. A strategy meets it or refuses,
    naming the smallest bound it can meet (solvers/kv_bound.py)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "doc_lengths", check_doc_lengths(self.doc_lengths))
        check_int(self.cp_size, "cp_size", 1, MAX_CP_SIZE)
        if not isinstance(self.strategy, str):
            raise ValueError(f"strategy must be a string, got {self.strategy!r}")
        if self.context_length is not None:
            check_int(self.context_length, "context_length", 1, MAX_TOKENS)
        if not isinstance(self.truncate, bool):
            raise ValueError(f"truncate must be true or false, got {self.truncate!r}")
        r = self.imbalance_target
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise ValueError(f"imbalance_target must be a number in [1, 100], got {r!r}")
        if not 1.0 <= r <= 100.0:
            raise ValueError(f"imbalance_target must be in [1, 100], got {r}")
        object.__setattr__(self, "imbalance_target", float(r))
        if self.comm_mode is not None and self.comm_mode not in COMM_MODES:
            raise ValueError(
                f"comm_mode must be one of {', '.join(COMM_MODES)}, got {self.comm_mode!r}"
            )
        if not isinstance(self.model, ModelSpec):
            raise ValueError("model must be a ModelSpec")
        get_kernel_profile(self.kernel)
        get_link_profile(self.link)
        if not isinstance(self.options, Mapping):
            raise ValueError(f"options must be a mapping, got {type(self.options).__name__}")
        if self.max_kv_tokens_per_rank is not None:
            check_int(self.max_kv_tokens_per_rank, "max_kv_tokens_per_rank", 1, MAX_TOKENS)
        total = sum(self.doc_lengths)
        if total > MAX_TOKENS:
            raise ValueError(f"doc_lengths sum to {total}, above the limit {MAX_TOKENS}")
        if self.context_length is not None and total > self.context_length and not self.truncate:
            longest = max(self.doc_lengths)
            what = (
                f"doc of length {longest} is longer than"
                if longest > self.context_length
                else f"doc_lengths sum to {total}, more than"
            )
            raise ValueError(
                f"{what} context_length {self.context_length}; shorten doc_lengths, "
                "raise context_length or set truncate=true"
            )

    def packed(self) -> tuple[tuple[int, ...], int]:
        """The lengths after the explicit truncation to the window, and tokens dropped."""
        if self.context_length is None or sum(self.doc_lengths) <= self.context_length:
            return self.doc_lengths, 0
        kept: list[int] = []
        room = self.context_length
        for length in self.doc_lengths:
            if room == 0:
                break
            kept.append(min(length, room))
            room -= kept[-1]
        return tuple(kept), sum(self.doc_lengths) - self.context_length

    def with_strategy(self, strategy: str) -> PlanRequest:
        return replace(self, strategy=strategy)


def debug_request(**changes: Any) -> PlanRequest:
    """The named debug fixture every test and smoke run starts from (torchtitan's
    ``llama3_debugmodel`` idea): 13 docs, lengths divisible by nothing, N = 4."""
    base = PlanRequest(
        doc_lengths=(4099, 37, 1023, 8191, 1, 511, 2047, 3001, 17, 6143, 733, 97, 5000),
        cp_size=4,
        context_length=32768,
    )
    return replace(base, **changes)
