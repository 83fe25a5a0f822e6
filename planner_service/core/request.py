"""A planning request and the validation of everything a caller can get wrong."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from planner_service.core.errors import FieldError
from planner_service.core.mask import CAUSAL, AttentionMask
from planner_service.core.model import ModelSpec
from planner_service.core.paths import COMM_MODES
from planner_service.core.profiles import default_kernel_name, get_kernel_profile, get_link_profile

MAX_CP_SIZE = 1024
"""Ranks of one plan's group (``PlanRequest.cp_size``)."""
MAX_FCP_RANKS = 16384
"""Ranks N of every FCP entry point: ``fcp.plan_global_batch``, ``ScheduleRequest`` (and
so ``schedule``), ``planner schedule`` and the service's /v1/schedule and global-batch
jobs (where ``PLANNER_MAX_CP_SIZE`` may lower it); docs/settings.md."""
MAX_TOKENS = 2**31 - 1
"""Total tokens of one request: local token indices are int32 in the runtime."""
DEFAULT_IMBALANCE_TARGET = 1.05


def check_int(value: Any, name: str, lo: int, hi: int) -> int:
    """Return value if it is an int (not bool) in [lo, hi], else raise FieldError(name)."""
    if type(value) is not int:
        raise FieldError(name, f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise FieldError(name, f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def check_time_limit(value: Any, name: str, cap: float = math.inf, setting: str = "") -> float:
    """Return a time limit in seconds if it is a finite number in (0, cap], else raise
    FieldError(name); ``setting`` names where the cap comes from (an operator's variable)."""
    allowed = "> 0" if cap == math.inf else f"in (0, {cap:g}]"
    where = f" ({setting})" if setting else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value <= cap or not math.isfinite(value):
        raise FieldError(name, f"{name} must be a number {allowed}{where}, got {value!r}")
    return float(value)


def check_doc_lengths(doc_lengths: Any, name: str = "doc_lengths", field: str | None = None
                      ) -> tuple[int, ...]:
    """Validate a non-empty list of positive integer lengths; raises FieldError with
    ``field`` (default ``name``), or ``field.i`` for a bad entry i."""
    field = field or name
    if isinstance(doc_lengths, (str, bytes)) or not isinstance(doc_lengths, Sequence):
        raise FieldError(field, f"{name} must be a non-empty list of integers in "
                         f"[1, {MAX_TOKENS}]")
    if len(doc_lengths) == 0:
        raise FieldError(field, f"{name} must not be empty")
    out = []
    for i, length in enumerate(doc_lengths):
        # numpy integers are fine; bools and floats are not.
        if isinstance(length, bool) or not hasattr(length, "__index__"):
            raise FieldError(f"{field}.{i}", f"{name}[{i}] must be an integer in "
                             f"[1, {MAX_TOKENS}], got {length!r}")
        length = int(length)
        if not 1 <= length <= MAX_TOKENS:
            raise FieldError(f"{field}.{i}", f"{name}[{i}] must be in [1, {MAX_TOKENS}], "
                             f"got {length}")
        out.append(length)
    return tuple(out)


def check_imbalance_target(value: Any) -> float:
    """The target R as a float if it is a finite number in [1, 100], else FieldError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise FieldError("imbalance_target",
                         f"imbalance_target must be a number in [1, 100], got {value!r}")
    if not 1.0 <= value <= 100.0:
        raise FieldError("imbalance_target", f"imbalance_target must be in [1, 100], got {value}")
    return float(value)


def check_profile_names(kernel: Any, link: Any) -> None:
    """Raise FieldError (``kernel`` or ``link``) listing the valid names for an unknown
    kernel or link profile."""
    for name, value, lookup in (("kernel", kernel, get_kernel_profile),
                                ("link", link, get_link_profile)):
        try:
            lookup(value)
        except (ValueError, TypeError) as exc:
            text = str(exc)
            raise FieldError(name, text if text.startswith(name) else f"{name}: {text}") \
                from None


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRequest:
    """One packed sequence to shard over ``cp_size`` ranks.

    Raises FieldError (a ValueError) naming the field for any invalid value.
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
    kernel: str = field(default_factory=default_kernel_name)
    """Kernel profile name (core/profiles.py); unset: the runtime's kernel's, resolved here."""
    link: str = "nvlink"
    """Link profile name (core/profiles.py)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Strategy-specific options (e.g. ilp time_limit_s); each strategy validates its own."""
    max_kv_tokens_per_rank: int | None = None
    """Bound on every rank's ``kv_tokens_peak`` (own tokens plus the remote KV held at once
    per layer, ``cost.kv_tokens_peak``); None: no bound. A strategy meets it or refuses,
    naming the smallest bound it can meet (solvers/kv_bound.py)."""
    mask: AttentionMask = CAUSAL
    """The model's attention per layer (core/mask.py): CAUSAL (every layer attends its whole
    document prefix) unless given. A plan for a mask that is not causal records it and
    reports layer-weighted figures (core/metrics.py); a causal one is byte-identical to a
    plan of a request without it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "doc_lengths", check_doc_lengths(self.doc_lengths))
        check_int(self.cp_size, "cp_size", 1, MAX_CP_SIZE)
        if not isinstance(self.strategy, str):
            raise FieldError("strategy", f"strategy must be a string, got {self.strategy!r}")
        if self.context_length is not None:
            check_int(self.context_length, "context_length", 1, MAX_TOKENS)
        if not isinstance(self.truncate, bool):
            raise FieldError("truncate", f"truncate must be true or false, got {self.truncate!r}")
        object.__setattr__(self, "imbalance_target", check_imbalance_target(self.imbalance_target))
        if self.comm_mode is not None and self.comm_mode not in COMM_MODES:
            raise FieldError("comm_mode", f"comm_mode must be one of {', '.join(COMM_MODES)}, "
                             f"got {self.comm_mode!r}")
        if not isinstance(self.model, ModelSpec):
            raise FieldError("model", "model must be a ModelSpec")
        check_profile_names(self.kernel, self.link)
        if not isinstance(self.options, Mapping):
            raise FieldError("options", f"options must be a mapping, got "
                             f"{type(self.options).__name__}")
        if self.max_kv_tokens_per_rank is not None:
            check_int(self.max_kv_tokens_per_rank, "max_kv_tokens_per_rank", 1, MAX_TOKENS)
        if not isinstance(self.mask, AttentionMask):
            raise FieldError("layers", "layers must be an AttentionMask (core/mask.py: "
                             f"parse_mask), got {type(self.mask).__name__}")
        total = sum(self.doc_lengths)
        if total > MAX_TOKENS:
            raise FieldError("doc_lengths", f"doc_lengths sum to {total}, above the limit "
                             f"{MAX_TOKENS}")
        if self.context_length is not None and total > self.context_length and not self.truncate:
            longest = max(self.doc_lengths)
            what = (
                f"doc_lengths has a doc of length {longest}, longer than"
                if longest > self.context_length
                else f"doc_lengths sum to {total}, more than"
            )
            raise FieldError("doc_lengths", f"{what} context_length {self.context_length}; "
                             "shorten doc_lengths, raise context_length or set truncate=true")

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


REQUEST_FIELDS = tuple(f.name for f in fields(PlanRequest))
"""PlanRequest's fields, in declaration order: the one list of them (the HTTP schema, the
proto message and their conversions follow it; tests/test_request_fields.py checks)."""
REQUIRED_FIELDS = frozenset(f.name for f in fields(PlanRequest)
                            if f.default is MISSING and f.default_factory is MISSING)
"""The fields without a default (``doc_lengths``, ``cp_size``)."""
WIRE_NAMES: Mapping[str, tuple[str, ...]] = {"mask": ("window", "layers")}
"""Fields that travel under other names in the JSON body of ``POST /v1/plan`` and in the
proto's PlanRequest: the mask as ``window`` (one window for every layer) or ``layers``
(a mix). Every other field travels under its own name."""
BODY_FIELDS = tuple(name for f in REQUEST_FIELDS for name in WIRE_NAMES.get(f, (f,)))
"""The JSON body's fields of a plan request, in PlanRequest's order."""


def debug_request(**changes: Any) -> PlanRequest:
    """The named debug fixture every test and smoke run starts from (torchtitan's
    ``llama3_debugmodel`` idea): 13 docs, lengths divisible by nothing, N = 4."""
    base = PlanRequest(
        doc_lengths=(4099, 37, 1023, 8191, 1, 511, 2047, 3001, 17, 6143, 733, 97, 5000),
        cp_size=4,
        context_length=32768,
    )
    return replace(base, **changes)
