"""A relaxation of block placement that proves lower bounds on the critical-path KV.

CP-SAT's own bound on the full model is weak: its LP spreads every block over all ranks,
which needs no KV at all. Most of the optimum's KV comes from a few docs that cannot stay
whole (workload above the cap, or more tokens than a rank holds); the rest only fill the
ranks. So the relaxation keeps those docs (``must_split``, plus the longest doc) as blocks,
exactly as in the full model, and replaces every other doc by a *fluid*: rank r takes
tau_r of its tokens and omega_r of its workload, with

- sum_r tau_r = the fluid's tokens and sum_r omega_r = its workload;
- tau_r + the rank's block tokens <= T and omega_r + the rank's block workload <= cap;
- g(tau_r) <= omega_r <= G(tau_r), where g (G) is the workload of the tau cheapest
  (dearest) token positions of the fluid docs: position p of a doc costs p + 1 and any
  set of positions may sit on a rank (a fluid doc may be split in the full model too).

Every placement of the full model gives a solution of the relaxation with the same KV on
the kept docs and at most the same KV per rank (the fluid docs' KV is dropped), so the
relaxation's optimum, and any bound CP-SAT proves on it, bounds the full model's optimum
from below. g is convex and G concave, piecewise linear with one piece per cost level;
both are written as their tangents at up to ``MAX_LEVELS`` levels (fewer tangents give a
weaker but still valid bound).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner_service.core.cost import doc_workload
from planner_service.solvers.ilp_blocks import Blocks
from planner_service.solvers.ilp_model import BlockModel, build_model, token_floor

MAX_LEVELS = 48


def must_split(doc_lengths: Sequence[int], token_cap: int, work_cap: int) -> list[int]:
    """Docs that no rank can hold whole (workload above the cap or more than T tokens),
    and the longest doc; in doc order."""
    longest = min(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
    return [d for d, length in enumerate(doc_lengths)
            if d == longest or length > token_cap or doc_workload(length) > work_cap]


def cost_levels(lengths: Sequence[int]) -> list[int]:
    """Position costs where the fluid bounds get a tangent: the powers of two and the doc
    lengths, thinned to at most ``MAX_LEVELS`` (always keeping the largest)."""
    top = max(lengths)
    levels = {1 << k for k in range(top.bit_length()) if 1 << k <= top} | set(lengths)
    ordered = sorted(levels)
    if len(ordered) > MAX_LEVELS:
        step = len(ordered) / MAX_LEVELS
        ordered = sorted({ordered[int(i * step)] for i in range(MAX_LEVELS)} | {top})
    return ordered


def cheapest_tangents(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Lines (slope c, intercept) with g(tau) >= c tau + intercept for every tau: tangents
    of g at tau(c) = sum_d min(L_d, c), the count of positions costing at most c."""
    lines = []
    for c in cost_levels(lengths):
        tau = sum(min(length, c) for length in lengths)
        work = sum(doc_workload(min(length, c)) for length in lengths)
        lines.append((c, work - c * tau))
    return lines


def dearest_tangents(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Lines (slope c, intercept) with G(tau) <= c tau + intercept for every tau: tangents
    of G at u(c) = the count of positions costing at least c."""
    lines = []
    for c in cost_levels(lengths):
        u = sum(length - c + 1 for length in lengths if length >= c)
        work = sum(doc_workload(length) - doc_workload(c - 1) for length in lengths if length >= c)
        lines.append((c, work - c * u))
    return lines


def sub_blocks(blocks: Blocks, docs: Sequence[int]) -> Blocks:
    """The blocks of ``docs`` only (their cuts unchanged)."""
    kept: list = []
    runs = []
    for d in docs:
        first = len(kept)
        kept.extend(blocks.blocks[b] for b in blocks.doc_runs[d])
        runs.append(range(first, len(kept)))
    return Blocks(tuple(kept), tuple(runs))


def relaxation(kept: Blocks, fluid: Sequence[int], num_ranks: int, *, token_cap: int,
               work_cap: int) -> BlockModel:
    """The model of the module docstring for the blocks of the kept docs (``sub_blocks``)
    and the lengths of the fluid docs; the caller sets the objective."""
    # --- Data -------------------------------------------------------------------------
    n = num_ranks
    bm = build_model(kept, n, token_cap=token_cap, work_cap=work_cap)
    if not fluid:
        return bm
    model = bm.model
    size = [b.end - b.start for b in kept.blocks]
    fluid_tokens = sum(fluid)
    fluid_work = sum(doc_workload(length) for length in fluid)
    low, high = cheapest_tangents(fluid), dearest_tangents(fluid)
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
        # positions.
        for slope, intercept in low:
            model.Add(omega[r] >= slope * tau[r] + intercept)
        for slope, intercept in high:
            model.Add(omega[r] <= slope * tau[r] + intercept)
    return bm
