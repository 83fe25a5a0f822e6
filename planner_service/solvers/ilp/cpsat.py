"""How the ILP runs CP-SAT: a deterministic configuration under a wall-clock deadline.

Deterministic: one worker searches sequentially; several workers use CP-SAT's interleaved
search; either way the limit is CP-SAT's deterministic time, so the same model gives the
same answer on a quiet or a busy machine. The wall clock is only a safety bound: no call
runs past the whole solve's deadline (``Cp.deadline``: ``time_limit_s`` less
``Tuning.wall_margin_s`` from its start), and a call it cuts short is reported as not
deterministic.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import NamedTuple

from ortools.sat.python import cp_model

from planner_service.solvers.ilp.model import BlockModel
from planner_service.solvers.ilp.tuning import Tuning

SLOW_SUBSOLVERS = ("max_lp", "reduced_costs", "pseudo_costs", "quick_restart", "default_lp")
"""Full-problem subsolvers whose interleaved chunks overrun their deterministic budget by
seconds of wall time on the block model (heavy LP); the rest plus LNS remain."""


QUESTION_LINEARIZATION = 2
"""CP-SAT's ``linearization_level`` for a yes/no question "critical-path KV <= v?": level 2
puts the need implications into the LP, which refutes a v near the optimum of a small
model three times faster in deterministic time than the default level 1 (4 docs of 7K
tokens at N = 4: 0.23 against 0.71 deterministic seconds)."""

SMALL_CUT_LEVEL = 0
SMALL_LINEARIZATION = 1
"""CP-SAT's ``cut_level`` and ``linearization_level`` for the closing minimisation of a
small model (``Tuning.small_bools``): without cut rounds, and with the default
linearisation, its LP stays small and the search goes several times further per
deterministic second. 4 docs of 7K tokens at N = 4, below an incumbent of 1956: 0.28
deterministic seconds to the optimum 1634 and its proof, against 0.55 without cuts at
``linearization_level`` 2 and 1.3 with cuts; the proof alone (``1585 <= critical-path KV
<= 1633``) 0.09 against 0.20 with cuts at level 2."""


class Cp(NamedTuple):
    """How one solve runs CP-SAT: its workers, its wall-clock deadline and its tuning."""

    workers: int
    deadline: float
    """``time.monotonic()`` after which no CP-SAT call of the solve runs on (the whole
    solve's wall-clock guard, module docstring)."""
    tuning: Tuning

    @classmethod
    def start(cls, workers: int, wall_s: float, tuning: Tuning) -> Cp:
        """The configuration of a solve of ``wall_s`` wall seconds (``time_limit_s``)
        starting now."""
        return cls(workers, time.monotonic() + search_wall_s(wall_s, tuning), tuning)


def search_wall_s(wall_s: float, tuning: Tuning) -> float:
    """The search's share of a solve of ``wall_s`` wall seconds (module docstring)."""
    return wall_s - min(tuning.wall_margin_s, wall_s / 4)


def budget_s(wall_s: float, tuning: Tuning) -> float:
    """The deterministic budget of a solve of ``wall_s`` wall seconds (``time_limit_s``)."""
    return wall_s * tuning.dtime_per_s


class Solve(NamedTuple):
    """The outcome of one CP-SAT solve (or of a search made of several)."""

    status: str
    """CP-SAT's status name: OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN or MODEL_INVALID."""
    ranks: list[int] | None
    value: int
    bound: int
    dtime: float
    deterministic: bool


def solver_for(limit_s: float, cp: Cp, *, question: bool = False,
               small: bool = False) -> cp_model.CpSolver:
    """A deterministic CP-SAT configuration (module docstring); ``question``: a yes/no
    question, solved with CP-SAT's fullest linearisation (``QUESTION_LINEARIZATION``);
    ``small``: a small model, solved without cut rounds (``SMALL_CUT_LEVEL``,
    ``SMALL_LINEARIZATION``)."""
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.max_deterministic_time = limit_s
    p.max_time_in_seconds = max(0.0, cp.deadline - time.monotonic())
    p.random_seed = 0
    p.num_workers = cp.workers
    if question:
        p.linearization_level = QUESTION_LINEARIZATION
    if small:
        p.cut_level = SMALL_CUT_LEVEL
        p.linearization_level = SMALL_LINEARIZATION
    if cp.workers > 1:
        p.interleave_search = True
        p.ignore_subsolvers.extend(SLOW_SUBSOLVERS)
    return solver


def run(bm: BlockModel, target: cp_model.IntVar | None, limit_s: float, cp: Cp, *,
        sequential: bool = False, small: bool = False) -> Solve:
    """Minimise ``target`` (None: find any solution) with the hint already set; the
    solution's rank per block. ``sequential``: minimise as a yes/no question is solved
    (one worker, ``QUESTION_LINEARIZATION``); ``small``: as ``solver_for`` says."""
    if target is not None:
        bm.model.Minimize(target)
    # A yes/no question runs CP-SAT's default sequential search: its LP and probing refute
    # a v fastest (and interleaving every subsolver with a hint trips a CP-SAT check).
    question = target is None or sequential
    solver, status, dtime, deterministic = solve_model(
        bm.model, limit_s, cp._replace(workers=1) if question else cp, question=question,
        small=small)
    dtime += build_charge(bm.x, cp.tuning)
    if status not in ("OPTIMAL", "FEASIBLE"):
        bound = int(math.ceil(solver.BestObjectiveBound())) if status == "UNKNOWN" else 0
        return Solve(status, None, 0, max(bound, 0), dtime, deterministic)
    ranks = chosen(solver, bm.x)
    if target is None:
        return Solve(status, ranks, 0, 0, dtime, deterministic)
    value = int(round(solver.ObjectiveValue()))
    bound = int(math.ceil(solver.BestObjectiveBound() - 1e-6))
    return Solve(status, ranks, value, min(bound, value), dtime, deterministic)


def build_charge(rows: Sequence[Sequence[object]], tuning: Tuning) -> float:
    """The deterministic seconds charged for building a model of these placement rows
    (``Tuning.build_charge``)."""
    return tuning.build_charge * sum(len(row) for row in rows)


def chosen(solver: cp_model.CpSolver, rows: Sequence[Sequence[cp_model.IntVar]]) -> list[int]:
    """Per row of exactly-one booleans, the index of the one that is true."""
    return [next(i for i, v in enumerate(row) if solver.BooleanValue(v)) for row in rows]


def solve_model(model: cp_model.CpModel, limit_s: float, cp: Cp, *, question: bool = False,
                small: bool = False) -> tuple[cp_model.CpSolver, str, float, bool]:
    """Solve with the deterministic configuration: the solver, CP-SAT's status name, the
    deterministic time spent (the whole limit if the wall-clock guard ended it) and
    whether the limit (not the guard) ended it."""
    solver = solver_for(limit_s, cp, question=question, small=small)
    status = solver.StatusName(solver.Solve(model))
    assert status != "MODEL_INVALID", solver.SolutionInfo()
    response = solver.ResponseProto()
    guard_hit = response.wall_time >= 0.999 * solver.parameters.max_time_in_seconds
    deterministic = status in ("OPTIMAL", "INFEASIBLE") or not guard_hit
    # A solve cut short by the guard counts its whole limit: the callers loop until their
    # budget is spent, and a machine so loaded that CP-SAT does no deterministic work
    # before the guard must still end the search.
    spent = response.deterministic_time if deterministic else max(response.deterministic_time, limit_s)
    return solver, status, spent, deterministic
