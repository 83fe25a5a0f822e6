"""The CP-SAT model of block placement (FlashCP section 3.1 with the comm term of eq. 5).

Written in the sections of the OR-Tools samples: data, variables, constraints, objective.
Solving (limits, hints, fallback) lives in :mod:`planner_service.solvers.ilp`.

Exactness: with the blocks fixed, every figure the model uses equals what the cost
module computes for the resulting plan: tokens and workloads are sums of per-block
constants, and the KV a rank receives is, per doc, the blocks before the end of its last
block of that doc that it does not hold (the exact all-to-all-v of ``core.cost``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from ortools.sat.python import cp_model

from planner_service.core.cost import doc_workload, shard_workload
from planner_service.solvers.ilp.blocks import Blocks

OBJECTIVES = ("comm", "balance")
MAX_MODEL_BOOLS = 50_000
"""Blocks x ranks above this are refused (raise the granularity) rather than solved; a
submodel with more options than this is not asked."""


class BlockModel(NamedTuple):
    """A built model and the handles the solve step needs."""

    model: cp_model.CpModel
    x: list[list[cp_model.IntVar]]
    """x[b][r]: block b is on rank r."""
    need: list[list[cp_model.IntVar] | None]
    """need[b][r]: rank r needs block b's KV (holds block b or a later block of its doc);
    None for the last block of a doc (then need is x itself)."""
    recv: list[cp_model.IntVar]
    load: list[cp_model.IntVar]
    comm_max: cp_model.IntVar
    work_max: cp_model.IntVar


def build_model(
    blocks: Blocks,
    num_ranks: int,
    *,
    token_cap: int,
    work_cap: int | None,
    symmetric: bool = True,
) -> BlockModel:
    """Variables and constraints shared by both objectives (the caller sets the objective).

    ``token_cap``: tokens allowed per rank (T = ceil(S / N) for minimal padding).
    ``work_cap``: workload allowed per rank (R x mean, rounded down); None for no cap.
    ``symmetric``: the ranks are interchangeable, so the model numbers them in a canonical
    order (``symmetry_items``); False where the caller fixes blocks on given ranks, which
    the canonical order could then exclude.
    """
    # --- Data -------------------------------------------------------------------------
    n = num_ranks
    num_blocks = len(blocks.blocks)
    size = [b.end - b.start for b in blocks.blocks]
    work = [shard_workload(b.start, b.end - b.start) for b in blocks.blocks]
    split_runs = [run for run in blocks.doc_runs if len(run) > 1]
    total_work = sum(work)
    total_tokens = sum(size)
    model = cp_model.CpModel()

    # --- Variables --------------------------------------------------------------------
    # x[b][r] = 1 iff block b is placed on rank r.
    x = [[model.NewBoolVar(f"x_b{b}_r{r}") for r in range(n)] for b in range(num_blocks)]
    # need[b][r] = 1 iff rank r needs the K and V of block b: it holds b or a later block
    # of the same doc (causal attention reads the whole prefix). The last block of a doc
    # is needed exactly by its holder, so it reuses x; single-block docs need nothing.
    need: list[list[cp_model.IntVar] | None] = [None] * num_blocks
    for run in split_runs:
        for b in run[:-1]:
            need[b] = [model.NewBoolVar(f"need_b{b}_r{r}") for r in range(n)]
    # doc_recv[(d, r)]: KV tokens of doc d that rank r receives (needs, does not hold).
    doc_recv = {
        (i, r): model.NewIntVar(0, blocks.blocks[run[-1]].end, f"recv_d{blocks.blocks[run[0]].doc}_r{r}")
        for i, run in enumerate(split_runs) for r in range(n)
    }
    # recv[r]: KV tokens rank r receives in all; load[r]: its attention workload.
    recv = [model.NewIntVar(0, total_tokens, f"recv_r{r}") for r in range(n)]
    load = [model.NewIntVar(0, total_work, f"load_r{r}") for r in range(n)]
    # comm_max / work_max: the critical-path KV received and the largest workload. A rank
    # carries at least the mean, and the holder of a doc's last token at least L.
    work_floor = max(-(-total_work // n), max((b.end for b in blocks.blocks), default=0))
    comm_max = model.NewIntVar(0, total_tokens, "comm_max")
    work_max = model.NewIntVar(min(work_floor, total_work), total_work, "work_max")

    # --- Constraints ------------------------------------------------------------------
    # Every block is on exactly one rank.
    for b in range(num_blocks):
        model.AddExactlyOne(x[b])
    for r in range(n):
        # Every rank holds at most T tokens; the rest of T is explicit padding. Redundant,
        # for propagation: so it holds at least what the others cannot (S - (N - 1) T).
        tokens = sum(size[b] * x[b][r] for b in range(num_blocks))
        model.AddLinearConstraint(tokens, token_floor(total_tokens, n, token_cap), token_cap)
        # The rank's workload is the sum of its blocks' workloads, at most the cap.
        model.Add(load[r] == sum(work[b] * x[b][r] for b in range(num_blocks)))
        if work_cap is not None:
            model.Add(load[r] <= work_cap)
        model.Add(load[r] <= work_max)
    for i, run in enumerate(split_runs):
        for k, b in enumerate(run[:-1]):
            later = run[k + 1]
            nb, nl = need[b], need[later]
            assert nb is not None
            for r in range(n):
                # A rank needs a block it holds ...
                model.AddImplication(x[b][r], nb[r])
                # ... and every block before one it needs (need is a prefix of the doc).
                model.AddImplication(x[later][r] if nl is None else nl[r], nb[r])
        for r in range(n):
            # Received KV of the doc: each needed block's tokens unless the rank holds it.
            # Minimising pushes need down to "holds this or a later block": exact.
            needed = [(b, nb) for b in run[:-1] if (nb := need[b]) is not None]
            model.Add(doc_recv[i, r] == cp_model.LinearExpr.WeightedSum(
                [nb[r] - x[b][r] for b, nb in needed], [size[b] for b, _ in needed]))
            # Redundant, for bounds: a rank holding block b receives at least the part of
            # [0, start_b) it cannot hold within its token and workload caps (it could at
            # best hold the cheapest tokens, the doc's head).
            for b in run[1:]:
                lack = prefix_lack(blocks.blocks[b].start, size[b], work[b], token_cap, work_cap)
                if lack > 0:
                    model.Add(doc_recv[i, r] >= lack * x[b][r])
    for r in range(n):
        model.Add(recv[r] == sum(doc_recv[i, r] for i in range(len(split_runs))))
        model.Add(recv[r] <= comm_max)
    # Ranks are interchangeable: number them in order of first use by the last blocks of
    # the docs, longest doc first (a rank is used only after the one before it).
    items = symmetry_items(blocks) if symmetric else []
    for k, b in enumerate(items):
        for r in range(1, n):
            model.AddBoolOr([x[b][r].Not(), *(x[i][r - 1] for i in items[:k])])
    return BlockModel(model, x, need, recv, load, comm_max, work_max)


def token_floor(total_tokens: int, num_ranks: int, token_cap: int) -> int:
    """The fewest tokens a rank can hold when the others hold at most ``token_cap`` each."""
    return max(0, total_tokens - (num_ranks - 1) * token_cap)


def whole_doc_model(doc_lengths: Sequence[int], num_ranks: int, *, token_cap: int,
                    work_cap: int) -> tuple[cp_model.CpModel, list[list[cp_model.IntVar]]]:
    """The question "can every doc stay whole?" (critical-path KV 0: a split doc's tail
    rank always receives its head) as a packing model of its own, a bool per doc and rank:
    far smaller than the block model, and with the token bounds of every rank as a range
    (usually T exactly) CP-SAT settles it in well under a second on 128K sequences."""
    # --- Data -------------------------------------------------------------------------
    n = num_ranks
    docs = range(len(doc_lengths))
    floor = token_floor(sum(doc_lengths), n, token_cap)
    model = cp_model.CpModel()
    # --- Variables: y[d][r] = 1 iff doc d is whole on rank r. ---------------------------
    y = [[model.NewBoolVar(f"y_d{d}_r{r}") for r in range(n)] for d in docs]
    # --- Constraints ------------------------------------------------------------------
    for d in docs:
        model.AddExactlyOne(y[d])  # every doc on one rank
    for r in range(n):
        # Tokens within [S - (N - 1) T, T] and workload within the cap.
        model.AddLinearConstraint(sum(doc_lengths[d] * y[d][r] for d in docs), floor, token_cap)
        model.Add(sum(doc_workload(doc_lengths[d]) * y[d][r] for d in docs) <= work_cap)
    # Ranks are interchangeable: the k-th longest doc is on one of the first k + 1 ranks.
    order = sorted(docs, key=lambda d: (-doc_lengths[d], d))
    for k, d in enumerate(order[:n - 1]):
        for r in range(k + 1, n):
            model.Add(y[d][r] == 0)
    return model, y


def prefix_lack(start: int, size: int, work: int, token_cap: int, work_cap: int | None) -> int:
    """Tokens of [0, start) a rank holding a block (start, size, work) must receive at least:
    it holds at most the head [0, a) with a <= T - size and F(a) <= cap - work."""
    room = token_cap - size
    if work_cap is not None:
        budget = work_cap - work
        if budget < 0:
            return 0  # no rank can hold the block; the caps make the model infeasible
        # Largest a with a (a + 1) / 2 <= budget.
        a = (math.isqrt(8 * budget + 1) - 1) // 2
        room = min(room, a)
    return max(0, start - max(room, 0))


def symmetry_items(blocks: Blocks) -> list[int]:
    """The blocks whose ranks are numbered in order of first use: the last block of each
    doc with at least one block, longest doc first (ties by doc index)."""
    runs = sorted((run for run in blocks.doc_runs if len(run)),
                  key=lambda run: (-blocks.blocks[run[-1]].end, blocks.blocks[run[-1]].doc))
    return [run[-1] for run in runs]


def canonical_ranks(blocks: Blocks, ranks: Sequence[int], num_ranks: int) -> list[int]:
    """Relabel a placement's ranks so it obeys the model's symmetry breaking."""
    label: dict[int, int] = {}
    for b in symmetry_items(blocks):
        label.setdefault(ranks[b], len(label))
    for r in range(num_ranks):
        label.setdefault(r, len(label))
    return [label[r] for r in ranks]


class PlacementValues(NamedTuple):
    """Per-rank figures of a block placement."""

    tokens: list[int]
    loads: list[int]
    """Causal workload."""
    recv: list[int]
    """KV tokens received."""


def placement_values(blocks: Blocks, ranks: Sequence[int], num_ranks: int) -> PlacementValues:
    """Per-rank tokens, workload and received KV of a block placement, computed the
    way the model defines them (used for hints and checks)."""
    tokens = [0] * num_ranks
    loads = [0] * num_ranks
    recv = [0] * num_ranks
    for run in blocks.doc_runs:
        needed = [False] * num_ranks
        for b in reversed(run):
            block, rank = blocks.blocks[b], ranks[b]
            length = block.end - block.start
            tokens[rank] += length
            loads[rank] += shard_workload(block.start, length)
            needed[rank] = True
            for r in range(num_ranks):
                if needed[r] and r != rank:
                    recv[r] += length
    return PlacementValues(tokens, loads, recv)


def add_hint(bm: BlockModel, blocks: Blocks, ranks: Sequence[int], num_ranks: int) -> None:
    """Hint a complete solution: the placement and every variable it implies."""
    for b, rank in enumerate(ranks):
        for r in range(num_ranks):
            bm.model.AddHint(bm.x[b][r], int(r == rank))
    for run in blocks.doc_runs:
        needed = [False] * num_ranks
        for b in reversed(run):
            needed[ranks[b]] = True
            nb = bm.need[b]
            if nb is not None:
                for r in range(num_ranks):
                    bm.model.AddHint(nb[r], int(needed[r]))
    _, loads, recv = placement_values(blocks, ranks, num_ranks)
    for r in range(num_ranks):
        bm.model.AddHint(bm.recv[r], recv[r])
        bm.model.AddHint(bm.load[r], loads[r])
    bm.model.AddHint(bm.comm_max, max(recv))
    bm.model.AddHint(bm.work_max, max(loads))
