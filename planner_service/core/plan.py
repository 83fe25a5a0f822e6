"""The plan: the single contract between the planner and the worker runtime.

JSON form (docs/plan.md)::

    {"version": 1, "strategy": "flashcp", "cp_size": 4, "doc_lengths": [...],
     "context_length": 131072, "comm_mode": "alltoallv", "model": {...},
     "kernel": "h100-fa3", "link": "nvlink",
      "mask": [{"window": 1024, "count": 5}, {"window": null, "count": 1}],
     "groups": [{"ranks": [0, 1, 2, 3], "docs": [0, 1, ...],
                 "shards": [[{"doc": 0, "start": 0, "end": 4096}, ...], ...],
                 "padding": [0, 0, 0, 3], "metrics": {...}, "rank_stats": {...}}],
     "metrics": {...}, "info": {...}, "plan_id": "<sha256 of everything else>"}

Shard positions are doc-relative. On each rank, shards are sorted by (doc, start) and
the rank's local token buffer is those shards in that order followed by its padding.
The plan holds no timing: solve time is reported beside it so that the same request
gives the same plan byte for byte.

``mask`` (core/mask.py, the ``layers`` JSON shape) is present only for a mask that is not
causal in every layer; a causal plan has no such key, so its bytes and plan_id are those
of a plan made before masks existed. Under a mask the metrics' work and exchange figures
are layer-weighted and each metrics and rank_stats object carries a ``layers`` list of
per-window figures (core/metrics.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import numpy as np

from planner_service.core.mask import CAUSAL, AttentionMask, parse_layers
from planner_service.core.model import ModelSpec

PLAN_VERSION = 1


class Shard(NamedTuple):
    """Tokens ``[start, end)`` of document ``doc`` (doc-relative positions).

    A NamedTuple: solvers create many, and tuple order is (doc, start, end).
    """

    doc: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, int]:
        return {"doc": self.doc, "start": self.start, "end": self.end}


@dataclass(frozen=True, kw_only=True, slots=True)
class Metrics:
    """Plan quality figures, all recomputable from the shards (see core/metrics.py)."""

    imbalance: float
    """Max over ranks of attention workload / mean over ranks (1.0 is perfect)."""
    max_workload: int
    """Query-key pairs on the busiest rank."""
    mean_workload: float
    comm_mode: str
    """The exchange the runtime uses: full, compact_allgather, alltoallv or p2p_ring."""
    comm_tokens: int
    """KV tokens received by the rank that receives most, in ``comm_mode``, per pass."""
    full_comm_tokens: int
    """Same for a full exchange: (N - 1) x tokens per rank."""
    compact_allgather_tokens: int
    """Compact all-gather, padded to equal buffers: (N - 1) x largest buffer."""
    alltoallv_tokens: int
    """Exact all-to-all-v: what the neediest rank lacks of the prefixes it attends."""
    comm_saving: float
    """1 - comm_tokens / full_comm_tokens (0 when nothing moves either way)."""
    comm_saving_allgather: float
    comm_saving_alltoallv: float
    comm_bytes: int
    """comm_tokens in bytes per layer per pass (K and V)."""
    full_comm_bytes: int
    est_step_ms: float
    """Per-layer forward+backward estimate: max over ranks of attention + comm + linear."""
    est_attn_ms: float
    """Attention kernel time of the rank that sets est_step_ms."""
    est_comm_ms: float
    """Exposed communication time of that rank."""
    est_linear_ms: float
    """Linear-layer time of that rank (same on every rank: equal tokens)."""
    tokens_per_rank: int
    """Tokens per rank including padding (the max over groups for multi-group plans)."""
    padding_tokens: int
    num_shards: int
    num_split_docs: int
    """Documents placed on more than one rank."""
    layers: tuple[LayerMetrics, ...] | None = None
    """Under a mask that is not causal (the plan's ``mask``): the figures of one layer of
    each window, in the mask's group order; None (and absent from the JSON) for causal."""

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "layers"}
        if self.layers is not None:
            out["layers"] = [layer.to_dict() for layer in self.layers]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Metrics:
        data = dict(data)
        if data.get("layers") is not None:
            data["layers"] = tuple(LayerMetrics(**layer) for layer in data["layers"])
        return cls(**data)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerMetrics:
    """The figures of one layer of one window of a plan's mask (per layer, not weighted)."""

    window: int | None
    """The window (None: causal)."""
    count: int
    """Layers of the model with this window."""
    imbalance: float
    max_workload: int
    mean_workload: float
    comm_tokens: int
    """KV tokens received by the rank that receives most, in the plan's comm mode."""
    alltoallv_tokens: int
    compact_allgather_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, kw_only=True, slots=True)
class RankStats:
    """Per-rank figures of one group, in the group's rank order."""

    tokens: tuple[int, ...]
    """Real (non-padding) tokens per rank."""
    workload: tuple[int, ...]
    alltoallv_recv: tuple[int, ...]
    """KV tokens each rank receives in the exact all-to-all-v."""
    allgather_send: tuple[int, ...]
    """Compact all-gather buffer each rank contributes (before padding to equal size)."""
    kv_tokens_peak: tuple[int, ...]
    """KV tokens the worker runtime holds at once per layer on each rank in the plan's comm
    mode (``cost.kv_tokens_peak``): what a per-rank KV memory bound limits. Under a mask:
    the largest over its windows."""
    layers: tuple[RankLayerStats, ...] | None = None
    """Under a mask that is not causal: per window, the per-rank figures of one layer;
    None (absent from the JSON) for causal. ``workload``, ``alltoallv_recv`` and
    ``allgather_send`` above are then the layer-weighted sums over all layers."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: list(getattr(self, f.name)) for f in fields(self)
                               if f.name != "layers"}
        if self.layers is not None:
            out["layers"] = [layer.to_dict() for layer in self.layers]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankStats:
        layers = data.get("layers")
        return cls(**{k: tuple(v) for k, v in data.items() if k != "layers"},
                   layers=None if layers is None else tuple(
                       RankLayerStats(window=layer["window"], **{
                           k: tuple(v) for k, v in layer.items() if k != "window"})
                       for layer in layers))


@dataclass(frozen=True, kw_only=True, slots=True)
class RankLayerStats:
    """Per-rank figures of one layer of one window of the mask, in group rank order."""

    window: int | None
    workload: tuple[int, ...]
    alltoallv_recv: tuple[int, ...]
    allgather_send: tuple[int, ...]
    kv_tokens_peak: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"window": self.window, **{f.name: list(getattr(self, f.name))
                                          for f in fields(self) if f.name != "window"}}


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """One CP group: its ranks, its documents and the shards on each rank."""

    ranks: tuple[int, ...]
    docs: tuple[int, ...]
    """Indices into the plan's doc_lengths, ascending."""
    shards: tuple[tuple[Shard, ...], ...]
    """shards[i] are the shards of ranks[i], sorted by (doc, start)."""
    padding: tuple[int, ...]
    """Padding tokens appended on each rank so every rank holds the same count."""
    metrics: Metrics
    rank_stats: RankStats

    def to_dict(self, *, shards: bool = True) -> dict[str, Any]:
        """The group as JSON-able dict (``shards=False``: without its shards)."""
        return {
            "ranks": list(self.ranks),
            "docs": list(self.docs),
            # Shard.to_dict inlined (one dict per shard: the bulk of a plan's JSON).
            "shards": [[{"doc": d, "start": a, "end": b} for d, a, b in rank] for rank in self.shards]
            if shards else [],
            "padding": list(self.padding),
            "metrics": self.metrics.to_dict(),
            "rank_stats": self.rank_stats.to_dict(),
        }

    def to_json(self, *, docs_json: str | None = None, shards_json: str | None = None) -> str:
        """``canonical_json(self.to_dict())``, with the shards (the bulk of a plan) written
        directly instead of as one dict each: about 3x faster. ``docs_json`` and
        ``shards_json``: the JSON of the docs and of the shards where already made (by
        ``int_list_json`` and ``shards_json``, from the same figures)."""
        if shards_json is None:
            shards = ",".join([
                "[" + ",".join([f'{{"doc":{d},"end":{b},"start":{a}}}' for d, a, b in rank]) + "]"
                for rank in self.shards
            ])
            shards_json = f"[{shards}]"
        items = {**self.to_dict(shards=False), "shards": _Raw(shards_json)}
        if docs_json is not None:
            items["docs"] = _Raw(docs_json)
        return _object_json(items)


class MadeTexts(NamedTuple):
    """``Plan.made``: per group of ``groups``, the JSON of its docs and of its shards (None
    where not made)."""

    groups: tuple[Group, ...]
    texts: Sequence[tuple[str, str] | None]


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A complete plan for one packed sequence (or one FCP micro-batch)."""

    strategy: str
    cp_size: int
    doc_lengths: tuple[int, ...]
    context_length: int | None
    comm_mode: str
    model: ModelSpec
    kernel: str
    link: str
    groups: tuple[Group, ...]
    metrics: Metrics
    info: dict[str, Any]
    """Solver extras (JSON scalars and lists), e.g. ILP status and gap, per-doc docs."""
    plan_id: str
    mask: AttentionMask = CAUSAL
    """The attention mask the plan was made for (JSON ``mask`` only when not causal)."""
    made: MadeTexts | None = field(default=None, compare=False, repr=False)
    """The JSON of its groups' docs and shards as ``build_plan`` made them for the plan_id,
    so ``to_json`` (the service's answer) does not write them again; not part of the
    plan's content (used only while ``groups`` is the tuple they were made from)."""

    def body_dict(self, *, groups: bool = True) -> dict[str, Any]:
        """Everything but plan_id: what the content hash covers (``groups=False``: with an
        empty list of groups)."""
        return {
            "version": PLAN_VERSION,
            "strategy": self.strategy,
            "cp_size": self.cp_size,
            "doc_lengths": list(self.doc_lengths),
            "context_length": self.context_length,
            "comm_mode": self.comm_mode,
            "model": self.model.to_dict(),
            "kernel": self.kernel,
            "link": self.link,
            "groups": [g.to_dict() for g in self.groups] if groups else [],
            "metrics": self.metrics.to_dict(),
            "info": self.info,
            **({} if self.mask.is_causal else {"mask": self.mask.to_list()}),
        }

    def body_json(self, *, made: Sequence[tuple[str, str] | None] | None = None,
                  **extra: Any) -> str:
        """``canonical_json(self.body_dict() | extra)``, the groups by ``Group.to_json``;
        ``made``: per group, the JSON of its docs and shards where already made (default:
        the plan's own ``made``)."""
        if made is None and self.made is not None and self.made.groups is self.groups:
            made = self.made.texts
        groups = ",".join([
            g.to_json() if texts is None else g.to_json(docs_json=texts[0], shards_json=texts[1])
            for g, texts in zip(self.groups, made or [None] * len(self.groups), strict=True)
        ])
        return _object_json({**self.body_dict(groups=False), "groups": _Raw(f"[{groups}]"), **extra})

    def to_dict(self) -> dict[str, Any]:
        return {**self.body_dict(), "plan_id": self.plan_id}

    def to_json(self, *, indent: int | None = None) -> str:
        """Canonical JSON: sorted keys, no spaces; identical bytes for identical plans."""
        if indent is None:
            return self.body_json(plan_id=self.plan_id)
        return json.dumps(self.to_dict(), sort_keys=True, indent=indent)

    def rank_shards(self, rank: int) -> tuple[Shard, ...]:
        """Shards of a global rank; empty for a rank in no group."""
        for group in self.groups:
            if rank in group.ranks:
                return group.shards[group.ranks.index(rank)]
        return ()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Parse a plan dict; raises ValueError naming a missing or malformed field.

        Only the structure is checked here; ``validate_plan`` checks the content.
        """
        try:
            if data.get("version", PLAN_VERSION) != PLAN_VERSION:
                raise ValueError(f"plan.version must be {PLAN_VERSION}, got {data['version']!r}")
            groups = tuple(_group_from_dict(g) for g in data["groups"])
            return cls(
                strategy=str(data["strategy"]),
                cp_size=int(data["cp_size"]),
                doc_lengths=tuple(int(x) for x in data["doc_lengths"]),
                context_length=(
                    None if data.get("context_length") is None else int(data["context_length"])
                ),
                comm_mode=str(data["comm_mode"]),
                model=ModelSpec.from_dict(dict(data["model"])),
                kernel=str(data["kernel"]),
                link=str(data["link"]),
                groups=groups,
                metrics=Metrics.from_dict(data["metrics"]),
                info=dict(data.get("info", {})),
                plan_id=str(data["plan_id"]),
                mask=CAUSAL if data.get("mask") is None else parse_layers(data["mask"], "mask"),
            )
        except KeyError as exc:
            raise ValueError(f"plan is missing field {exc.args[0]!r}") from None
        except TypeError as exc:
            raise ValueError(f"plan has a malformed field: {exc}") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        return cls.from_dict(json.loads(text))


def _group_from_dict(data: dict[str, Any]) -> Group:
    return Group(
        ranks=tuple(int(r) for r in data["ranks"]),
        docs=tuple(int(d) for d in data["docs"]),
        shards=tuple(
            tuple(Shard(doc=int(s["doc"]), start=int(s["start"]), end=int(s["end"])) for s in rank)
            for rank in data["shards"]
        ),
        padding=tuple(int(p) for p in data["padding"]),
        metrics=Metrics.from_dict(data["metrics"]),
        rank_stats=RankStats.from_dict(data["rank_stats"]),
    )


def canonical_json(data: Any) -> str:
    """JSON with sorted keys and no whitespace; floats use Python's shortest repr."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)


def content_hash(body: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a plan body (hex)."""
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def plan_hash(plan: Plan, *, made: Sequence[tuple[str, str] | None] | None = None) -> str:
    """``content_hash(plan.body_dict())`` from ``Plan.body_json`` (faster; ``made``: as
    there)."""
    return hashlib.sha256(plan.body_json(made=made).encode()).hexdigest()


# The JSON of many integers at once, in numpy: each value's decimal digits right-aligned in
# a row of bytes as wide as the largest value's, the zero bytes before them dropped. Equal
# to ``canonical_json`` of the same Python ints (tests compare them).

_POW10 = 10 ** np.arange(19, dtype=np.int64)


def _digit_rows(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each value's digit count, (len, width) uint8 rows of its ASCII digits right-aligned
    after zero bytes) for non-negative int64 ``values`` (at least one)."""
    top = int(values.max())
    width = len(str(top))
    counts = np.maximum(np.searchsorted(_POW10, values, side="right"), 1)
    rest: np.ndarray = values.astype(np.uint32 if top < 1 << 32 else np.uint64)
    rows = np.empty((len(values), width), dtype=np.uint8)
    for col in range(width - 1, 0, -1):
        np.remainder(rest, 10, out=rows[:, col], casting="unsafe")
        rest = np.floor_divide(rest, 10, out=rest)
    rows[:, 0] = rest  # the leading digit of the widest
    rows += ord("0")
    rows *= np.arange(width) >= (width - counts)[:, None]
    return counts, rows


def _joined_rows(parts: Sequence[bytes | np.ndarray], count: int) -> tuple[str, np.ndarray]:
    """(the rows' text, each row's end in it): row i is ``parts`` in order, the bytes as
    they are and each array's value i in decimal."""
    sizes = np.full(count, sum(len(p) for p in parts if isinstance(p, bytes)), dtype=np.int64)
    columns = []
    for part in parts:
        if isinstance(part, bytes):
            columns.append(np.broadcast_to(np.frombuffer(part, dtype=np.uint8), (count, len(part))))
        else:
            digits, rows = _digit_rows(part)
            sizes += digits
            columns.append(rows)
    rows = np.concatenate(columns, axis=1)
    ends = np.cumsum(sizes)
    return rows[rows != 0].tobytes().decode("ascii"), ends


def int_list_json(values: np.ndarray) -> str:
    """``canonical_json`` of non-negative int64 ``values`` as a list. O(values x digits)."""
    if not len(values):
        return "[]"
    text, _ = _joined_rows((values, b","), len(values))
    return f"[{text[:-1]}]"


def shards_json(doc: np.ndarray, start: np.ndarray, end: np.ndarray, bounds: np.ndarray) -> str:
    """The JSON of a group's shards (``Group.to_json``'s "shards") given as non-negative
    int64 arrays, rank i's shards at entries ``bounds[i]:bounds[i + 1]``. O(s x digits)."""
    n = len(bounds) - 1
    if not len(doc):
        return "[" + ",".join(["[]"] * n) + "]"
    text, ends = _joined_rows((b'{"doc":', doc, b',"end":', end, b',"start":', start, b"},"),
                              len(doc))
    cuts = np.concatenate(([0], ends))[bounds].tolist()
    return "[" + ",".join([
        f"[{text[cuts[i]:cuts[i + 1] - 1]}]" if cuts[i + 1] > cuts[i] else "[]" for i in range(n)
    ]) + "]"


class _Raw(str):
    """JSON text already canonical, placed as is by ``_object_json``."""


def _object_json(items: dict[str, Any]) -> str:
    """``canonical_json(items)`` where some values are ``_Raw`` canonical JSON text."""
    return "{" + ",".join(
        f"{canonical_json(key)}:{value if isinstance(value, _Raw) else canonical_json(value)}"
        for key, value in sorted(items.items())
    ) + "}"
