"""A restricted model of block placement that finds placements near a proven bound.

Why: the relaxation of :mod:`.relax` often proves a bound that some placement
reaches, or nearly, and the search of the full model does not find that placement in its
time: around the docs that must be split, every rank must be filled to exactly T tokens
within its workload cap, and on the ranks already at the critical KV without receiving
anything more. In the full model that packing is a question about every fluid block and
its need chain; CP-SAT settles it slowly. Here every fluid doc (a doc the relaxation
treats as fluid, ``relax.must_split``) takes one of a few *options*:

- whole on rank r;
- cut once, at one of its block edges a: the head [0, a) on rank p, the tail [a, L) on
  rank q != p, which receives the head's a tokens of KV (p receives none).

An option adds constants to its ranks' tokens, workload and received KV, so the fill is a
0-1 assignment with linear rows per rank, and the docs that must be split keep their
blocks and need chains as in the full model (``model.build_model``). Every solution
is a block placement of the full model with at most the KV the model counts, so a
placement found is a valid incumbent; the restriction proves nothing about the full
model (a doc cut into three pieces is not an option here).

How often the question finds a placement the rest of the search does not is measured by
``python -m bench.ilp_compare`` (results in ``bench/results/``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ortools.sat.python import cp_model

from planner_service.core.cost import doc_workload
from planner_service.solvers.ilp.blocks import Blocks
from planner_service.solvers.ilp.model import build_model, token_floor
from planner_service.solvers.ilp.relax import sub_blocks


class Option(NamedTuple):
    """How one fluid doc is placed: ``head`` tokens [0, head) on rank ``head_rank``, the rest
    on rank ``rank`` (``head`` 0: the doc is whole on ``rank``)."""

    rank: int
    head: int = 0
    head_rank: int = -1


class FillModel(NamedTuple):
    """The built model (objective unset; the caller adds its question) and its handles."""

    model: cp_model.CpModel
    comm_max: cp_model.IntVar
    """The critical-path KV as the model counts it (at least the placement's)."""
    kept_x: list[list[cp_model.IntVar]]
    """kept_x[i][r]: the i-th block of the kept docs (in ``sub_blocks`` order) is on rank r."""
    options: list[list[tuple[Option, cp_model.IntVar]]]
    """Per fluid doc (in ``fluid_docs`` order), its options and their booleans."""


def option_count(blocks: Blocks, fluid_docs: Sequence[int], num_ranks: int) -> int:
    """How many option booleans ``fill_model`` makes (the caller caps the model's size)."""
    n = num_ranks
    return sum(n + (len(blocks.doc_runs[d]) - 1) * n * (n - 1) for d in fluid_docs)


def fill_model(blocks: Blocks, kept_docs: Sequence[int], fluid_docs: Sequence[int],
               num_ranks: int, *, token_cap: int, work_cap: int) -> FillModel:
    """The model of the module docstring: the kept docs' blocks as in the full model, every
    fluid doc one of its options; every rank within [floor, T] tokens and the workload cap."""
    # --- Data -------------------------------------------------------------------------
    n = num_ranks
    kept = sub_blocks(blocks, kept_docs)
    bm = build_model(kept, n, token_cap=token_cap, work_cap=work_cap)
    model = bm.model
    total = sum(b.end - b.start for b in blocks.blocks)
    size = [b.end - b.start for b in kept.blocks]
    # Per rank: the terms of its tokens, workload and received KV (kept docs first).
    tokens: list[list[cp_model.LinearExprT]] = [
        [cp_model.LinearExpr.WeightedSum([row[r] for row in bm.x], size)] for r in range(n)]
    work: list[list[cp_model.LinearExprT]] = [[bm.load[r]] for r in range(n)]
    recv: list[list[cp_model.LinearExprT]] = [[bm.recv[r]] for r in range(n)]

    # --- Variables: one boolean per option of every fluid doc ---------------------------
    options: list[list[tuple[Option, cp_model.IntVar]]] = []
    for d in fluid_docs:
        run = blocks.doc_runs[d]
        length = blocks.blocks[run[-1]].end
        edges = [blocks.blocks[b].end for b in run[:-1]]
        doc_options = [Option(r) for r in range(n)]
        doc_options += [Option(q, a, p) for a in edges for p in range(n) for q in range(n) if q != p]
        chosen = []
        for option in doc_options:
            on = model.NewBoolVar(f"fill_d{d}_r{option.rank}_h{option.head}_p{option.head_rank}")
            chosen.append((option, on))
            head_work = doc_workload(option.head)
            tokens[option.rank].append((length - option.head) * on)
            work[option.rank].append((doc_workload(length) - head_work) * on)
            if option.head:
                tokens[option.head_rank].append(option.head * on)
                work[option.head_rank].append(head_work * on)
                recv[option.rank].append(option.head * on)  # the tail's rank reads the head
        options.append(chosen)
    comm_max = model.NewIntVar(0, total, "fill_comm_max")

    # --- Constraints ------------------------------------------------------------------
    for chosen in options:
        model.AddExactlyOne(on for _, on in chosen)  # every fluid doc takes one option
    floor = token_floor(total, n, token_cap)
    for r in range(n):
        # Tokens within [S - (N - 1) T, T], workload within the cap, KV within comm_max.
        model.AddLinearConstraint(sum(tokens[r]), floor, token_cap)
        model.Add(sum(work[r]) <= work_cap)
        model.Add(sum(recv[r]) <= comm_max)
    return FillModel(model, comm_max, bm.x, options)


def fill_ranks(blocks: Blocks, kept_docs: Sequence[int], fluid_docs: Sequence[int],
               kept_ranks: Sequence[int], options: Sequence[Option]) -> list[int]:
    """The rank of every block of ``blocks``: the kept docs' blocks at ``kept_ranks`` (in
    ``sub_blocks`` order), every fluid doc as its chosen option says."""
    ranks = [-1] * len(blocks.blocks)
    kept_blocks = [b for d in kept_docs for b in blocks.doc_runs[d]]
    for b, rank in zip(kept_blocks, kept_ranks, strict=True):
        ranks[b] = rank
    for d, option in zip(fluid_docs, options, strict=True):
        for b in blocks.doc_runs[d]:
            ranks[b] = option.head_rank if blocks.blocks[b].end <= option.head else option.rank
    assert -1 not in ranks
    return ranks
