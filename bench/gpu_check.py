"""The worker runtime's GPU check on one CUDA device, runnable on a bare GPU machine.

    python -m bench.gpu_check --out DIR          # from the repository folder
    python -m bench.gpu_check --cpu-smoke DIR    # the same stages on CPU at 1/256 scale (CI)

Needs Python 3.11+, PyTorch (CUDA build; the kernels are PyTorch's own FlashAttention) and
numpy; no flash-attn, no package index, no data folder, no service dependencies (a test
checks the import graph). Its data set is WLB-LLM's document lengths (``make_source
("wlbllm")``) where the project ships or finds them, else the Pile family
(planner_service/data/families.py), noted in the output. Stages, one line each on stdout
with its time; each writes ``DIR/<n>_<stage>.md`` and ``.json`` as it ends and
``DIR/gpu_check.md`` collects what has finished, so a cut-short run keeps its stages:

1. ``environment``: device, torch version, the aten ops' feature checks, FlashAttention
   impls, whether flash-attn is installed, the data set.
2. ``correctness``: bf16 (float32 in the smoke) forward and backward of every path against
   the float64 reference (``reference_attention``), GQA (8 heads on 2 KV heads), plans of
   four strategies on N = 4 simulated ranks: the segments path, the segment ring and the
   gathered path on every usable segment kernel (PyTorch's FlashAttention; flash-attn where
   installed), and the PyTorch block kernel's lean path. Pass: TransformerEngine's bf16 CP
   tolerance, ``|got - ref| <= 2.5e-2 + 2.5e-2 |ref|`` everywhere.
3. ``windows``: every usable segment kernel's windowed varlen call (``window_size_left =
   W - 1``, windows 1, 7, 128, 4,096, segments with no, half and a full halo), forward and
   backward against the float64 reference kernel (bench/gpu_check_windows.py), same
   tolerance.
4. ``timings``: per rank, fwd+bwd ms of each path without the exchange (kernel calls,
   merges and the buffer gathers from global tensors), flashcp and zigzag plans of one
   packed 128K sequence, N = 8, Llama-3-8B attention (32 heads, 8 KV heads, head dim 128).
5. ``figure3``: FlashCP's Figure 3 effect, per-rank fwd+bwd ms of per_doc vs flashcp plans
   on the segments path (one 128K doc; 16 docs of 8K), ranks one after another.
6. ``model_check``: the step-time model on this GPU: per rank of plans of four strategies
   at N in {2, 4, 8}, the segments path's kernel calls alone (kernel term) and the path
   without the exchange (copies = that - kernel); the profile is fitted on half the plans
   (core/profile_fit.py) and predicts the other half, beside the cited profile's prediction.
7. ``fcp_timings``: profiler timings of flashcp and zigzag plans (each rank's one gathered
   call) into ``DIR/timings_gpu.json``, for FCP's cost-model fit (``planner fit-profile``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from bench import gpu_check_stages as stages
from bench.gpu_check_windows import windows
from planner_service.core.model import ModelSpec
from planner_service.data import make_source
from worker_runtime.aten_flash import aten_segments, flash_impl, load_aten_ops
from worker_runtime.kernels import flash_attn_available
from worker_runtime.paths.segment_kernels import (
    FlashApiError,
    ReferenceSegments,
    SegmentKernel,
    flash_segments,
)
from worker_runtime.profiler import device_name

SMOKE_SCALE = 256
TOL = 2.5e-2
"""TransformerEngine's bf16 context-parallel tolerance (atol = rtol)."""


class Setup(NamedTuple):
    device: torch.device
    dtype: torch.dtype
    scale: int
    """Token counts are divided by this (SMOKE_SCALE in the smoke)."""
    repeats: int
    warmup: int
    """Untimed runs before the timed ones (0 in the smoke)."""
    model: ModelSpec
    """Llama-3-8B attention (the smoke: a tiny one)."""
    check_model: ModelSpec
    """The correctness stage's shape (GQA 4:1)."""
    kernels: dict[str, SegmentKernel]
    source: Any
    source_note: str


def data_source() -> tuple[Any, str]:
    """WLB-LLM's lengths, else the Pile family with a note saying so."""
    try:
        return make_source("wlbllm"), "wlbllm (WLB-LLM document lengths)"
    except ValueError as exc:
        return make_source("family:pile"), f"family:pile, because wlbllm is not available here ({exc})"


def setup(args: argparse.Namespace) -> Setup | None:
    source, note = data_source()
    if args.cpu_smoke:
        torch.set_num_threads(1)  # tiny tensors: a thread pool only spin-waits
        return Setup(torch.device("cpu"), torch.float32, SMOKE_SCALE, 1, 0,
                     ModelSpec(num_heads=4, num_kv_heads=2, head_dim=16),
                     ModelSpec(num_heads=4, num_kv_heads=1, head_dim=16),
                     {"reference": ReferenceSegments()}, source, note)
    if not torch.cuda.is_available():
        return None
    dev, dtype, d = torch.device("cuda"), torch.bfloat16, 128
    kernels: dict[str, SegmentKernel] = {}
    found = aten_segments(dev, dtype, d)
    if found is not None:
        kernels["aten"] = found
    if installed("flash_attn") and flash_attn_available(dev):
        flash = flash_segments(dev, dtype, d)
        if flash is not None:
            kernels["flash"] = flash
    return Setup(dev, dtype, 1, args.repeats, 1, ModelSpec(),
                 ModelSpec(num_heads=8, num_kv_heads=2, head_dim=d), kernels, source, note)


def installed(module: str) -> bool:
    """Whether ``module`` can be found (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def environment(s: Setup) -> stages.Stage:
    try:
        load_aten_ops()
        aten = "present, schemas as expected"
    except FlashApiError as exc:
        aten = f"refused: {exc}"
    import torch.nn.attention as tna

    listed = getattr(tna, "list_flash_attention_impls", None)
    rows = [
        ("device", device_name(s.device)), ("torch", torch.__version__),
        ("dtype", str(s.dtype)), ("sizes", f"/ {s.scale}"),
        ("aten._flash_attention_forward/_backward", aten),
        ("FlashAttention impl behind them", flash_impl()),
        ("impls registered in torch (packages may be missing)", ", ".join(listed()) if listed else "no registry in this torch"),
        ("flash-attn installed", str(installed("flash_attn"))),
        ("segment kernels passing the probe", ", ".join(s.kernels) or "none"),
        ("data set", s.source_note),
    ]
    md = ["| item | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)]
    return stages.Stage(md, dict(rows), True, f"kernels: {', '.join(s.kernels) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_check"),
                        help="folder for the stage tables (default bench/results/gpu_check)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu-smoke", type=Path, metavar="DIR",
                        help="run every stage on CPU at 1/256 scale, writing into DIR")
    args = parser.parse_args(argv)
    s = setup(args)
    if s is None:
        print("gpu_check: no CUDA device; nothing run, nothing written")
        return 0
    out = args.cpu_smoke or args.out
    out.mkdir(parents=True, exist_ok=True)
    header = [
        "# Worker runtime GPU check", "",
        f"Command: `python -m bench.gpu_check {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "", f"Device: {device_name(s.device)}; torch {torch.__version__}; {s.dtype}; sizes / {s.scale}.", "",
    ]
    runs: list[tuple[str, Callable[[Setup], stages.Stage]]] = [
        ("environment", environment), ("correctness", lambda x: stages.correctness(x, TOL)),
        ("windows", lambda x: windows(x, TOL)),
        ("timings", stages.timings), ("figure3", stages.figure3), ("model_check", stages.model_check),
        ("fcp_timings", lambda x: stages.fcp_timings(x, out)),
    ]
    ok, done = True, []
    start = time.perf_counter()
    for i, (name, fn) in enumerate(runs, start=1):
        t0 = time.perf_counter()
        try:
            stage = fn(s)
        except Exception as exc:  # noqa: BLE001 - a failed stage is reported, the rest still run
            stage = stages.Stage([f"failed: {type(exc).__name__}: {exc}"], {"error": str(exc)}, False,
                                 f"{type(exc).__name__}: {exc}")
        seconds = time.perf_counter() - t0
        ok = ok and stage.ok
        path = out / f"{i}_{name}.md"
        section = [f"## {i}. {name} ({seconds:.1f} s){'' if stage.ok else ' -- FAILED'}", "", *stage.md, ""]
        path.write_text("\n".join(section) + "\n")
        path.with_suffix(".json").write_text(json.dumps({"seconds": seconds, "ok": stage.ok,
                                                         **stage.data}, indent=1, default=str))
        done += section
        (out / "gpu_check.md").write_text("\n".join(header + done) + "\n")
        print(f"gpu_check stage {i} {name}: {seconds:.1f} s, {'ok' if stage.ok else 'FAILED'}, "
              f"{stage.summary or ''} -> {path}", flush=True)
    print(f"gpu_check: {time.perf_counter() - start:.1f} s in all, {'ok' if ok else 'FAILED'}; "
          f"tables in {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
