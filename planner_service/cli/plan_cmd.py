"""``planner plan`` and ``planner compare``: one input or sampled batches, as tables or JSON."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from planner_service.cli.common import console, fail, note
from planner_service.cli.mask_opts import HfConfig, Layers, Window, mask_of
from planner_service.core.plan import Plan
from planner_service.core.profiles import default_kernel_name
from planner_service.core.request import PlanRequest
from planner_service.solvers.balance import missed
from planner_service.solvers.kv_bound import FIELD as KV_FIELD
from planner_service.solvers.kv_bound import plan_peak
from planner_service.solvers.registry import prepare, strategy_names, timed_solve
from planner_service.strategy_summary import StrategySummary, summarize_strategies

Docs = Annotated[
    str | None, typer.Option("--docs", help="Comma-separated doc lengths, e.g. 1000,5000,37")
]
Dataset = Annotated[
    str | None,
    typer.Option(help="Sample packed sequences instead: wlbllm, code, family:pile, file:PATH ..."),
]
Cp = Annotated[int, typer.Option("--cp", help="CP size N (ranks)")]
Context = Annotated[
    int | None, typer.Option(help="Context window C (tokens); required with --dataset")
]
Target = Annotated[float, typer.Option("--imbalance-target", "-R", help="Target imbalance R")]
Seed = Annotated[int, typer.Option(help="Seed for --dataset sampling")]
KvBound = Annotated[
    int | None,
    typer.Option(help="Bound on every rank's KV peak (tokens); the strategy meets it or names "
                 "the smallest bound it can meet"),
]
Url = Annotated[
    str | None, typer.Option(help="Ask a running planner service instead of solving locally")
]


SKIPPED_BY_DEFAULT = {
    "ilp": "an exact CP-SAT solve of up to options.time_limit_s (10 s) per sequence",
}
"""Strategies ``planner compare`` leaves out unless ``--strategies`` names them, and why."""


def _sequences(
    docs: str | None, dataset: str | None, context: int | None, batches: int, seed: int
) -> list[list[int]]:
    if (docs is None) == (dataset is None):
        raise fail("give exactly one of --docs or --dataset")
    if docs is not None:
        try:
            return [[int(x) for x in docs.replace(" ", "").split(",") if x]]
        except ValueError:
            raise fail(f"--docs must be comma-separated integers, got {docs!r}") from None
    from planner_service.data import make_source, pack_sequences

    if context is None or dataset is None:
        raise fail("--dataset needs --context (e.g. 131072)")
    try:
        source = make_source(dataset)
    except ValueError as exc:
        raise ValueError(f"--dataset {dataset}: {exc}") from exc
    return pack_sequences(source, context_length=context, num_sequences=batches, seed=seed)


def _rank_table(plan: Plan) -> Table:
    table = Table(title=f"{plan.strategy} plan, N = {plan.cp_size}, plan_id {plan.plan_id[:12]}")
    for col in ("rank", "tokens", "pad", "workload", "kv recv"):
        table.add_column(col, justify="right")
    table.add_column(escape("shards: doc[start:end]"))
    for group in plan.groups:
        for i, rank in enumerate(group.ranks):
            shards = " ".join(f"{s.doc}[{s.start}:{s.end}]" for s in group.shards[i])
            table.add_row(
                str(rank),
                str(group.rank_stats.tokens[i]),
                str(group.padding[i]),
                f"{group.rank_stats.workload[i]:,}",
                str(group.rank_stats.alltoallv_recv[i]),
                escape(shards if len(shards) < 400 else shards[:400] + " ..."),
            )
    return table


def _metrics_table(plan: Plan) -> Table:
    m = plan.metrics
    table = Table(title="metrics")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("imbalance", f"{m.imbalance:.4f}"),
        ("comm mode", m.comm_mode),
        ("KV tokens recv (critical path)", f"{m.comm_tokens:,}"),
        ("full exchange tokens", f"{m.full_comm_tokens:,}"),
        ("comm saving (own mode)", f"{m.comm_saving:.1%}"),
        ("saving, compact all-gather", f"{m.comm_saving_allgather:.1%}"),
        ("saving, all-to-all-v", f"{m.comm_saving_alltoallv:.1%}"),
        ("est. per-layer fwd+bwd", f"{m.est_step_ms:.3f} ms"),
        (
            "  attention / comm / linear",
            f"{m.est_attn_ms:.3f} / {m.est_comm_ms:.3f} / {m.est_linear_ms:.3f}",
        ),
        ("padding tokens", str(m.padding_tokens)),
        ("split docs", str(m.num_split_docs)),
    ]
    if m.layers is not None:
        # Under a mask: layer-weighted work, exchange summed over the layers (core/metrics.py).
        rows[0] = ("imbalance (layer-weighted)", rows[0][1])
        rows[2] = ("KV tokens recv (critical path, all layers)", rows[2][1])
        rows.insert(0, ("mask", plan.mask.to_text()))
        rows += [(f"  {layer.count} x window {'full' if layer.window is None else layer.window}",
                  f"imbalance {layer.imbalance:.4f}, recv {layer.comm_tokens:,} per layer")
                 for layer in m.layers]
        rows.append(("  (est. step times price causal calls)", ""))
    if KV_FIELD in plan.info:
        rows.append(("KV peak (bound)", f"{plan_peak(plan):,} ({plan.info[KV_FIELD]:,})"))
    reached = missed(plan.info)
    if reached is not None:
        rows.insert(1, ("imbalance target", f"MISSED (best reached {reached:.4f})"))
    for row in rows:
        table.add_row(*row)
    return table


def plan(
    docs: Docs = None,
    dataset: Dataset = None,
    cp: Cp = 8,
    strategy: Annotated[
        str, typer.Option(help="Strategy name (see `planner compare`)")
    ] = "flashcp",
    context: Context = None,
    truncate: Annotated[bool, typer.Option(help="Cut the lengths at the context window")] = False,
    imbalance_target: Target = 1.05,
    comm_mode: Annotated[
        str | None, typer.Option(help="full, compact_allgather, alltoallv, p2p_ring")
    ] = None,
    kernel: Annotated[str | None, typer.Option(
        help="Kernel profile (default: the runtime's kernel: PLANNER_KERNEL_PROFILE, else "
             "h100-aten-fa2, PyTorch's own FlashAttention-2)")] = None,
    link: Annotated[str, typer.Option(help="Link profile")] = "nvlink",
    seed: Seed = 0,
    max_kv_tokens_per_rank: KvBound = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw plan JSON")] = False,
    url: Url = None,
    window: Window = None,
    layers: Layers = None,
    hf_config: HfConfig = None,
) -> None:
    """Plan one packed sequence and print per-rank shards and metrics."""
    mask = mask_of(window, layers, hf_config)
    seq = _sequences(docs, dataset, context, 1, seed)[0]
    request = PlanRequest(
        doc_lengths=tuple(seq),
        cp_size=cp,
        strategy=strategy,
        context_length=context,
        truncate=truncate,
        imbalance_target=imbalance_target,
        comm_mode=comm_mode,
        kernel=kernel or default_kernel_name(),
        link=link,
        max_kv_tokens_per_rank=max_kv_tokens_per_rank,
        mask=mask,
    )
    where = "server" if url else "local"
    if url:
        from planner_service.client import remote_plan

        remote = remote_plan(url, request)
        result, solve_ms = remote.parsed(), remote.solve_ms
    else:
        prepare(request.strategy)  # "solved in" is the solve, not the imports
        solved = timed_solve(request)
        result, solve_ms = solved.parsed(), solved.solve_ms
    if as_json:
        typer.echo(result.to_json(indent=2))
        return
    console.print(_rank_table(result))
    console.print(_metrics_table(result))
    reached = missed(result.info)
    if reached is not None:
        note(f"imbalance target R = {request.imbalance_target} missed: the most balanced plan "
             f"{request.strategy} found has imbalance {reached:.4f} (info.imbalance_target_met "
             "= false)")
    console.print(f"solved in {solve_ms:.3f} ms ({where})")


def _summary_table(summaries: list[StrategySummary], title: str) -> Table:
    table = Table(title=title)
    for col in (
        "strategy",
        "imbalance mean",
        "imbalance p99",
        "saving (own)",
        "saving all-gather",
        "saving all-to-all-v",
        "est. ms/layer",
        "solve ms p50",
        "solve ms p99",
    ):
        table.add_column(col, justify="right")
    for s in summaries:
        table.add_row(
            s.strategy,
            f"{s.imbalance_mean:.4f}",
            f"{s.imbalance_p99:.4f}",
            f"{s.saving:.1%}",
            "none (padded)" if s.saving_allgather <= 0 else f"{s.saving_allgather:.1%}",
            f"{s.saving_alltoallv:.1%}",
            f"{s.est_step_ms:.3f}",
            f"{s.solve_ms_median:.3f}",
            f"{s.solve_ms_p99:.3f}",
        )
    return table


def compare_cmd(
    docs: Docs = None,
    dataset: Dataset = None,
    batches: Annotated[int, typer.Option(help="Sequences to sample with --dataset")] = 20,
    cp: Cp = 8,
    strategies: Annotated[
        str | None, typer.Option(help="Comma-separated strategies (default: all but ilp, "
                                 "which the output names)")
    ] = None,
    context: Context = None,
    imbalance_target: Target = 1.05,
    seed: Seed = 0,
    plot: Annotated[
        str | None, typer.Option(help="Also draw the comparison to this PNG file")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print summaries as JSON")] = False,
    url: Url = None,
    window: Window = None,
    layers: Layers = None,
    hf_config: HfConfig = None,
) -> None:
    """Strategies side by side for one input or N sampled batches of a data set (under a
    mask: every strategy plans with it, and imbalance and savings are layer-weighted)."""
    mask = mask_of(window, layers, hf_config)
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ModuleNotFoundError:
            raise fail("--plot needs matplotlib: pip install 'cp-planner[plot]' (or leave out "
                       "--plot)") from None
    sequences = _sequences(docs, dataset, context, batches, seed)
    if strategies:
        names = strategies.split(",")
    else:
        names = [s for s in strategy_names() if s not in SKIPPED_BY_DEFAULT]
        skipped = sorted(set(strategy_names()) & set(SKIPPED_BY_DEFAULT))
        if skipped:
            why = "; ".join(f"{s}: {SKIPPED_BY_DEFAULT[s]}" for s in skipped)
            note(f"skipped {', '.join(skipped)} ({why}); name it in --strategies to include it")
    base = PlanRequest(
        doc_lengths=tuple(sequences[0]),
        cp_size=cp,
        context_length=context,
        imbalance_target=imbalance_target,
        mask=mask,
    )
    if url:
        from planner_service.client import remote_plan

        def ask_service(request: PlanRequest) -> tuple[Plan, float]:
            remote = remote_plan(url, request)
            return remote.parsed(), remote.solve_ms

        summaries = summarize_strategies(names, sequences, base, solve=ask_service)
    else:
        summaries = summarize_strategies(names, sequences, base)
    if as_json:
        typer.echo(json.dumps([s._asdict() for s in summaries], indent=2))
    else:
        what = f"{len(sequences)} sequence(s)" + (f" of {dataset}" if dataset else "")
        under = "" if mask.is_causal else f", mask {mask.to_text()}"
        console.print(_summary_table(summaries, f"{what}, N = {cp}{under}"))
        none = [s.strategy for s in summaries if s.saving_allgather <= 0]
        if none:
            note(f"compact all-gather saves nothing for {', '.join(none)} here: every rank's "
                 "buffer is padded to the largest, and the largest is a whole rank's tokens "
                 "(early chunks of a document others attend); not a choice over full "
                 "(docs/strategies.md)")
    if plot:
        from planner_service.plot import plot_comparison

        plot_comparison(summaries, plot, title=f"{len(sequences)} sequence(s), N = {cp}")
        console.print(f"plot written to {plot}")
