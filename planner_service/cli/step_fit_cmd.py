"""``planner fit-step-profile``: the step-time model's profile from model-check records."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from planner_service.cli.common import console


def fit_step_profile_cmd(
    records: Annotated[Path, typer.Argument(
        help="Records JSON (cp-planner-step-records/v1 or v2, as bench/model_check.py writes)")],
    out: Annotated[Path, typer.Option(help="Where to write the fitted profile JSON")],
    name: Annotated[str | None, typer.Option(help="Profile name (default: the out file stem)")] = None,
    base_kernel: Annotated[str, typer.Option(
        help="Kernel profile whose tiling and fwd:bwd ratio the fit keeps")] = "cpu-torch",
    base_link: Annotated[str, typer.Option(
        help="Link profile kept where no exchange was measured")] = "gloo-local",
) -> None:
    """Fit the step-time model's kernel, copy and link coefficients (core/step_time/) from
    measured per-rank records; write them as a step profile JSON."""
    from planner_service.core.profile_fit import fit_file

    result = fit_file(records, out, name=name, base_kernel=base_kernel, base_link=base_link)
    table = Table(title=f"fitted step profile {result.kernel.name} -> {out}")
    for col in ("term", "records", "RMS rel. residual"):
        table.add_column(col, justify="left" if col == "term" else "right")
    for term, fit in result.report.items():
        residual = f"{fit['rms_rel_pct']:.1f}%" if "rms_rel_pct" in fit else f"kept from {fit['kept']}"
        table.add_row(term, str(fit["records"]), residual)
    console.print(table)
    k, link = result.kernel, result.link
    console.print(
        f"kernel: fwd {k.fwd_tflops:.4g} TFLOP/s, bwd {k.bwd_tflops:.4g} TFLOP/s, per call "
        f"{k.call_overhead_us:.4g} us; copies {k.copy_gbps:.4g} GB/s + {k.op_overhead_us:.4g} us "
        f"per op; link {link.bandwidth_gbps:.4g} GB/s + {link.latency_us:.4g} us per transfer")
