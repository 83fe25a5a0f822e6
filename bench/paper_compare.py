"""The step-time model's PREDICTED speedups of flashcp next to the FlashCP paper's measured ones.

    .venv/bin/python -m bench.paper_compare [--sequences 16]   # writes bench/results/paper_compare.md

The paper's setting (FlashCP, arXiv:2606.08476, section A4): one node of 8 H100 SXM 80GB on
NVLink; 128K context; CP 4 and 8; 16 and 32 attention heads of dim 128; WLB-LLM, Pile and
RedPajama document lengths, sequences packed to the window with the last document cut.
Measured average speedups of FlashCP: 1.63x over Per-Doc CP, 1.38x over Llama3 CP, 1.97x
over Ring-Attn, 2.14x over Ring-Attn (Zigzag).

Here: WLB-LLM (``wlbllm``) and Pile-like (``family:pile``) sequences, each strategy planned
by this planner and estimated with core/step_time/ under ``h100-fa2`` and ``h100-fa3``
with ``nvlink``, as the worker runtime executes the plan with flash-attn on its default
segments flash path, each in its own exchange: flashcp all-to-all-v, per_doc and llama3
full all-gather (the exchange overlapped with the local-key calls), ring and zigzag
``p2p_ring`` (the segment ring: N - 1 shifts of each rank's block, each overlapped with a
step's varlen calls). The time
compared is the attention layer (kernel + copies + exchange, forward + backward), the part
CP changes; the linear layers are the same for every strategy. No coefficient is tuned to the paper.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from planner_service.core.model import ModelSpec
from planner_service.core.plan import Plan
from planner_service.core.request import PlanRequest
from planner_service.data import CONTEXT_128K, make_source, pack_sequences
from planner_service.solvers.registry import solve

RESULTS = Path(__file__).resolve().parent / "results"
DATASETS = {"WLB-LLM": "wlbllm", "Pile-like": "family:pile"}
BASELINES = ("per_doc", "llama3", "ring", "zigzag")
PAPER = {"per_doc": 1.63, "llama3": 1.38, "ring": 1.97, "zigzag": 2.14}
PROFILES = ("h100-fa2", "h100-fa3")
CP_SIZES = (4, 8)
HEADS = (16, 32)


def model_for(heads: int) -> ModelSpec:
    """The paper's attention shape: ``heads`` heads of dim 128, bf16. It names no GQA, so
    K and V have as many heads as Q (MHA)."""
    return ModelSpec(num_heads=heads, num_kv_heads=heads, head_dim=128)


def layer_ms(plan: Plan) -> float:
    """Predicted attention-layer time (kernel + copies + exchange) of the slowest rank."""
    m = plan.metrics
    return m.est_step_ms - m.est_linear_ms


def cell(seqs: list[list[int]], cp: int, heads: int, kernel: str) -> dict[str, dict[str, float]]:
    """Mean predicted ms per strategy and term over ``seqs``."""
    out: dict[str, dict[str, float]] = {}
    for strategy in ("flashcp", *BASELINES):
        plans = [solve(PlanRequest(doc_lengths=tuple(s), cp_size=cp, strategy=strategy,
                                   context_length=CONTEXT_128K, model=model_for(heads),
                                   kernel=kernel, link="nvlink"), check=False) for s in seqs]
        out[strategy] = {
            "layer": statistics.mean(layer_ms(p) for p in plans),
            "attn": statistics.mean(p.metrics.est_attn_ms for p in plans),
            "comm": statistics.mean(p.metrics.est_comm_ms for p in plans),
            "imbalance": statistics.mean(p.metrics.imbalance for p in plans),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=16, help="packed 128K sequences per dataset")
    parser.add_argument("--out", type=Path, default=RESULTS / "paper_compare.md")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    seqs = {name: pack_sequences(make_source(spec), context_length=CONTEXT_128K,
                                 num_sequences=args.sequences, seed=0) for name, spec in DATASETS.items()}
    rows = []
    speedups: dict[str, dict[str, list[float]]] = {k: {b: [] for b in BASELINES} for k in PROFILES}
    for kernel in PROFILES:
        for ds, ss in seqs.items():
            for cp in CP_SIZES:
                for heads in HEADS:
                    c = cell(ss, cp, heads, kernel)
                    f = c["flashcp"]["layer"]
                    ratios = {b: c[b]["layer"] / f for b in BASELINES}
                    for b in BASELINES:
                        speedups[kernel][b].append(ratios[b])
                    terms = " / ".join(f"{c[s]['attn']:.2f}+{c[s]['comm']:.2f}" for s in ("flashcp", *BASELINES))
                    rows.append(f"| {kernel} | {ds} | {cp} | {heads} | {f:.2f} | "
                                + " | ".join(f"{ratios[b]:.2f}x" for b in BASELINES) + f" | {terms} |")
    summary = [
        f"| flashcp over | paper (measured) | predicted, {PROFILES[0]} | predicted, {PROFILES[1]} |",
        "|---|---:|---:|---:|",
        *(f"| {b} | {PAPER[b]:.2f}x | " + " | ".join(
            f"{statistics.mean(speedups[k][b]):.2f}x" for k in PROFILES) + " |" for b in BASELINES),
    ]
    lines = [
        "# The step-time model against the FlashCP paper (predictions, not measurements)",
        "",
        f"Command: `.venv/bin/python -m bench.paper_compare --sequences {args.sequences}`",
        "",
        f"{args.sequences} packed 128K sequences per data set (seed 0); every prediction from "
        "core/step_time/, each plan run as the worker runtime runs it with flash-attn (the "
        "segments path: the exchange overlapped with local-key attention; ring and zigzag as "
        "the segment ring, each shift overlapped with a step's calls). Paper figures: FlashCP arXiv:2606.08476, "
        "section A4, averages over WLB-LLM, Pile and RedPajama, CP 4 and 8, 16 and 32 heads "
        "(8 x H100 SXM, NVLink). Predictions average over the cells below (WLB-LLM and "
        f"Pile-like only). Load average {load:.1f} (irrelevant: nothing here is timed).",
        "",
        "## Average speedup of flashcp (attention layer, forward + backward)",
        "",
        *summary,
        "",
        "## Per cell: predicted speedup and mean predicted ms",
        "",
        "flashcp ms = predicted attention-layer ms of the slowest rank (mean over sequences); "
        "last column: attention (kernel + copies) + exchange ms of flashcp / per_doc / llama3 / "
        "ring / zigzag.",
        "",
        "| profile | data | N | heads | flashcp ms | vs per_doc | vs llama3 | vs ring | vs zigzag | "
        "attn+comm ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        "## Why the predictions differ from the measurements",
        "",
        *EXPLANATIONS,
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


EXPLANATIONS = [
    "- **per_doc**: near the paper with FA3, below it with FA2 (a slower kernel dilutes the "
    "exchange and per-call costs that separate the two). Both sides pay per_doc's full "
    "all-gather and its short pieces; the model charges short pieces tile quantisation, "
    "per-call and per-segment overheads (cited, not measured on H100) and the segments path's "
    "extra calls and merges, and uses a Pile-like family, not the Pile, and no RedPajama.",
    "- **llama3**: the model puts llama3 further behind flashcp than the paper: llama3's cost "
    "here is its imbalance (2N equal chunks of the packed sequence split long documents "
    "unevenly), charged in full at the slowest rank; the paper's averages also include "
    "forward-only runs and RedPajama, where it may weigh less (an assumption, not checked).",
    "- **ring**: a little above the paper. Both run a ring: this runtime's segment ring "
    "moves each rank's whole block 3 (N - 1) times (K/V forward, K/V and dK/dV backward), "
    "each shift hidden behind one step's calls; the ring layout keeps most documents on one "
    "or two ranks, so most steps bring a block the rank has no query for and their shifts "
    "are exposed in full (a few ms at the slowest rank). Most of the gap is the layout's "
    "imbalance, as in the paper. The model's tile and per-call costs are cited, not measured "
    "on H100.",
    "- **zigzag**: the model puts zigzag just behind per_doc (same shards): its ring exposes "
    "less exchange than per_doc's full all-gather, but runs N - 1 steps of calls and merges "
    "where per_doc runs one remote exchange. The paper's ring-flash-attention zigzag is "
    "slower than that: it runs 2 chunk kernels per doc per ring step with log-sum-exp "
    "merges, where this runtime's segment ring runs one call per query group and class of "
    "documents per step.",
    "- **all**: the paper's averages include inference (forward only) and RedPajama, and the "
    "paper names no GQA (MHA assumed here: more KV bytes than Llama-3's 8 KV heads).",
]


if __name__ == "__main__":
    main()
