"""The smaller models the ILP's comm search solves besides the full one (see :mod:`.search`).

``Subproblems`` holds one instance (blocks, ranks, caps) and its derived models: the
relaxation of :mod:`.relax`, the ends' bound of :mod:`.ends`, the rank-group steps of
:mod:`.lns`, the fill question of :mod:`.fill` and the whole-doc question of
``model.whole_doc_model``. ``Search`` is where the search stands between its steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from planner_service.core.cost import doc_workload
from planner_service.solvers.ilp.blocks import Blocks
from planner_service.solvers.ilp.cpsat import Cp, Solve, build_charge, chosen, solve_model
from planner_service.solvers.ilp.ends import ends_bound
from planner_service.solvers.ilp.fill import fill_model, fill_ranks, option_count
from planner_service.solvers.ilp.lns import GroupModel, Step, descend
from planner_service.solvers.ilp.model import (
    MAX_MODEL_BOOLS,
    BlockModel,
    add_hint,
    canonical_ranks,
    placement_values,
    token_floor,
    whole_doc_model,
)
from planner_service.solvers.ilp.relax import must_split, relaxation, sub_blocks


class Search(NamedTuple):
    """Where the comm search stands: the incumbent and the proven bound."""

    ranks: list[int]
    """The best placement found."""
    value: int
    """Its critical-path KV."""
    bound: int
    """Proven: no placement has a critical-path KV below this."""
    spent: float
    """Deterministic seconds used so far."""
    deterministic: bool
    found: bool = False
    """Whether CP-SAT has returned a placement (else the plan is the fallback)."""


class Subproblems:
    """The subproblems of one instance: blocks on ``n`` ranks of at most ``tokens_cap``
    tokens and ``work_cap`` workload, solved with the CP-SAT configuration ``cp``."""

    def __init__(self, blocks: Blocks, doc_lengths: Sequence[int], n: int, tokens_cap: int,
                 work_cap: int, cp: Cp) -> None:
        self.blocks, self.doc_lengths, self.n, self.cp = blocks, doc_lengths, n, cp
        self.tokens_cap, self.work_cap = tokens_cap, work_cap
        self.kept = must_split(doc_lengths, tokens_cap, work_cap)
        """The docs that cannot stay whole (and the longest): blocks in the relaxation."""
        keep = set(self.kept)
        self.fluid_docs = [d for d in range(len(doc_lengths)) if d not in keep]
        """The other docs: a fluid in the relaxation, options in the fill question."""
        self.relax_blocks = sub_blocks(blocks, self.kept)
        self.fluid = sub_blocks(blocks, self.fluid_docs)
        longest = min(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
        self.longest_doc = sub_blocks(blocks, [longest])
        self.others = sub_blocks(blocks, [d for d in range(len(doc_lengths)) if d != longest])
        self.fill_first = doc_lengths[longest] <= tokens_cap
        """Whether the longest doc fits on a rank (at most T tokens): then the relaxation
        is usually solved, and the bound and the fill question come before the rank-group
        steps (``search.solve_comm``)."""
        self.small = len(blocks.blocks) * n <= cp.tuning.small_bools
        """Whether the full model is small (``Tuning.small_bools``)."""
        self.all_fit = all(length <= tokens_cap and doc_workload(length) <= work_cap
                           for length in doc_lengths)
        """Whether every doc fits whole on a rank (tokens and workload): only then can
        every doc stay whole."""

    def relaxation(self, ranks: list[int] | None, grain: str, floor: int) -> BlockModel:
        """The relaxation of :mod:`.relax` with the fluid of ``grain`` (``relax.GRAINS``)
        and ``floor`` on its critical-path KV, hinted with a placement of its blocks if
        given."""
        bm = relaxation(self.relax_blocks, self.fluid, self.n, token_cap=self.tokens_cap,
                        work_cap=self.work_cap, grain=grain)
        if ranks is not None:
            add_hint(bm, self.relax_blocks, ranks, self.n)
        bm.model.Add(bm.comm_max >= floor)
        return bm

    def relaxed_ranks(self, ranks: list[int]) -> list[int]:
        """The placement of the relaxation's blocks in a placement of the full model's."""
        runs = self.blocks.doc_runs
        return canonical_ranks(self.relax_blocks, [ranks[b] for d in self.kept for b in runs[d]],
                               self.n)

    def relaxed_value(self, ranks: list[int]) -> int:
        """The critical-path KV of a placement of the relaxation's blocks."""
        return max(placement_values(self.relax_blocks, ranks, self.n)[2])

    def whole_docs(self, limit_s: float) -> Solve:
        """Whether, within ``limit_s`` deterministic seconds, every doc can stay whole
        (``model.whole_doc_model``); a YES comes as a placement of the full model's
        blocks."""
        model, y = whole_doc_model(self.doc_lengths, self.n, token_cap=self.tokens_cap,
                                   work_cap=self.work_cap)
        # A yes/no question: sequential search, as in ``cpsat.run``.
        solver, status, dtime, deterministic = solve_model(model, limit_s,
                                                           self.cp._replace(workers=1))
        if status not in ("OPTIMAL", "FEASIBLE"):
            return Solve(status, None, 0, 0, dtime, deterministic)
        rank_of = chosen(solver, y)
        ranks = canonical_ranks(self.blocks, [rank_of[block.doc] for block in self.blocks.blocks],
                                self.n)
        return Solve(status, ranks, 0, 0, dtime, deterministic)

    def fill(self, v: int, limit_s: float) -> Solve:
        """Asks, within ``limit_s`` deterministic seconds, the restricted model of
        :mod:`.fill` for a placement whose critical-path KV is at most ``v``."""
        blocks, n = self.blocks, self.n
        if option_count(blocks, self.fluid_docs, n) > MAX_MODEL_BOOLS:
            return Solve("UNKNOWN", None, 0, 0, 0.0, True)  # too large to be quick
        fm = fill_model(blocks, self.kept, self.fluid_docs, n, token_cap=self.tokens_cap,
                        work_cap=self.work_cap)
        fm.model.Add(fm.comm_max <= v)
        # A yes/no question: sequential search, as in ``cpsat.run``.
        solver, status, dtime, deterministic = solve_model(fm.model, limit_s,
                                                           self.cp._replace(workers=1))
        if status not in ("OPTIMAL", "FEASIBLE"):
            return Solve(status, None, 0, 0, dtime, deterministic)
        options = [next(option for option, on in doc if solver.BooleanValue(on))
                   for doc in fm.options]
        ranks = fill_ranks(blocks, self.kept, self.fluid_docs, chosen(solver, fm.kept_x), options)
        return Solve(status, canonical_ranks(blocks, ranks, n), 0, 0, dtime, deterministic)

    def group_search(self, state: Search, until: float, step_limit: float) -> Search:
        """Improves the incumbent by ``lns.descend`` until deterministic second ``until``
        of the limit, each step starting at ``step_limit`` seconds."""
        cp = self.cp

        def solve(gm: GroupModel, limit_s: float) -> Step:
            solver, status, dtime, det = solve_model(gm.model, limit_s, cp)
            dtime += build_charge(gm.x, cp.tuning)
            if status not in ("OPTIMAL", "FEASIBLE"):
                return Step(None, dtime, det, status == "INFEASIBLE")
            return Step([gm.group[j] for j in chosen(solver, gm.x)], dtime, det,
                        status == "OPTIMAL")

        # The group model is hinted with the current placement, a solution of it: CP-SAT
        # 9.10 aborts the process when its interleaved search is hinted on a model it then
        # proves infeasible.
        blocks, n = self.blocks, self.n
        ranks, spent, det = descend(blocks, state.ranks, n, token_cap=self.tokens_cap,
                                    work_cap=self.work_cap, budget=until - state.spent,
                                    step_limit=step_limit, solve=solve,
                                    deadline=cp.deadline)
        ranks = canonical_ranks(blocks, ranks, n)
        value = max(placement_values(blocks, ranks, n)[2])
        state = state._replace(spent=state.spent + spent,
                               deterministic=state.deterministic and det)
        return state._replace(ranks=ranks, value=value, found=True) if value < state.value else state

    def ends_bound(self, stop_at: int, budget: float) -> tuple[int, float, bool]:
        """``ends.ends_bound`` on the longest doc, stopping at the incumbent value
        ``stop_at``, within ``budget`` deterministic seconds: the bound, the time spent
        and whether the deadline left it alone."""
        tuning = self.cp.tuning
        # The LPs' and the leaves' time as ``ends`` counts them.
        leaves = (1 - tuning.ends_lp_share) * budget
        run = ends_bound(self.longest_doc, self.others, self.n, token_cap=self.tokens_cap,
                         work_cap=self.work_cap,
                         token_floor=token_floor(sum(self.doc_lengths), self.n, self.tokens_cap),
                         lp_budget_s=tuning.ends_lp_share * budget, stop_at=stop_at,
                         leaf_limit_s=tuning.ends_leaf_share * leaves, leaf_budget_s=leaves,
                         deadline=self.cp.deadline)
        return run.bound, run.lp_seconds + run.leaf_seconds, run.deterministic
