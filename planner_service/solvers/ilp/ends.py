"""A lower bound on the critical-path KV by branching on where each rank's part of one doc ends.

Why: when the longest doc D is spread over several ranks, the KV a rank receives for it
is ``e_r - h_r``, the end of its last block of D minus the tokens of D it holds. Given the
ends, that is linear in the placement, and the linear relaxation (blocks of D split in
fractions, every other doc a fluid as in :mod:`.relax`) is tight enough to bound the
optimum well. CP-SAT's LP cannot see this: with the ends free it spreads every block
over all ranks and needs no KV at all. So the ends are branched on here, best first,
with an LP (GLOP) per node, and a leaf (every end fixed) is solved exactly by CP-SAT.

The model, for the ranks sorted by the end of their part of D (ranks interchangeable):

- ``x[b][k]`` in [0, 1]: the share of D's block b on rank k (1 in every placement);
- ``e[k]``: where rank k's part of D ends (0: it holds none of D), in the node's range,
  ``e[k] >= end_b x[b][k]`` and ``e[k] <= e[k + 1]``; the last rank ends at L;
- rank k receives ``e[k] - sum_b size_b x[b][k]`` tokens of D's KV, at most v;
- a rank whose part of D surely exists (its range starts above 0) holds the last block
  of that part, whose end lies in the range: those blocks' shares on it sum to >= 1;
- tokens and workload caps per rank over D's blocks and the fluid; the fluid's tokens
  tau and workload omega per rank within the tangents of ``relax.fluid_tangents``.

Every placement of the full model is a solution of the node whose ranges hold its ends,
with the same KV of D per rank and at most the same critical-path KV (other docs' KV is
dropped), so the least node bound over the open nodes bounds the full model from below.
A node's range for one rank's end splits in halves (the widest range first); the search
stops when the LPs' budget is spent, when the least open bound reaches ``stop_at`` (the
incumbent: then it is optimal), or when the least open node is a leaf already solved.

Numbers: LP values are floats (GLOP); a node's bound is ``ceil(v (1 - EPSILON))`` in
tokens, and the rows are scaled (tokens by T, workloads by the cap) so that every
coefficient is of order one. Deterministic: the same input gives the same nodes in the same order.
"""

from __future__ import annotations

import heapq
import math
import time
from typing import NamedTuple

from ortools.linear_solver import pywraplp
from ortools.sat.python import cp_model

from planner_service.core.cost import shard_workload
from planner_service.solvers.ilp.blocks import Blocks
from planner_service.solvers.ilp.relax import block_costs, fluid_tangents

EPSILON = 1e-6
"""Relative tolerance taken off an LP value before it is rounded up to a bound."""
LP_NODE_S = 5e-4
LP_WORK_S = 1.6e-8
"""The LPs' time, counted deterministically: ``LP_NODE_S`` per LP plus ``LP_WORK_S`` per
simplex iteration and row or column of the LP, a stand-in for GLOP's CPU time on block
models that errs high (GLOP reports no deterministic time)."""
LEAF_BASE_S = 0.003
LEAF_DTIME_FACTOR = 2.5
"""The leaves' time, counted deterministically: ``LEAF_BASE_S`` per leaf (copying the
model and presolving it) plus ``LEAF_DTIME_FACTOR`` times CP-SAT's deterministic time,
which on these small models undercounts the CPU time."""


class EndsBound(NamedTuple):
    """The outcome of ``ends_bound``."""

    bound: int
    """Proven: no placement has a critical-path KV below this."""
    nodes: int
    """LPs solved."""
    lp_seconds: float
    """Their time, counted as ``LP_NODE_S`` and ``LP_WORK_S`` say."""
    leaf_seconds: float
    """The leaves' time, counted as ``LEAF_BASE_S`` and ``LEAF_DTIME_FACTOR`` say."""
    deterministic: bool = True
    """False if the wall-clock deadline, not the budgets, ended the search."""


class EndsData(NamedTuple):
    """What the LP and the leaves read of D's blocks and of the fluid."""

    ends: list[int]
    """End position of end index j: 0 (none of D), then the end of each of D's blocks."""
    size: list[int]
    """Tokens of each of D's blocks."""
    work: list[int]
    """Workload of each of D's blocks."""
    fluid_tokens: int
    fluid_work: int
    low: list[tuple[int, int]]
    high: list[tuple[int, int]]
    """The fluid's tangents (``relax.fluid_tangents``; none without a fluid)."""


def ends_data(doc: Blocks, fluid: Blocks) -> EndsData:
    """``EndsData`` of the longest doc's blocks ``doc`` and the other docs' blocks ``fluid``."""
    spans = [(b.start, b.end) for b in doc.blocks]
    costs = block_costs(fluid)
    low, high = fluid_tangents(fluid) if fluid.blocks else ([], [])
    return EndsData([0] + [end for _, end in spans], [end - start for start, end in spans],
                    [shard_workload(start, end - start) for start, end in spans],
                    sum(t for t, _ in costs), sum(w for _, w in costs), low, high)


class _Lp:
    """The node LP of the module docstring, built once; a node sets variable bounds."""

    def __init__(self, data: EndsData, n: int, token_cap: int, work_cap: int,
                 token_floor: int) -> None:
        # --- Data ---------------------------------------------------------------------
        self.n = n
        self.ends = data.ends
        length, num_blocks, size, work = data.ends[-1], len(data.size), data.size, data.work
        fluid_tokens, fluid_work, low, high = data.fluid_tokens, data.fluid_work, data.low, data.high
        tok, wk = float(token_cap), float(work_cap)  # units of the rows
        self.scale = tok
        self.seconds = 0.0
        solver = pywraplp.Solver.CreateSolver("GLOP")
        assert solver is not None
        inf = solver.infinity()
        self.solver = solver

        # --- Variables ----------------------------------------------------------------
        # x[b][k]: share of D's block b on rank k; e[k]: end of rank k's part of D (in
        # units of T); tau / omega: fluid tokens / workload on rank k (units T / cap);
        # v: the critical-path KV of D (units of T).
        self.x = [[solver.NumVar(0, 1, f"x_b{b}_k{k}") for k in range(n)] for b in range(num_blocks)]
        self.e = [solver.NumVar(0, length / tok, f"e_k{k}") for k in range(n)]
        tau = [solver.NumVar(0, fluid_tokens / tok, f"tau_k{k}") for k in range(n)]
        omega = [solver.NumVar(0, fluid_work / wk, f"omega_k{k}") for k in range(n)]
        self.v = solver.NumVar(0, inf, "v")

        # --- Constraints --------------------------------------------------------------
        for b in range(num_blocks):  # every block of D is placed
            solver.Add(sum(self.x[b]) == 1)
        solver.Add(sum(tau) == fluid_tokens / tok)  # the fluid is all placed
        solver.Add(sum(omega) == fluid_work / wk)
        self.last_rows = []
        for k in range(n):
            held = sum(size[b] / tok * self.x[b][k] for b in range(num_blocks))
            # Tokens within [floor, T], workload within the cap.
            solver.Add(held + tau[k] <= 1.0)
            solver.Add(held + tau[k] >= token_floor / tok)
            solver.Add(sum(work[b] / wk * self.x[b][k] for b in range(num_blocks)) + omega[k] <= 1.0)
            # The fluid's workload between the tangents of its least and greatest.
            for slope, intercept in low:
                solver.Add(omega[k] >= (slope * tok * tau[k] + intercept) / wk)
            for slope, intercept in high:
                solver.Add(omega[k] <= (slope * tok * tau[k] + intercept) / wk)
            # D's KV on rank k: its end minus what it holds.
            solver.Add(self.e[k] - held <= self.v)
            # The end is past every block the rank holds; ends in rank order.
            for b in range(num_blocks):
                solver.Add(self.e[k] >= self.ends[b + 1] / tok * self.x[b][k])
            if k + 1 < n:
                solver.Add(self.e[k] <= self.e[k + 1])
            # The rank holds the block its part ends with (coefficients set per node).
            self.last_rows.append(solver.Add(sum(self.x[b][k] for b in range(num_blocks)) >= 0))

        # --- Objective ----------------------------------------------------------------
        solver.Minimize(self.v)

    def solve(self, lo: list[int], hi: list[int]) -> int | None:
        """The node's bound in tokens (0 if GLOP gives no verdict), or None if its LP is
        infeasible; adds the LP's time to ``seconds``."""
        inf = self.solver.infinity()
        for k in range(self.n):
            self.e[k].SetBounds(self.ends[lo[k]] / self.scale, self.ends[hi[k]] / self.scale)
            row = self.last_rows[k]
            for b, row_x in enumerate(self.x):
                # Block b ends at end index b + 1: on rank k only up to its range's top.
                row_x[k].SetUb(1.0 if b + 1 <= hi[k] else 0.0)
                row.SetCoefficient(row_x[k], 1.0 if lo[k] <= b + 1 <= hi[k] else 0.0)
            row.SetBounds(1.0 if lo[k] >= 1 else 0.0, inf)
        status = self.solver.Solve()
        size = self.solver.NumVariables() + self.solver.NumConstraints()
        self.seconds += LP_NODE_S + LP_WORK_S * self.solver.iterations() * size
        if status == pywraplp.Solver.INFEASIBLE:
            return None
        if status != pywraplp.Solver.OPTIMAL:
            return 0  # no verdict: the node keeps its parent's bound
        value = self.v.solution_value() * self.scale
        return max(0, math.ceil(value - EPSILON * max(1.0, value)))


class Leaves:
    """A leaf exactly (the module docstring with the ends fixed and D's blocks whole): the
    part shared by every leaf is built once, and ``model`` copies it and adds a leaf's ends."""

    def __init__(self, data: EndsData, n: int, *, token_cap: int, work_cap: int,
                 token_floor: int) -> None:
        # --- Data ---------------------------------------------------------------------
        self.position, self.size, work = data.ends, data.size, data.work
        fluid_tokens, fluid_work, low, high = data.fluid_tokens, data.fluid_work, data.low, data.high
        model = cp_model.CpModel()
        self.base = model

        # --- Variables ----------------------------------------------------------------
        # x[b][k] = 1 iff block b of D is on rank k; tau / omega: fluid tokens / workload
        # on rank k; v: the critical-path KV of D.
        self.x = [[model.NewBoolVar(f"x_b{b}_k{k}") for k in range(n)] for b in range(len(work))]
        tau = [model.NewIntVar(0, fluid_tokens, f"tau_k{k}") for k in range(n)]
        omega = [model.NewIntVar(0, fluid_work, f"omega_k{k}") for k in range(n)]
        self.v = model.NewIntVar(0, self.position[-1], "v")

        # --- Constraints --------------------------------------------------------------
        for row in self.x:  # every block of D on one rank
            model.AddExactlyOne(row)
        model.Add(sum(tau) == fluid_tokens)  # the fluid is all placed
        model.Add(sum(omega) == fluid_work)
        for k in range(n):
            column = [row[k] for row in self.x]
            # Tokens within [floor, T], workload within the cap.
            model.AddLinearConstraint(cp_model.LinearExpr.WeightedSum(column, self.size) + tau[k],
                                      token_floor, token_cap)
            model.Add(cp_model.LinearExpr.WeightedSum(column, work) + omega[k] <= work_cap)
            # The fluid's workload between the tangents of its least and greatest.
            for slope, intercept in low:
                model.Add(omega[k] >= slope * tau[k] + intercept)
            for slope, intercept in high:
                model.Add(omega[k] <= slope * tau[k] + intercept)

    def model(self, ends: list[int]) -> tuple[cp_model.CpModel, list[list[cp_model.IntVar | None]]]:
        """The leaf whose rank k's part of D ends at end index ``ends[k]``: the model (v
        minimised) and x (None where a block cannot be on a rank)."""
        model = self.base.clone()
        x: list[list[cp_model.IntVar | None]] = []
        for b, row in enumerate(self.x):
            x.append([])
            for k, var in enumerate(row):
                if b + 1 > ends[k]:  # past the end of rank k's part: not there
                    model.Proto().variables[var.Index()].domain[:] = [0, 0]
                    x[b].append(None)
                else:
                    x[b].append(model.get_bool_var_from_proto_index(var.Index()))
        v = model.get_int_var_from_proto_index(self.v.Index())
        for k, end in enumerate(ends):
            if end > 0:
                last = x[end - 1][k]
                assert last is not None
                model.Add(last == 1)  # the rank holds the block its part ends with
                # D's KV on rank k: its end minus what it holds.
                held = [(on, self.size[b]) for b, row in enumerate(x) if (on := row[k]) is not None]
                model.Add(self.position[end] - cp_model.LinearExpr.WeightedSum(
                    [on for on, _ in held], [size for _, size in held]) <= v)
        # --- Objective ----------------------------------------------------------------
        model.Minimize(v)
        return model, x


def ends_bound(doc: Blocks, fluid: Blocks, num_ranks: int, *, token_cap: int, work_cap: int,
               token_floor: int, lp_budget_s: float, stop_at: int, leaf_limit_s: float,
               leaf_budget_s: float, deadline: float = math.inf) -> EndsBound:
    """The bound of the module docstring for the doc whose blocks are ``doc`` (one doc,
    ``relax.sub_blocks``) and the fluid of every other doc's blocks.

    ``lp_budget_s``: no node is split once the LPs' time (``lp_seconds``) reaches it;
    ``stop_at``: the incumbent's value (a bound there proves it optimal); a leaf's CP-SAT
    solve gets at most ``leaf_limit_s`` deterministic seconds, and once the leaves' time
    (``leaf_seconds``) reaches ``leaf_budget_s``, a leaf keeps its LP bound. The search
    also stops at ``deadline`` (``time.monotonic()``; the caller's wall-clock guard), with
    the bound proven so far."""
    n = num_ranks
    data = ends_data(doc, fluid)
    lp = _Lp(data, n, token_cap, work_cap, token_floor)
    leaves = Leaves(data, n, token_cap=token_cap, work_cap=work_cap, token_floor=token_floor)
    top = len(lp.ends) - 1
    whole = _narrow([0] * n, [top] * n, n - 1, top, top)
    assert whole is not None
    lo, hi = whole
    root = lp.solve(lo, hi)
    if root is None:
        return EndsBound(stop_at, 1, lp.seconds, 0.0)  # no placement meets the caps
    # Open nodes: (bound, order, lo, hi, solved) with solved = the leaf's exact solve done.
    heap = [(root, 0, lo, hi, False)]
    nodes, order, leaf_seconds, deterministic = 1, 1, 0.0, True
    while heap and lp.seconds < lp_budget_s and heap[0][0] < stop_at:
        if time.monotonic() >= deadline:
            deterministic = False
            break
        bound, _, lo, hi, solved = heap[0]
        if solved:
            break  # the least open node is a leaf solved as far as it goes
        heapq.heappop(heap)
        wide = [k for k in range(n) if hi[k] > lo[k]]
        if not wide:  # a leaf: solve it exactly while the budget lasts
            leaf: int | None = bound
            if leaf_seconds < leaf_budget_s:
                leaf, dtime, in_time = _solve_leaf(
                    leaves, lo, min(leaf_limit_s, leaf_budget_s - leaf_seconds), deadline)
                leaf_seconds += LEAF_BASE_S + LEAF_DTIME_FACTOR * dtime
                deterministic = deterministic and in_time
            if leaf is not None:
                heapq.heappush(heap, (max(bound, leaf), order, lo, hi, True))
                order += 1
            continue
        k = max(wide, key=lambda k: (hi[k] - lo[k], -k))
        mid = (lo[k] + hi[k]) // 2
        for start, stop in ((lo[k], mid), (mid + 1, hi[k])):
            child = _narrow(lo, hi, k, start, stop)
            if child is None:
                continue
            value = lp.solve(*child)
            nodes += 1
            if value is not None:
                heapq.heappush(heap, (max(bound, value), order, *child, False))
                order += 1
    return EndsBound(min(heap[0][0], stop_at) if heap else stop_at, nodes, lp.seconds,
                     leaf_seconds, deterministic)


def _narrow(lo: list[int], hi: list[int], k: int, start: int,
            stop: int) -> tuple[list[int], list[int]] | None:
    """The ranges with rank k's end in [start, stop], then narrowed so that the nonzero
    ends rise strictly in rank order; None if a range is empty."""
    lo, hi = lo[:], hi[:]
    lo[k], hi[k] = start, stop
    n = len(lo)
    for j in range(n - 1):
        lo[j + 1] = max(lo[j + 1], lo[j] + (lo[j] > 0))
    for j in range(n - 2, -1, -1):
        hi[j] = min(hi[j], max(hi[j + 1] - 1, 0))
    if any(a > b for a, b in zip(lo, hi, strict=True)):
        return None
    return lo, hi


def _solve_leaf(leaves: Leaves, ends: list[int], limit_s: float,
                deadline: float) -> tuple[int | None, float, bool]:
    """CP-SAT's proven bound on a leaf (None if infeasible), the deterministic time, and
    whether the deterministic limit (not ``deadline``) ended the solve."""
    model, _ = leaves.model(ends)
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = limit_s
    solver.parameters.max_time_in_seconds = max(0.0, deadline - time.monotonic())
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    status = solver.Solve(model)
    response = solver.ResponseProto()
    in_time = status in (cp_model.OPTIMAL, cp_model.INFEASIBLE) \
        or response.wall_time < 0.999 * solver.parameters.max_time_in_seconds
    if status == cp_model.INFEASIBLE:
        return None, response.deterministic_time, in_time
    assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.UNKNOWN), solver.StatusName(status)
    return max(0, math.ceil(solver.BestObjectiveBound() - 1e-6)), response.deterministic_time, in_time
