"""The CP-SAT block model under an attention mask that is not causal in every layer.

The blocks are those of :mod:`.blocks`; what changes from :mod:`.model` is what a block
costs and what a rank receives (core/window_work.py):

- **work**: block ``[s, e)`` carries the layer-weighted pairs
  ``sum_g count_g shard_window_workload(s, e, W_g)``, and the cap R x mean applies to it;
- **KV**: per layer group, a rank receives the keys its windows reach and it does not
  hold. A block c held by the rank reaches the keys ``[s_c - W + 1, e_c)`` of its doc, so
  the keys of an earlier block b it reaches are a suffix of b, from
  ``max(s_b, s_c - W + 1)``. The breakpoints ``max(s_b, s_c - W + 1)`` of the later
  blocks c that reach b cut b into *pieces*; a piece is needed by rank r iff r holds b or
  one of the later blocks whose breakpoint is at or below the piece's start (a prefix of
  the later blocks in start order). A need boolean per (piece, rank), implied by the
  first of those blocks to reach it and by the piece before it (a block reaching a piece
  reaches every later piece of b): minimising pushes it down to exactly that need. A
  causal group (W None, or a window no document exceeds) keeps :mod:`.model`'s prefix
  need, one boolean per (block, rank).
- **objective**: ``sum_g count_g comm_g`` with ``comm_g >= recv_g[r]`` for every rank:
  the layer-weighted critical-path exchange of ``window_work.mask_figures_of``, each
  layer's exchange its own collective.

Exactness: with the blocks fixed, the optimum equals the figures core/window_work.py
computes for the resulting plan (tests/test_ilp_window.py against an enumeration).

Size, B blocks, N ranks, G layer groups: ``B N`` placement booleans plus, per windowed
group, one need boolean per (piece, rank) where a piece is reached by at most the later
blocks starting within W - 1 keys of it; ``O(G B N (1 + p))`` constraints for p pieces
per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ortools.sat.python import cp_model

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.mask import AttentionMask
from planner_service.solvers.ilp.blocks import Blocks, block_shards
from planner_service.solvers.ilp.model import symmetry_items, token_floor


class Piece(NamedTuple):
    """Keys ``[start, end)`` of block ``block``, needed by a rank that holds ``block`` or
    any of ``reachers`` (later blocks of its doc whose window reaches ``start``)."""

    block: int
    start: int
    end: int
    first: int
    """Index into ``reachers`` of the first block that reaches this piece and not the one
    before it (the implication the model adds for it)."""
    reachers: tuple[int, ...]


def window_pieces(blocks: Blocks, window: int) -> list[list[Piece]]:
    """Per block, its pieces under ``window`` in position order (module docstring); a
    block no later block reaches has none (only its holder needs it). O(B r) for r
    reachers per block."""
    out: list[list[Piece]] = [[] for _ in blocks.blocks]
    for run in blocks.doc_runs:
        for k, b in enumerate(run):
            block = blocks.blocks[b]
            reach: list[tuple[int, int]] = []  # (breakpoint, later block)
            for c in run[k + 1:]:
                t = blocks.blocks[c].start - window + 1
                if t >= block.end:
                    break
                reach.append((max(block.start, t), c))
            if not reach:
                continue
            cuts = sorted({t for t, _ in reach})
            ends = [*cuts[1:], block.end]
            later = tuple(c for _, c in reach)
            done = 0
            for start, end in zip(cuts, ends, strict=True):
                upto = sum(1 for t, _ in reach if t <= start)
                out[b].append(Piece(b, start, end, done, later[:upto]))
                done = upto
    return out


def weighted_block_work(blocks: Blocks, mask: AttentionMask) -> list[int]:
    """Per block, its layer-weighted work ``sum_g count_g shard_window_workload``."""
    return [sum(g.layers * ww.shard_window_workload(b.start, b.end, g.window)
                for g in mask.groups) for b in blocks.blocks]


class WindowModel(NamedTuple):
    """A built model under a mask and the handles the solve needs."""

    model: cp_model.CpModel
    x: list[list[cp_model.IntVar]]
    """x[b][r]: block b is on rank r."""
    load: list[cp_model.IntVar]
    """Per rank, its layer-weighted work."""
    work_max: cp_model.IntVar
    comm: list[cp_model.IntVar]
    """Per layer group (mask order), its critical-path KV."""
    comm_total: cp_model.IntVar
    """``sum_g count_g comm[g]``."""
    need: list[list[tuple[Piece, list[cp_model.IntVar]]]]
    """Per layer group, every (piece, need booleans per rank); a causal group's pieces are
    whole blocks with every later block a reacher."""


def acts_causal(window: int | None, longest: int) -> bool:
    """A window no document exceeds attends what a causal layer does: the model then uses
    the causal prefix need (O(B) implications, where pieces would take O(B^2))."""
    return window is None or window >= longest


def causal_pieces(blocks: Blocks) -> list[Piece]:
    """The causal group's needs: every block but its doc's last, reached by all later
    blocks of its doc (the prefix need of :mod:`.model`)."""
    out = []
    for run in blocks.doc_runs:
        for k, b in enumerate(run[:-1]):
            block = blocks.blocks[b]
            out.append(Piece(b, block.start, block.end, 0, tuple(run[k + 1:])))
    return out


def build_window_model(blocks: Blocks, num_ranks: int, mask: AttentionMask, *,
                       token_cap: int, work_cap: int | None) -> WindowModel:
    """Variables and constraints of both objectives (the caller sets the objective);
    ``token_cap`` T and ``work_cap`` (layer-weighted, None for none) as in
    ``model.build_model``. Ranks numbered in order of first use (``symmetry_items``)."""
    # --- Data -------------------------------------------------------------------------
    n = num_ranks
    nb = len(blocks.blocks)
    size = [b.end - b.start for b in blocks.blocks]
    work = weighted_block_work(blocks, mask)
    total_tokens, total_work = sum(size), sum(work)
    model = cp_model.CpModel()
    # --- Variables and constraints: placement, tokens, work ---------------------------
    x = [[model.NewBoolVar(f"x_b{b}_r{r}") for r in range(n)] for b in range(nb)]
    for b in range(nb):
        model.AddExactlyOne(x[b])
    load = [model.NewIntVar(0, total_work, f"load_r{r}") for r in range(n)]
    work_max = model.NewIntVar(min(-(-total_work // n), total_work), total_work, "work_max")
    floor = token_floor(total_tokens, n, token_cap)
    for r in range(n):
        model.AddLinearConstraint(sum(size[b] * x[b][r] for b in range(nb)), floor, token_cap)
        model.Add(load[r] == sum(work[b] * x[b][r] for b in range(nb)))
        if work_cap is not None:
            model.Add(load[r] <= work_cap)
        model.Add(load[r] <= work_max)
    # --- The exchange, per layer group ------------------------------------------------
    comm, needs = [], []
    longest = max((b.end for b in blocks.blocks), default=0)
    for g, group in enumerate(mask.groups):
        group_needs: list[tuple[Piece, list[cp_model.IntVar]]] = []
        if acts_causal(group.window, longest):
            pieces = causal_pieces(blocks)
            by_block = {p.block: i for i, p in enumerate(pieces)}
            for p in pieces:
                group_needs.append((p, [model.NewBoolVar(f"n{g}_b{p.block}_r{r}")
                                        for r in range(n)]))
            for p, nv in group_needs:
                nxt = p.reachers[0]  # the next block: its need (or its holder) implies this
                later = group_needs[by_block[nxt]][1] if nxt in by_block else x[nxt]
                for r in range(n):
                    model.AddImplication(x[p.block][r], nv[r])
                    model.AddImplication(later[r], nv[r])
        else:
            assert group.window is not None  # acts_causal holds for None
            for block_pieces in window_pieces(blocks, group.window):
                before: list[cp_model.IntVar] | None = None
                for p in block_pieces:
                    nv = [model.NewBoolVar(f"n{g}_b{p.block}_{p.start}_r{r}") for r in range(n)]
                    for r in range(n):
                        model.AddImplication(x[p.block][r], nv[r])
                        if before is not None:
                            model.AddImplication(before[r], nv[r])
                        for c in p.reachers[p.first:]:
                            model.AddImplication(x[c][r], nv[r])
                    group_needs.append((p, nv))
                    before = nv
        top = model.NewIntVar(0, total_tokens, f"comm_g{g}")
        for r in range(n):
            recv = cp_model.LinearExpr.WeightedSum(
                [nv[r] - x[p.block][r] for p, nv in group_needs],
                [p.end - p.start for p, _ in group_needs])
            model.Add(recv <= top)
        comm.append(top)
        needs.append(group_needs)
    weights = [group.layers for group in mask.groups]
    comm_total = model.NewIntVar(0, total_tokens * sum(weights), "comm_total")
    model.Add(comm_total == cp_model.LinearExpr.WeightedSum(comm, weights))
    items = symmetry_items(blocks)
    for k, b in enumerate(items):
        for r in range(1, n):
            model.AddBoolOr([x[b][r].Not(), *(x[i][r - 1] for i in items[:k])])
    return WindowModel(model, x, load, work_max, comm, comm_total, needs)


class WindowValues(NamedTuple):
    """A placement's figures under the mask, from core/window_work.py."""

    tokens: list[int]
    loads: list[int]
    """Per rank, layer-weighted work."""
    comm: int
    """Layer-weighted critical-path exchange (all-to-all-v)."""


def window_values(blocks: Blocks, ranks: Sequence[int], num_ranks: int,
                  mask: AttentionMask) -> WindowValues:
    """The figures of a placement computed by core/window_work.py (independent of the
    model's need booleans). O(G B log B)."""
    shards = block_shards(blocks, ranks, num_ranks)
    arrays = cost.shard_arrays(shards)
    assert arrays is not None, "a request's blocks are int64-safe (core/request.py bounds)"
    loads, comm = ww.alltoallv_figures_of(arrays, mask)
    tokens = [sum(s.end - s.start for s in rank) for rank in shards]
    return WindowValues(tokens, list(loads), comm)


def add_window_hint(wm: WindowModel, blocks: Blocks, ranks: Sequence[int], num_ranks: int,
                    mask: AttentionMask) -> None:
    """Hint a complete solution: the placement and every variable it implies."""
    n = num_ranks
    for b, rank in enumerate(ranks):
        for r in range(n):
            wm.model.AddHint(wm.x[b][r], int(r == rank))
    tops = []
    for g, group_needs in enumerate(wm.need):
        recv = [0] * n
        for p, nv in group_needs:
            holders = {ranks[p.block], *(ranks[c] for c in p.reachers)}
            for r in range(n):
                need = int(r in holders)
                wm.model.AddHint(nv[r], need)
                recv[r] += (p.end - p.start) * (need - int(ranks[p.block] == r))
        tops.append(max(recv))
        wm.model.AddHint(wm.comm[g], tops[-1])
    values = window_values(blocks, ranks, n, mask)
    for r in range(n):
        wm.model.AddHint(wm.load[r], values.loads[r])
    wm.model.AddHint(wm.work_max, max(values.loads))
    wm.model.AddHint(wm.comm_total, sum(group.layers * top
                                        for group, top in zip(mask.groups, tops, strict=True)))
