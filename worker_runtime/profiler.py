"""Time the attention kernel and the KV exchange for given shard layouts and write the
timings file the cost-model fitting reads (format ``cp-planner-timings/v1``)::

    {"format": "cp-planner-timings/v1", "device": "<text>", "dtype": "float32|bfloat16",
     "model": {ModelSpec fields},
     "records": [{"op": "attention", "seq_tokens": int, "degree": int, "causal": true,
                  "num_docs": int, "ms": float},
                 {"op": "comm", "seq_tokens": int, "degree": int, "bytes": int, "ms": float}]}

An attention record is the forward+backward kernel time of one rank's own shards of a
packed sequence of ``seq_tokens`` tokens (``num_docs`` docs) split over ``degree`` ranks.
A comm record is one rank's forward KV exchange: ``bytes`` received in ``ms``.
The same code runs on CPU (torch kernel, gloo) and GPU (PyTorch's FlashAttention, NCCL).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from planner_service.core.model import ModelSpec
from planner_service.core.plan import Plan, Shard
from worker_runtime.aten_flash import choose_kernel
from worker_runtime.attention import ContextParallelAttention
from worker_runtime.kernels import build_meta, varlen_attention
from worker_runtime.paths.segment_kernels import SegmentVarlen

TIMINGS_FORMAT = "cp-planner-timings/v1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class AttentionRecord(NamedTuple):
    seq_tokens: int
    degree: int
    num_docs: int
    ms: float

    def to_dict(self) -> dict[str, Any]:
        return {"op": "attention", "seq_tokens": self.seq_tokens, "degree": self.degree,
                "causal": True, "num_docs": self.num_docs, "ms": self.ms}


class CommRecord(NamedTuple):
    seq_tokens: int
    degree: int
    bytes: int
    ms: float

    def to_dict(self) -> dict[str, Any]:
        return {"op": "comm", "seq_tokens": self.seq_tokens, "degree": self.degree,
                "bytes": self.bytes, "ms": self.ms}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], Any], device: torch.device, *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn`` in ms over ``repeats`` runs after ``warmup`` runs."""
    times = []
    for i in range(warmup + repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_shards(
    shards: Sequence[Shard],
    model: ModelSpec,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    kernel: str = "auto",
    repeats: int = 5,
    seed: int = 0,
) -> float:
    """Forward+backward kernel ms for one rank's shards (queries of shard (d, s, e) against
    e keys), with random inputs; no communication. The kernel is the one the runtime's
    gathered path runs under ``kernel`` (``aten_flash.choose_kernel``: PyTorch's own
    FlashAttention on CUDA in half precision by default, else flash-attn's public varlen
    function, else the torch kernel)."""
    device = torch.device(device)
    lq = np.array([s.end - s.start for s in shards], dtype=np.int64)
    lk = np.array([s.end for s in shards], dtype=np.int64)
    cu_q, cu_k = np.concatenate(([0], np.cumsum(lq))), np.concatenate(([0], np.cumsum(lk)))
    gen = torch.Generator(device=device).manual_seed(seed)
    h, g, d = model.num_heads, model.num_kv_heads, model.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_()

    q, k, v = rand(int(lq.sum()), h, d), rand(int(lk.sum()), g, d), rand(int(lk.sum()), g, d)
    grad = torch.randn(q.shape, generator=gen, device=device, dtype=dtype)
    found, flash_gathered = choose_kernel(kernel, q, "gathered")
    if found is not None:
        seg_meta = found.meta(cu_q, cu_k, True, device)
    else:
        meta = build_meta(cu_q, cu_k, device)
        gathered_kernel = "flash" if flash_gathered else "torch"

    def step() -> None:
        if found is not None:
            out = SegmentVarlen.apply(q, k, v, found, seg_meta, d**-0.5)
        else:
            out = varlen_attention(q, k, v, meta, d**-0.5, gathered_kernel)
        torch.autograd.grad(out, (q, k, v), grad)

    return median_ms(step, device, repeats=repeats)


def attention_records(
    plan: Plan,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    kernel: str = "auto",
    repeats: int = 5,
    model: ModelSpec | None = None,
) -> list[AttentionRecord]:
    """One record per rank of every group of ``plan``, ranks timed one after another."""
    model = model or plan.model
    records = []
    for group in plan.groups:
        seq_tokens = sum(plan.doc_lengths[d] for d in group.docs)
        for shards in group.shards:
            ms = time_shards(shards, model, dtype=dtype, device=device, kernel=kernel, repeats=repeats)
            records.append(AttentionRecord(seq_tokens, len(group.ranks), len(group.docs), ms))
    return records


def comm_record(
    attn: ContextParallelAttention,
    model: ModelSpec,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    repeats: int = 5,
) -> CommRecord | None:
    """This rank's forward KV exchange time (collective: every rank of the group calls it).
    None for a rank in no group."""
    lay = attn.layout
    if lay.group_index < 0:
        return None
    device = torch.device(device)
    kv = torch.randn((lay.num_tokens, 2, model.num_kv_heads, model.head_dim), dtype=dtype, device=device)
    exchanger = attn.exchanger(device)
    before = attn.counter.forward_bytes
    ms = median_ms(lambda: exchanger.forward(kv), device, repeats=repeats)
    nbytes = (attn.counter.forward_bytes - before) // (repeats + 1)
    group = attn.plan.groups[lay.group_index]
    seq_tokens = sum(attn.plan.doc_lengths[d] for d in group.docs)
    return CommRecord(seq_tokens, lay.num_ranks, nbytes, ms)


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def timings_document(
    records: Iterable[AttentionRecord | CommRecord],
    *,
    device: str,
    dtype: torch.dtype,
    model: ModelSpec,
) -> dict[str, Any]:
    """The timings file's JSON object; raises ValueError for a dtype the format lacks."""
    names = {v: k for k, v in DTYPES.items()}
    if dtype not in names:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    return {"format": TIMINGS_FORMAT, "device": device, "dtype": names[dtype],
            "model": model.to_dict(), "records": [r.to_dict() for r in records]}


def write_timings(path: str | Path, document: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def read_timings(path: str | Path) -> dict[str, Any]:
    """Load and check a timings file; raises ValueError naming the first bad field."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != TIMINGS_FORMAT:
        raise ValueError(f"timings format must be {TIMINGS_FORMAT!r}, got {data.get('format')!r}")
    if data.get("dtype") not in DTYPES:
        raise ValueError(f"timings dtype must be one of {', '.join(DTYPES)}, got {data.get('dtype')!r}")
    ModelSpec.from_dict(dict(data["model"]))
    keys = {"attention": {"op", "seq_tokens", "degree", "causal", "num_docs", "ms"},
            "comm": {"op", "seq_tokens", "degree", "bytes", "ms"}}
    for i, rec in enumerate(data["records"]):
        if set(rec) != keys.get(rec.get("op"), set()):
            raise ValueError(f"records[{i}] must have exactly the fields of op 'attention' or 'comm'")
    return data
