"""Wire types of the HTTP API (pydantic v2) and their conversion to core requests.

The models check types and fixed bounds; :func:`to_plan_request` applies the operator's
limits and the core's own validation. Every rejection is a :class:`FieldError` naming the
field, which the HTTP edge answers with 422 and the gRPC edge with INVALID_ARGUMENT.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from planner_service.core.errors import FieldError
from planner_service.core.mask import CAUSAL, parse_mask
from planner_service.core.model import DTYPE_BYTES, MAX_DIM, ModelSpec
from planner_service.core.plan import canonical_json
from planner_service.core.profiles import default_kernel_name
from planner_service.core.request import (
    COMM_MODES,
    MAX_CP_SIZE,
    MAX_FCP_RANKS,
    MAX_TOKENS,
    REQUEST_FIELDS,
    WIRE_NAMES,
    PlanRequest,
    check_time_limit,
)
from planner_service.service.settings import Settings
from planner_service.solvers.registry import checked_strategy


def refuse_sequence_flood(raw: bytes | str, limit: int) -> None:
    """Refuse a schedule body with far more than ``limit`` sequences before parsing it: a
    4 MiB body of "[1]," would cost ~1 s and ~200 MB of Python lists to validate. Every
    sequence opens a "[" (the slack of 64 leaves the exact count to the validator)."""
    opens = raw.count(b"[") if isinstance(raw, bytes) else raw.count("[")
    if opens > limit + 64:
        raise FieldError("sequences", f"sequences has more than {limit} entries, the limit "
                         "(PLANNER_MAX_SEQUENCES)")


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """The operator's bounds on one request (from Settings)."""

    max_docs: int
    max_cp_size: int
    max_tokens: int
    max_time_limit_s: float
    max_sequences: int
    max_shards: int = 2**62
    max_json_depth: int = 1000

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(max_docs=settings.max_docs, max_cp_size=settings.max_cp_size,
                   max_tokens=settings.max_tokens, max_time_limit_s=settings.max_time_limit_s,
                   max_sequences=settings.max_sequences, max_shards=settings.max_shards,
                   max_json_depth=settings.max_json_depth)

    @classmethod
    def library(cls) -> Limits:
        """No operator bounds: only the core's own ranges (a local plan in the client)."""
        return cls(max_docs=2**62, max_cp_size=MAX_CP_SIZE, max_tokens=MAX_TOKENS,
                   max_time_limit_s=math.inf, max_sequences=2**62)


_JSON_STRUCTURE = re.compile(rb'[\[\]{}"\\]')


_DEPTH_CHUNK = 1 << 20


def _deepest_unescaped(data: bytes) -> int:
    """The deepest array/object nesting of JSON text holding no backslash, brackets inside
    strings not counted. O(bytes) numpy, in chunks of ``_DEPTH_CHUNK`` bytes."""
    buf = np.frombuffer(data, np.uint8)
    depth = deepest = quotes = 0
    for lo in range(0, buf.size, _DEPTH_CHUNK):
        part = buf[lo:lo + _DEPTH_CHUNK]
        is_quote = part == ord('"')
        outside = (np.cumsum(is_quote, dtype=np.int64) + quotes) % 2 == 0
        opens = ((part == ord("[")) | (part == ord("{"))) & outside
        closes = ((part == ord("]")) | (part == ord("}"))) & outside
        run = depth + np.cumsum(opens.astype(np.int32) - closes.astype(np.int32), dtype=np.int64)
        deepest = max(deepest, int(run.max()))
        depth, quotes = int(run[-1]), quotes + int(is_quote.sum())
    return deepest


def check_json_depth(raw: bytes | str, limit: int, field: str = "body") -> None:
    """Refuse JSON nested deeper than ``limit`` arrays/objects before any parser recurses
    into it (Python's json raises RecursionError near 1,000 levels); raises FieldError.

    Linear in the body: numpy over 1 MiB chunks where the body has no backslash (every
    quote then opens or closes a string), else a scan of its brackets and quotes (digits
    are skipped by the regex)."""
    data = raw.encode() if isinstance(raw, str) else raw
    if b"\\" not in data:
        if _deepest_unescaped(data) > limit:
            raise FieldError(field, f"{field} nests arrays/objects deeper than {limit} "
                             "levels (PLANNER_MAX_JSON_DEPTH)")
        return
    depth = escape_at = 0
    in_string = escaped = False
    for match in _JSON_STRUCTURE.finditer(data):
        char = match.group()
        if in_string:
            if escaped:
                escaped = False
                if match.start() == escape_at + 1:
                    continue
            if char == b"\\":
                escaped, escape_at = True, match.start()
            elif char == b'"':
                in_string = False
            continue
        if char == b'"':
            in_string = True
        elif char in (b"[", b"{"):
            depth += 1
            if depth > limit:
                raise FieldError(field, f"{field} nests arrays/objects deeper than {limit} "
                                 "levels (PLANNER_MAX_JSON_DEPTH)")
        elif char in (b"]", b"}"):
            depth -= 1


DocLength = Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS)]


class ModelSpecIn(BaseModel):
    """Transformer layer shape; unset fields take the Llama-3-8B defaults."""

    model_config = ConfigDict(extra="forbid")
    num_heads: StrictInt | None = Field(None, ge=1, le=MAX_DIM)
    num_kv_heads: StrictInt | None = Field(None, ge=1, le=MAX_DIM)
    head_dim: StrictInt | None = Field(None, ge=1, le=MAX_DIM)
    dtype_bytes: StrictInt | None = Field(None, ge=1, le=max(DTYPE_BYTES))
    hidden_size: StrictInt | None = Field(None, ge=1, le=MAX_DIM)
    ffn_hidden_size: StrictInt | None = Field(None, ge=1, le=MAX_DIM)


WindowIn = Annotated[StrictInt | None, Field(
    description="The model's attention: a sliding window of this many keys in every layer "
    "(null or absent: causal). Exclusive with layers (docs/windows.md)")]
LayersIn = Annotated[list[dict[str, Any]] | None, Field(
    max_length=64, description='Or a mix: [{"window": 1024, "count": 5}, '
    '{"window": null, "count": 1}] (docs/windows.md)')]
"""The mask fields of the plan and schedule bodies (``core.mask.parse_mask`` reads them)."""


class PlanRequestIn(BaseModel):
    """One packed sequence to shard over ``cp_size`` ranks (docs/plan.md, Requests)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"doc_lengths": [4099, 37, 1023, 8191, 1, 511, 2047, 3001, 17, 6143, 733, 97, 5000],
         "cp_size": 4, "strategy": "flashcp", "context_length": 32768}]})
    doc_lengths: list[DocLength] = Field(min_length=1, description="Document lengths in tokens, "
                                         "in packing order")
    cp_size: StrictInt = Field(ge=1, le=MAX_CP_SIZE, description="CP ranks N")
    strategy: StrictStr = Field("flashcp", max_length=64, description="See GET /v1/strategies")
    context_length: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS)
    truncate: StrictBool = False
    imbalance_target: float = Field(1.05, ge=1.0, le=100.0, allow_inf_nan=False)
    comm_mode: Literal[COMM_MODES] | None = None  # type: ignore[valid-type]
    model: ModelSpecIn | None = None
    kernel: StrictStr = Field(default_factory=default_kernel_name, max_length=64)
    link: StrictStr = Field("nvlink", max_length=64)
    options: dict[str, Any] = Field(default_factory=dict,
                                    description="Strategy options (GET /v1/strategies)")
    max_kv_tokens_per_rank: StrictInt | None = Field(
        None, ge=1, le=MAX_TOKENS, description="Bound on every rank's KV peak "
        "(rank_stats.kv_tokens_peak); a strategy meets it or answers 422 naming the smallest "
        "bound it can meet. Default: no bound")
    window: WindowIn = None
    layers: LayersIn = None


class CompareRequestIn(PlanRequestIn):
    """A plan request answered by several strategies; ``strategy`` is ignored."""

    strategies: list[Annotated[StrictStr, Field(max_length=64)]] | None = Field(
        None, max_length=64,
                                               description="Default: every strategy")


class ScheduleRequestIn(BaseModel):
    """A batch of sequences for FCP (solvers.fcp_schedule.ScheduleRequest, whose fields
    these are); unset fields take the scheduler's defaults, unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"sequences": [[30000, 2000], [512, 700, 9000], [65536]], "num_ranks": 8,
         "memory_tokens": 16384}]})
    sequences: list[list[DocLength]] = Field(min_length=1, description="Doc lengths of each "
                                             "sequence")
    num_ranks: StrictInt = Field(ge=1, le=MAX_FCP_RANKS, description="Model replicas N")
    memory_tokens: StrictInt = Field(ge=1, le=MAX_TOKENS, description="Activation memory per "
                                     "rank, in tokens")
    strategy: StrictStr | None = Field(None, max_length=64, description="Intra-group "
                                       "strategy (default flashcp)")
    profile: StrictStr | dict[str, Any] | None = Field(
        None, description="FCP cost profile: a name (GET /v1/strategies) or a profile object")
    full_attention: list[StrictBool] | None = None
    search: StrictStr | None = Field(None, max_length=64)
    method: StrictStr | None = Field(None, max_length=64)
    micro_batches: StrictInt | None = Field(None, ge=1, le=1_000_000)
    build_plans: StrictBool | None = None
    model: ModelSpecIn | None = None
    kernel: StrictStr | None = Field(None, max_length=64)
    link: StrictStr | None = Field(None, max_length=64)
    imbalance_target: float | None = Field(None, ge=1.0, le=100.0, allow_inf_nan=False)
    window: WindowIn = None
    layers: LayersIn = None


def schedule_body(body: ScheduleRequestIn) -> dict[str, Any]:
    """The scheduler's input: the fields the caller set (so unset ones take the
    scheduler's defaults and the content hash of a body does not depend on them).

    The mask (``window`` / ``layers``, read as a plan request's are) is held in one
    canonical form: ``layers`` (``AttentionMask.to_list``) when not causal, absent when
    causal, so a causal body hashes as one without a mask and equal masks hash equal.
    Raises FieldError for a bad mask."""
    payload = body.model_dump(exclude_unset=True, exclude_none=True)
    payload.pop("window", None)
    payload.pop("layers", None)
    mask = parse_mask(window=body.window, layers=body.layers,
                      has_window="window" in body.model_fields_set)
    if not mask.is_causal:
        payload["layers"] = mask.to_list()
    return payload


def check_finite(value: Any, field: str = "body") -> None:
    """Refuse NaN, Infinity and floats beyond 1e300 anywhere in JSON-like data, naming
    the field (a profile object's coefficients, strategy options); raises FieldError."""
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) > 1e300:
            raise FieldError(field, f"{field} must be a finite number, got {value!r}")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_finite(item, f"{field}.{str(key)[:64]}" if field != "body" else str(key)[:64])
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_finite(item, f"{field}.{i}")


def check_schedule(payload: dict[str, Any]) -> None:
    """Build the scheduler's request from ``payload`` (no scheduling: checks only), so a
    bad value is refused at submit, not when a worker runs it; raises FieldError."""
    from planner_service.service.fcp_bridge import build_request

    check_finite(payload)
    try:
        build_request(payload)
    except FieldError:
        raise
    except (TypeError, ValueError, KeyError) as exc:
        raise FieldError("body", f"body: {str(exc)[:200]}") from None


class Shard(BaseModel):
    doc: int
    start: int
    end: int


class GroupOut(BaseModel):
    ranks: list[int]
    docs: list[int]
    shards: list[list[Shard]]
    padding: list[int]
    metrics: dict[str, Any]
    rank_stats: dict[str, list[int]]


class PlanOut(BaseModel):
    """The plan contract (core/plan.py): canonical JSON, identical over HTTP and gRPC."""

    version: int
    strategy: str
    cp_size: int
    doc_lengths: list[int]
    context_length: int | None
    comm_mode: str
    model: dict[str, int]
    kernel: str
    link: str
    groups: list[GroupOut]
    metrics: dict[str, Any]
    info: dict[str, Any]
    plan_id: str


class CompareEntry(BaseModel):
    strategy: str
    plan: PlanOut
    solve_ms: float
    cached: bool


class CompareOut(BaseModel):
    results: list[CompareEntry]
    errors: dict[str, str] = Field(description="strategy -> why it gave no plan")


class StrategyOut(BaseModel):
    name: str
    description: str
    comm_mode: str
    options: dict[str, str]


class JobStatusOut(BaseModel):
    job: str
    batch: str
    status: Literal["pending", "done", "failed"]
    request_hash: str
    plan_id: str | None = None


class ErrorOut(BaseModel):
    detail: str
    field: str | None = None


# ---- conversion -------------------------------------------------------------------------

def validation_message(exc: ValidationError) -> FieldError:
    """The first pydantic error as a FieldError: 'doc_lengths.3: Input should be ...'."""
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err["loc"] if p != "body") or "body"
    return FieldError(loc, f"{loc}: {err['msg']}")


def to_plan_request(body: PlanRequestIn, limits: Limits, *, strategy: str | None = None,
                    ) -> PlanRequest:
    """Apply the operator's limits and build the core request (whose own checks raise
    the FieldErrors of everything else); raises FieldError."""
    n = len(body.doc_lengths)
    if n > limits.max_docs:
        raise FieldError("doc_lengths", f"doc_lengths has {n} documents, above the limit "
                         f"{limits.max_docs} (PLANNER_MAX_DOCS)")
    total = sum(body.doc_lengths)
    if total > limits.max_tokens:
        raise FieldError("doc_lengths", f"doc_lengths sum to {total} tokens, above the limit "
                         f"{limits.max_tokens} (PLANNER_MAX_TOKENS)")
    if body.cp_size > limits.max_cp_size:
        raise FieldError("cp_size", f"cp_size must be in [1, {limits.max_cp_size}] "
                         f"(PLANNER_MAX_CP_SIZE), got {body.cp_size}")
    check_shards(n, body.cp_size, limits, "cp_size")
    check_finite(body.options, "options")
    if "time_limit_s" in body.options:  # a strategy's own limit, within the operator's
        check_time_limit(body.options["time_limit_s"], "options.time_limit_s",
                         limits.max_time_limit_s, "PLANNER_MAX_TIME_LIMIT_S")
    values = {name: getattr(body, name) for name in REQUEST_FIELDS if name not in WIRE_NAMES}
    values.update(
        doc_lengths=tuple(body.doc_lengths), strategy=strategy or body.strategy,
        model=ModelSpec(**body.model.model_dump(exclude_none=True)) if body.model
        else ModelSpec(),
        options=dict(body.options),
        mask=parse_mask(window=body.window, layers=body.layers,
                        has_window="window" in body.model_fields_set))
    return PlanRequest(**values)


def check_shards(docs: int, ranks: int, limits: Limits, field: str) -> None:
    """Refuse a request whose plan could hold more than PLANNER_MAX_SHARDS shards (2 x
    documents x ranks: per_doc cuts every document in 2 x ranks chunks); raises FieldError."""
    if 2 * docs * ranks > limits.max_shards:
        raise FieldError(field, f"2 x {docs} documents x {ranks} ranks = {2 * docs * ranks} "
                         f"possible shards, above the limit {limits.max_shards} "
                         "(PLANNER_MAX_SHARDS); send fewer documents or ranks")


def parse_plan_request(data: Any, limits: Limits) -> PlanRequest:
    """Validate a JSON-like dict (the gRPC edge's path); raises FieldError."""
    try:
        body = PlanRequestIn.model_validate(data)
    except ValidationError as exc:
        raise validation_message(exc) from None
    request = to_plan_request(body, limits)
    checked_strategy(request)
    return request


def request_dict(request: PlanRequest) -> dict[str, Any]:
    """Every field of a core request, defaults included, as JSON-able data; but
    ``max_kv_tokens_per_rank`` only when set and the mask (``layers``) only when not causal,
    so a request without them keeps its content hash (``request_key``)."""
    data: dict[str, Any] = {name: getattr(request, name) for name in REQUEST_FIELDS
                            if name not in WIRE_NAMES}
    data.update(doc_lengths=list(request.doc_lengths), model=request.model.to_dict(),
                options=dict(request.options))
    if request.max_kv_tokens_per_rank is None:
        del data["max_kv_tokens_per_rank"]
    if request.mask != CAUSAL:
        data["layers"] = request.mask.to_list()
    return data


def request_key(request: PlanRequest) -> str:
    """Content hash of a request: equal for requests that must give the same plan.

    Raises FieldError if the options are not JSON data.
    """
    try:
        text = canonical_json(request_dict(request))
    except (TypeError, ValueError) as exc:
        raise FieldError("options", f"options must be JSON data: {exc}") from None
    return hashlib.sha256(text.encode()).hexdigest()
