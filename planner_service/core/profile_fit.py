"""Fit the step-time model's coefficients (core/step_time/) from measured runtime records.

    planner fit-step-profile RECORDS.json --out PROFILE.json [--name NAME]
    python -m planner_service.core.profile_fit RECORDS.json --out PROFILE.json [--name NAME]

A record is one rank of one executed plan (``bench/model_check.py`` writes them, format
``cp-planner-step-records/v2``): the model's inputs for that rank (``fwd_flops``,
``tiles``, ``row_blocks``, ``segments``, ``calls``, ``copy_bytes``, ``copy_ops``,
``comm_bytes``, ``passes``, ``peer_steps``; ``plan_rank_terms`` gives them on the path
the rank ran, its ``flash_path`` for flash-attn) and the measured ``kernel_ms`` (the
rank's kernel calls alone), ``copy_ms`` and ``exchange_ms`` (the rank's transfers alone,
every one in full). The inputs are summed over the path's calls (on the segments path
``segments`` counts every call's document segments and ``copy_bytes`` includes the
float32 accumulators), so records of every path fit one profile. Each term is its own
linear fit with non-negative coefficients, least squares on relative error (short and
long runs weigh alike):

- kernel:   ``ms = c fwd_flops + t tiles + q row_blocks + s segments + o calls`` -> fwd/bwd
  TFLOP/s (the base profile's fwd:bwd ratio kept; one total is measured), per_tile_us,
  per_row_block_us, per_seq_us, call_overhead_us; ``s`` is 0 for a ``packed`` base (the
  PyTorch kernel loops over block pairs, never over segments);
- copies:   ``ms = b copy_bytes + k copy_ops``           -> copy_gbps, op_overhead_us;
- exchange: ``ms = w comm_bytes + l passes + p peer_steps`` -> bandwidth_gbps, latency_us,
  per_peer_us.

The exposed exchange is not fitted: the model computes it from these rates and the
runtime's structure (what overlap hides). Records of format v1 (one call and the gathered
path's COPY_OPS per record) are read too. Tile sizes and tiling stay the base profile's
(they are the kernel's loop structure, not a fitted number). ``planner fit-profile`` fits
the FCP cost model's terms (fcp/fit.py) from the profiler's timings format; this module
fits the step-time terms from runs of whole plans.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from planner_service.core.profiles import (
    KernelProfile,
    LinkProfile,
    kernel_profile_from_dict,
    link_profile_from_dict,
)
from planner_service.core.step_time import BWD_FLOP_RATIO, COPY_OPS

RECORDS_FORMAT = "cp-planner-step-records/v2"
RECORDS_FORMATS = ("cp-planner-step-records/v1", RECORDS_FORMAT)
PROFILE_FORMAT = "cp-planner-step-profile/v1"
FEATURES = ("fwd_flops", "tiles", "row_blocks", "segments", "calls", "copy_bytes", "copy_ops",
            "comm_bytes", "passes", "peer_steps")
V1_DEFAULTS = {"calls": 1, "copy_ops": COPY_OPS}
"""What a v1 record (before ``calls`` and ``copy_ops``) stands for: the gathered path."""
MEASURED = ("kernel_ms", "copy_ms", "exchange_ms")
FAST = 1e6
"""A rate (GB/s) standing for "too fast to measure" when a fitted slope is zero."""


class FitResult(NamedTuple):
    kernel: KernelProfile
    link: LinkProfile
    report: dict[str, Any]
    """Per term: coefficients, records used, RMS relative residual in percent."""


def check_records(records: Any) -> list[dict[str, Any]]:
    """The records as a list of dicts (v1 records completed with V1_DEFAULTS); ValueError
    naming the first bad field."""
    if not isinstance(records, list) or not records:
        raise ValueError("records must be a non-empty list")
    records = [{**V1_DEFAULTS, **rec} if isinstance(rec, dict) else rec for rec in records]
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ValueError(f"records[{i}] must be an object")
        for key in FEATURES + MEASURED:
            value = rec.get(key)
            if key in MEASURED and value is None:
                continue  # not measured in this record (a kernel-only run)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value >= 0
            ):
                raise ValueError(f"records[{i}].{key} must be a finite number >= 0, got {value!r}")
    return records


def nnls_relative(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative least squares of ``x c ~ y`` on relative error (rows divided by y).

    Active set by elimination: fit, drop the most negative coefficient, refit, until
    every kept coefficient is >= 0 (at most one pass per column). Rows with y <= 0 are
    skipped. Returns (coefficients, RMS relative residual in percent).
    """
    keep_rows = y > 0
    x, y = x[keep_rows], y[keep_rows]
    coef = np.zeros(x.shape[1])
    if len(y) == 0:
        return coef, 0.0
    xw, yw = x / y[:, None], np.ones(len(y))
    active = [j for j in range(x.shape[1]) if np.any(x[:, j] != 0)]
    while active:
        sol, *_ = np.linalg.lstsq(xw[:, active], yw, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    resid = yw - xw @ coef
    return coef, float(np.sqrt(np.mean(resid**2)) * 100)


def _column(records: Sequence[dict[str, Any]], key: str) -> np.ndarray:
    return np.array([float(r[key]) for r in records])


def _measured(records: Sequence[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get(key) is not None]


def fit_step_profile(
    records: Sequence[dict[str, Any]], *, base_kernel: KernelProfile, base_link: LinkProfile,
    name: str,
) -> FitResult:
    """Kernel and link profiles named ``name`` fitted from ``records`` (module docstring).
    A term with no usable records keeps the base value (a measured time may be None:
    not measured). O(records)."""
    records = check_records(list(records))
    report: dict[str, Any] = {}
    timed = _measured(records, "kernel_ms")
    if len(timed) < 2:
        raise ValueError("records need at least 2 measured kernel_ms values to fit the kernel")
    # The PyTorch kernel (packed tiling) loops over block pairs, never over segments: its
    # per-segment cost is 0 by construction, not a free coefficient.
    segments = _column(timed, "segments") * (base_kernel.tiling != "packed")
    kx = np.column_stack([_column(timed, "fwd_flops"), _column(timed, "tiles"),
                          _column(timed, "row_blocks"), segments, _column(timed, "calls")])
    kc, kres = nnls_relative(kx, _column(timed, "kernel_ms"))
    ratio = base_kernel.fwd_tflops / base_kernel.bwd_tflops
    fwd = 1e-9 * (1 + BWD_FLOP_RATIO * ratio) / kc[0] if kc[0] > 0 else FAST
    report["kernel"] = {"ms_per_flop": kc[0], "ms_per_tile": kc[1], "ms_per_row_block": kc[2],
                        "ms_per_segment": kc[3], "ms_per_call": kc[4], "rms_rel_pct": kres,
                        "records": len(timed)}

    copied = _measured(records, "copy_ms")
    copy_changes: dict[str, Any] = {}
    if len(copied) >= 2:
        cx = np.column_stack([_column(copied, "copy_bytes"), _column(copied, "copy_ops")])
        cc, cres = nnls_relative(cx, _column(copied, "copy_ms"))
        copy_changes = {"copy_gbps": 1e-6 / cc[0] if cc[0] > 0 else FAST,
                        "op_overhead_us": cc[1] * 1e3}
        report["copy"] = {"ms_per_byte": cc[0], "ms_per_op": cc[1], "rms_rel_pct": cres,
                          "records": len(copied)}
    else:
        report["copy"] = {"kept": base_kernel.name, "records": len(copied)}

    moving = [r for r in _measured(records, "exchange_ms") if r["passes"] > 0]
    link = base_link
    if len(moving) >= 2:
        ex = np.column_stack([_column(moving, "comm_bytes"), _column(moving, "passes"),
                              _column(moving, "peer_steps")])
        ec, eres = nnls_relative(ex, _column(moving, "exchange_ms"))
        link = replace(
            base_link, name=name, bandwidth_gbps=1e-6 / ec[0] if ec[0] > 0 else FAST,
            latency_us=ec[1] * 1e3, per_peer_us=ec[2] * 1e3,
            source=f"fitted from {len(moving)} exchange records",
        )
        report["exchange"] = {"ms_per_byte": ec[0], "ms_per_pass": ec[1], "ms_per_peer_step": ec[2],
                              "rms_rel_pct": eres, "records": len(moving)}
    else:
        report["exchange"] = {"kept": base_link.name, "records": len(moving)}
    kernel = replace(
        base_kernel, name=name, fwd_tflops=fwd, bwd_tflops=fwd / ratio,
        per_tile_us=kc[1] * 1e3, per_row_block_us=kc[2] * 1e3, per_seq_us=kc[3] * 1e3,
        call_overhead_us=kc[4] * 1e3, **copy_changes,
        source=f"fitted from {len(records)} rank records; tiling of {base_kernel.name}",
    )
    return FitResult(kernel, link, report)


def profile_document(result: FitResult) -> dict[str, Any]:
    return {"format": PROFILE_FORMAT, "kernel": result.kernel.to_dict(),
            "link": result.link.to_dict(), "fit": result.report}


def load_step_profile(path: str | Path) -> tuple[KernelProfile, LinkProfile]:
    """Read a profile JSON this module wrote; ValueError naming the path and field."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"format must be {PROFILE_FORMAT!r}")
        return kernel_profile_from_dict(data["kernel"]), link_profile_from_dict(data["link"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"step profile file {path}: {exc}") from None


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a records JSON (RECORDS_FORMATS), checked; ValueError naming the path
    and what is wrong (missing, unreadable, not JSON, wrong format, a bad record)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ValueError(f"records file {path}: {reason}") from None
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("format") not in RECORDS_FORMATS:
            raise ValueError(f"format must be one of {', '.join(map(repr, RECORDS_FORMATS))}")
        return check_records(doc.get("records"))
    except ValueError as exc:
        raise ValueError(f"records file {path}: {exc}") from None


def fit_file(records: str | Path, out: str | Path, *, name: str | None = None,
             base_kernel: str = "cpu-torch", base_link: str = "gloo-local") -> FitResult:
    """Fit the records file ``records`` and write the profile JSON to ``out`` (profile name
    ``name`` or the out file's stem); ValueError for a bad file, name or fit."""
    from planner_service.core.profiles import get_kernel_profile, get_link_profile

    result = fit_step_profile(load_records(records), base_kernel=get_kernel_profile(base_kernel),
                              base_link=get_link_profile(base_link), name=name or Path(out).stem)
    Path(out).write_text(json.dumps(profile_document(result), indent=1) + "\n", encoding="utf-8")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default=None)
    parser.add_argument("--base-kernel", default="cpu-torch")
    parser.add_argument("--base-link", default="gloo-local")
    args = parser.parse_args(argv)
    try:
        result = fit_file(args.records, args.out, name=args.name, base_kernel=args.base_kernel,
                          base_link=args.base_link)
    except (OSError, ValueError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(json.dumps(profile_document(result)["fit"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
