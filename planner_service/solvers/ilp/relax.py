"""A relaxation of block placement that proves lower bounds on the critical-path KV.

CP-SAT's own bound on the full model is weak: its LP spreads every block over all ranks,
which needs no KV at all. Most of the optimum's KV comes from a few docs that cannot stay
whole (workload above the cap, or more tokens than a rank holds); the rest only fill the
ranks. So the relaxation keeps those docs (``must_split``, plus the longest doc) as blocks,
exactly as in the full model, and replaces the blocks of every other doc by a *fluid*:
rank r takes tau_r of its tokens and omega_r of its workload, with

- sum_r tau_r = the fluid's tokens and sum_r omega_r = its workload;
- tau_r + the rank's block tokens <= T and omega_r + the rank's block workload <= cap;
- g(tau_r) <= omega_r <= G(tau_r), where g (G) is the least (greatest) workload of a set
  of the fluid's blocks with tau tokens: any set of them may sit on a rank (a fluid doc
  may be split in the full model too), but a block is whole or absent.

Every placement of the full model gives a solution of the relaxation with the same KV on
the kept docs and at most the same KV per rank (the fluid docs' KV is dropped), so the
relaxation's optimum, and any bound CP-SAT proves on it, bounds the full model's optimum
from below. g and G are bounded by their tangents at up to ``MAX_LEVELS`` slopes (fewer
give a weaker but still valid bound).

Two grains (``GRAINS``). The fluid as the full model's blocks is the tighter bound: most
fluid docs are one block (shorter than the granularity), and a rank cannot take the cheap
first tokens of such a doc without the rest. The fluid as token positions (any set of
positions of the fluid docs may sit on a rank) is looser, but CP-SAT can prove its
optimum where it cannot prove the blocks' one in the same time, and since every set of
blocks is a set of positions that optimum is a floor for the blocks'. ``python -m
bench.ilp_relax`` compares the two grains' bounds and the time CP-SAT needs to prove them.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner_service.core.cost import doc_workload, shard_workload
from planner_service.solvers.ilp.blocks import Blocks
from planner_service.solvers.ilp.model import BlockModel, build_model, token_floor

MAX_LEVELS = 48


def must_split(doc_lengths: Sequence[int], token_cap: int, work_cap: int) -> list[int]:
    """Docs that no rank can hold whole (workload above the cap or more than T tokens),
    and the longest doc; in doc order."""
    longest = min(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
    return [d for d, length in enumerate(doc_lengths)
            if d == longest or length > token_cap or doc_workload(length) > work_cap]


def cost_levels(lengths: Sequence[int]) -> list[int]:
    """Slopes (workload per token) where the fluid bounds get a tangent: the powers of two
    and the doc lengths, thinned to at most ``MAX_LEVELS`` (always keeping the largest)."""
    top = max(lengths)
    levels = {1 << k for k in range(top.bit_length()) if 1 << k <= top} | set(lengths)
    ordered = sorted(levels)
    if len(ordered) > MAX_LEVELS:
        step = len(ordered) / MAX_LEVELS
        ordered = sorted({ordered[int(i * step)] for i in range(MAX_LEVELS)} | {top})
    return ordered


def block_costs(fluid: Blocks) -> list[tuple[int, int]]:
    """(tokens, workload) of every block of the fluid."""
    return [(b.end - b.start, shard_workload(b.start, b.end - b.start)) for b in fluid.blocks]


def doc_lengths(blocks: Blocks) -> list[int]:
    """The length of every doc of ``blocks`` (whole docs, as ``sub_blocks`` gives them)."""
    return [blocks.blocks[run[-1]].end for run in blocks.doc_runs if len(run)]


def fluid_tangents(fluid: Blocks) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Lines (slope c, intercept) below g and above G (module docstring), at the slopes
    ``cost_levels`` of the fluid docs' lengths. For any set of blocks, w - c t is the sum
    of w_b - c t_b over its blocks, so it lies between the sum of min(0, w_b - c t_b) and
    the sum of max(0, w_b - c t_b) over all blocks: g(tau) >= c tau + the first and
    G(tau) <= c tau + the second, for every tau."""
    costs = block_costs(fluid)
    slopes = cost_levels(doc_lengths(fluid))
    low = [(c, sum(min(0, w - c * t) for t, w in costs)) for c in slopes]
    high = [(c, sum(max(0, w - c * t) for t, w in costs)) for c in slopes]
    return low, high


def position_tangents(lengths: Sequence[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Lines (slope c, intercept) below g and above G when the fluid is token positions
    (any set of them may sit on a rank; position p of a doc costs p + 1), at the slopes
    ``cost_levels``: the tangents of g at tau(c) = sum_d min(L_d, c), the count of
    positions costing at most c, and of G at u(c), the count costing at least c."""
    low, high = [], []
    for c in cost_levels(lengths):
        tau = sum(min(length, c) for length in lengths)
        work = sum(doc_workload(min(length, c)) for length in lengths)
        low.append((c, work - c * tau))
        u = sum(length - c + 1 for length in lengths if length >= c)
        work = sum(doc_workload(length) - doc_workload(c - 1) for length in lengths if length >= c)
        high.append((c, work - c * u))
    return low, high


def sub_blocks(blocks: Blocks, docs: Sequence[int]) -> Blocks:
    """The blocks of ``docs`` only (their cuts unchanged)."""
    kept: list = []
    runs = []
    for d in docs:
        first = len(kept)
        kept.extend(blocks.blocks[b] for b in blocks.doc_runs[d])
        runs.append(range(first, len(kept)))
    return Blocks(tuple(kept), tuple(runs))


GRAINS = ("positions", "blocks")
"""What the fluid is made of: token positions (the looser bound, which CP-SAT can prove
where it cannot prove the other in the same time) or the full model's blocks (the tighter
bound of the module docstring)."""


def relaxation(kept: Blocks, fluid: Blocks, num_ranks: int, *, token_cap: int,
               work_cap: int, grain: str = "blocks") -> BlockModel:
    """The model of the module docstring for the blocks of the kept docs and of the fluid
    docs (both from ``sub_blocks``, whole docs), with the fluid of ``grain`` (``GRAINS``);
    the caller sets the objective."""
    assert grain in GRAINS
    # --- Data -------------------------------------------------------------------------
    n = num_ranks
    bm = build_model(kept, n, token_cap=token_cap, work_cap=work_cap)
    if not fluid.blocks:
        return bm
    model = bm.model
    size = [b.end - b.start for b in kept.blocks]
    costs = block_costs(fluid)
    fluid_tokens, fluid_work = sum(t for t, _ in costs), sum(w for _, w in costs)
    if grain == "blocks":
        low, high = fluid_tangents(fluid)
    else:
        low, high = position_tangents(doc_lengths(fluid))
    floor = token_floor(fluid_tokens + sum(size), n, token_cap)

    # --- Variables --------------------------------------------------------------------
    # tau[r] / omega[r]: tokens / workload of the fluid docs on rank r.
    tau = [model.NewIntVar(0, fluid_tokens, f"fluid_tokens_r{r}") for r in range(n)]
    omega = [model.NewIntVar(0, fluid_work, f"fluid_work_r{r}") for r in range(n)]

    # --- Constraints ------------------------------------------------------------------
    # The fluid is all placed.
    model.Add(sum(tau) == fluid_tokens)
    model.Add(sum(omega) == fluid_work)
    for r in range(n):
        # The rank's caps hold blocks and fluid together (tokens: as in the full model).
        model.AddLinearConstraint(sum(size[b] * bm.x[b][r] for b in range(len(size))) + tau[r],
                                  floor, token_cap)
        model.Add(bm.load[r] + omega[r] <= work_cap)
        # tau tokens of the fluid cost at least their cheapest and at most their dearest
        # blocks (positions).
        for slope, intercept in low:
            model.Add(omega[r] >= slope * tau[r] + intercept)
        for slope, intercept in high:
            model.Add(omega[r] <= slope * tau[r] + intercept)
    return bm
