"""Matplotlib drawings of plans and comparisons (headless, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from planner_service.strategy_summary import StrategySummary  # noqa: E402


def plot_comparison(
    summaries: Sequence[StrategySummary], path: str | Path, title: str = ""
) -> None:
    """Four panels per strategy: imbalance, comm saving, estimated step time, solve time."""
    names = [s.strategy for s in summaries]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    panels = [
        ("imbalance (mean, p99 marked)", [s.imbalance_mean for s in summaries], None),
        ("comm saving vs full (own mode)", [s.saving for s in summaries], None),
        ("est. per-layer fwd+bwd (ms)", [s.est_step_ms for s in summaries], None),
        ("median solve time (ms)", [s.solve_ms_median for s in summaries], None),
    ]
    colors = [plt.get_cmap("tab10")(i) for i in range(10)]
    for ax, (label, values, _) in zip(axes, panels, strict=True):
        ax.bar(names, values, color=colors[: len(names)])
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        for x, v in enumerate(values):
            ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=8)
    axes[0].scatter(
        names, [s.imbalance_p99 for s in summaries], color="black", marker="_", s=300, zorder=3
    )
    axes[0].set_ylim(bottom=0.9)
    fig.suptitle(title or f"{summaries[0].num_sequences} sequences")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
