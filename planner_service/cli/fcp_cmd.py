"""``planner schedule`` (FCP over a batch of sequences) and ``planner fit-profile``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from planner_service.cli.common import console, fail, note
from planner_service.cli.mask_opts import HfConfig, Layers, Window, mask_of
from planner_service.fcp.cost_model import DEFAULT_PROFILE, PROFILES, get_profile
from planner_service.fcp.requests import FcpResult
from planner_service.solvers.balance import missed
from planner_service.solvers.fcp_schedule import ScheduleRequest
from planner_service.solvers.fcp_schedule import schedule as run_schedule


def _batch(
    sequences: str | None, dataset: str | None, num_sequences: int, max_tokens: int,
    packed: bool, seed: int,
) -> list[list[int]]:
    if (sequences is None) == (dataset is None):
        raise fail("give exactly one of --sequences or --dataset")
    if sequences is not None:
        try:
            return [[int(x) for x in seq.split(",") if x.strip()]
                    for seq in sequences.replace(" ", "").split(";") if seq]
        except ValueError:
            raise fail(f"--sequences must look like '4096,100;8000', got {sequences!r}") from None
    from planner_service.data import make_source, pack_sequences_variable, sample_batch

    assert dataset is not None
    try:
        source = make_source(dataset)
        if packed:
            return pack_sequences_variable(source, max_tokens=max_tokens,
                                           num_sequences=num_sequences, seed=seed)
        return sample_batch(source, num_sequences=num_sequences, max_tokens=max_tokens, seed=seed)
    except ValueError as exc:
        raise ValueError(f"--dataset {dataset}: {exc}") from exc


def _degree_mix(degrees: list[int]) -> str:
    counts: dict[int, int] = {}
    for d in degrees:
        counts[d] = counts.get(d, 0) + 1
    return ", ".join(f"<{d}>x{n}" for d, n in sorted(counts.items(), reverse=True))


def _result_table(result: FcpResult, title: str) -> Table:
    table = Table(title=title)
    for col in ("micro-batch", "sequences", "tokens", "CP groups <degree>xcount",
                "est. ms/layer", "grouping"):
        table.add_column(col, justify="right")
    for mb in result.micro_batches:
        table.add_row(
            str(mb.index), str(len(mb.sequence_ids)), f"{sum(g.tokens for g in mb.groups):,}",
            _degree_mix([g.degree for g in mb.groups]), f"{mb.est_makespan_ms:.2f}", mb.candidate,
        )
    return table


def schedule(
    sequences: Annotated[str | None, typer.Option(
        help="Sequences as doc lengths: ';' between sequences, ',' between docs")] = None,
    dataset: Annotated[str | None, typer.Option(
        help="Sample the batch instead: wlbllm, code, family:pile, file:PATH ...")] = None,
    num_sequences: Annotated[int, typer.Option(help="Sequences to sample")] = 512,
    max_tokens: Annotated[int, typer.Option(help="Longest sampled sequence (tokens)")] = 131072,
    packed: Annotated[bool, typer.Option(
        help="Sample packed multi-doc sequences instead of one doc per sequence")] = False,
    seed: Annotated[int, typer.Option(help="Sampling seed")] = 0,
    ranks: Annotated[int, typer.Option("--ranks", "-N", help="N: model replicas")] = 8,
    memory_tokens: Annotated[int, typer.Option(
        "--memory-tokens", "-E", help="E: tokens one rank can hold")] = 32768,
    strategy: Annotated[str, typer.Option(help="Intra-group strategy")] = "flashcp",
    profile: Annotated[str, typer.Option(
        help=f"FCP profile: {', '.join(sorted(PROFILES))} or file:PATH")] = DEFAULT_PROFILE,
    search: Annotated[str, typer.Option(help="portfolio or paper")] = "portfolio",
    micro_batches: Annotated[int | None, typer.Option(help="Fix the micro-batch count")] = None,
    plans: Annotated[bool, typer.Option(help="Build the intra-group shard plans")] = True,
    compare: Annotated[bool, typer.Option(
        help="Also estimate the best static degree and the power-of-two greedy")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON")] = False,
    out: Annotated[Path | None, typer.Option(help="Write the result JSON to this file")] = None,
    window: Window = None,
    layers: Layers = None,
    hf_config: HfConfig = None,
) -> None:
    """FCP: split a batch into micro-batches, CP groups of any degree, one plan each."""
    mask = mask_of(window, layers, hf_config)
    if compare and not mask.is_causal:
        raise fail("--compare estimates causal attention only: drop it or the mask "
                   "(--window / --layers / --hf-config)")
    batch = _batch(sequences, dataset, num_sequences, max_tokens, packed, seed)
    request = ScheduleRequest(
        sequences=tuple(tuple(s) for s in batch), num_ranks=ranks, memory_tokens=memory_tokens,
        strategy=strategy, profile=profile, search=search, micro_batches=micro_batches,
        build_plans=plans, mask=mask,
    )
    result = run_schedule(request)
    if out is not None:
        out.write_text(json.dumps(result.to_dict(), sort_keys=True))
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2, sort_keys=True))
        return
    what = f"{len(batch)} sequences" + (f" of {dataset}" if dataset else "")
    if not mask.is_causal:
        what += f", layers {mask.to_text()}"
    console.print(_result_table(result, f"FCP, {what}, N = {ranks}, E = {memory_tokens:,}"))
    console.print(
        f"est. makespan {result.est_makespan_ms:.2f} ms/layer over "
        f"{len(result.micro_batches)} micro-batch(es); solved in {result.solve_ms:.2f} ms, "
        f"plans built and validated in {result.plan_ms:.1f} ms ({result.profile}, {strategy})"
    )
    missed_at = [(mb.index, missed(mb.plan.info)) for mb in result.micro_batches
                 if mb.plan is not None and missed(mb.plan.info) is not None]
    if missed_at:
        note("imbalance target missed in a group of micro-batch(es) "
             + ", ".join(f"{i} (worst group {r:.4f})" for i, r in missed_at)
             + " (the plan's info.imbalance_target_met = false)")
    if compare:
        from planner_service.fcp.reference_comparison import compare_with_references

        cmp = compare_with_references(batch, num_ranks=ranks, memory_tokens=memory_tokens,
                                     profile=profile, search=search)
        table = Table(title="estimated makespan, ms per layer (sum over micro-batches)")
        for col in ("method", "micro-batches", "makespan", "fcp speedup"):
            table.add_column(col, justify="right")
        table.add_row("fcp", str(cmp.fcp_micro_batches), f"{cmp.fcp_ms:.2f}", "1.00x")
        table.add_row(f"static <{cmp.static_degree}>", str(cmp.static_micro_batches),
                      f"{cmp.static_ms:.2f}", f"{cmp.speedup_vs_static:.2f}x")
        table.add_row("pow2 greedy", str(cmp.greedy_micro_batches), f"{cmp.greedy_ms:.2f}",
                      f"{cmp.speedup_vs_greedy:.2f}x")
        console.print(table)


def fit_profile_cmd(
    timings: Annotated[Path, typer.Argument(help="Timings JSON (cp-planner-timings/v1)")],
    out: Annotated[Path, typer.Option(help="Where to write the fitted profile JSON")],
    name: Annotated[str | None, typer.Option(help="Profile name (default: the out file stem)")] = None,
    base: Annotated[str, typer.Option(
        help="Profile whose values fill terms without records")] = DEFAULT_PROFILE,
) -> None:
    """Fit the FCP cost coefficients (eq. 8-10) by least squares from measured timings."""
    from planner_service.fcp.fit import fit_profile, load_timings

    report = fit_profile(load_timings(timings), name=name or out.stem, base=get_profile(base))
    data = {**report.profile.to_dict(), "fit": report.to_dict()}
    out.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    table = Table(title=f"fitted profile {report.profile.name} -> {out}")
    for col in ("term", "value", "rel. std error", "how"):
        table.add_column(col, justify="right" if col != "how" else "left")
    for term in report.terms:
        err = "-" if term.rel_error is None else f"{term.rel_error:.2%}"
        table.add_row(term.name, f"{term.value:.6g}", err, term.how)
    console.print(table)
    residuals = ", ".join(f"{op} {pct:.2f}%" for op, pct in report.residual_pct.items())
    console.print(f"RMS relative residual per op: {residuals}")
    console.print(f"use it with --profile file:{out}")
