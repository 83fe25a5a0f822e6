"""How the ILP's comm search divides its budget, and its wall-clock deadline.

Every share is a fraction of the request's deterministic budget (``dtime_per_s`` x
``time_limit_s``), so the same request runs the same steps for the same deterministic
time and gives the same plan. The steps themselves are described in :mod:`.search`; how well a choice of
shares closes the gap is measured by ``python -m bench.ilp_compare`` (results in
``bench/results/``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True, kw_only=True, slots=True)
class Tuning:
    """The ILP search's budget split and guards (``TUNING`` is the one the strategy uses)."""

    dtime_per_s: float = 0.03
    """Deterministic seconds of search per second of ``time_limit_s``: the search's whole
    budget is ``dtime_per_s * time_limit_s`` deterministic seconds (CP-SAT's, plus
    ``build_charge``), the same on every machine, so the same request gives the same
    plan. On a 2-core host this model runs about 0.25 deterministic seconds per wall
    second quiet, 0.08 at load 9 and 0.04 at load 13 with two CPU hogs beside it: at that
    last rate this budget is spent in three quarters of the limit
    (``python -m bench.ilp_repro``, bench/results/ilp_repro.md)."""
    build_charge: float = 5e-5
    """Deterministic seconds charged per placement boolean of every model the search
    builds and solves (the full model, a rank group's): the Python time of building it,
    which CP-SAT's deterministic time does not count, so the budget bounds the whole
    search and its steps, not only CP-SAT's (about 25 ms per 100 booleans at 0.25
    deterministic seconds per wall second)."""
    wall_margin_s: float = 0.25
    """The wall-clock deadline of the search is ``time_limit_s`` minus this (at most a
    quarter of the limit) after it starts: the rest is for building the plan, so the whole
    solve ends within ``time_limit_s`` plus the plan's build. A CP-SAT call still running
    at the deadline is stopped, and the plan says ``"deterministic": false``."""
    group_share: float = 0.4
    """Where the longest doc does not fit on a rank: the rank-group steps from the hint
    run until this share of the limit is spent, to give the bound a good incumbent."""
    relax_share: float = 0.4
    """The most of the limit the bound (the ends' branch and bound, then the relaxation)
    may take when the rank-group steps come first."""
    fill_relax_share: float = 0.55
    """``relax_share`` where the bound comes first and the fill question follows (the
    longest doc fits on a rank): there the relaxation is usually solved, and a tight bound
    is what the fill question asks against."""
    ends_share: float = 0.25
    """The most of the limit the bound of :mod:`.ends` (branching on the longest doc's
    ends) may take, out of the bound's share."""
    ends_lp_share: float = 0.5
    """The share of the ends' budget its LPs may take; the rest goes to its leaves."""
    ends_leaf_share: float = 0.1
    """The most of the leaves' budget any one leaf's CP-SAT solve may take, so that one
    hard leaf cannot starve the others."""
    zero_share: float = 0.15
    """The most of the limit the question "can every doc stay whole?" may take: cheap,
    and a YES ends the search at KV 0."""
    fill_share: float = 0.2
    """The least share of the limit the fill question of :mod:`.fill` (a placement within
    ``fill_gap`` of the bound) gets."""
    fill_until: float = 0.7
    """The fill question may run until this share of the limit is spent (from where the
    bound left it, and at least ``fill_share``): where it finds a placement it usually
    needs longer than the bound before it, and where it finds none the rank-group steps
    after it need what is left."""
    fill_gap: Fraction = Fraction(1, 100)
    """The relative gap the fill question asks for: the acceptance target of the ILP
    (exact, a fraction, so the asked value is an integer computed without rounding)."""
    search_share: float = 0.8
    """The rank-group steps resume after the bound until this share of the limit is spent;
    the full model's optimisation (CP-SAT's LNS) gets the rest but ``bisect_share``."""
    close_gap: Fraction = Fraction(1, 10)
    """Where the bound is within this relative gap of the incumbent after the bound's
    step, the search asks whether any placement is below the incumbent before anything
    else (:func:`.search.solve_comm`): on small instances the cheapest proof of
    optimality."""
    small_bools: int = 400
    """A model of at most this many placement booleans (blocks x ranks) is *small*: its
    closing minimisation (``search.close``) runs without cut rounds
    (``cpsat.SMALL_CUT_LEVEL``), is asked where the gap is above ``close_gap`` too if
    the longest doc fits on a rank, and again after the second rank-group steps, which
    take at most ``small_group_share``; its bound is the relaxation's of positions alone,
    without the ends' branch and bound (:func:`.search.solve_comm`): CP-SAT settles such
    a model outright more often than the steps around it narrow the gap (4 docs of 7K
    tokens: N = 2, 52 blocks, proven in 0.009 deterministic seconds; N = 4, 60 blocks, in
    0.281 of the default limit's 0.3)."""
    small_close_share: float = 0.1
    """The most of the limit the closing minimisation of a small model may take where the
    gap is above ``close_gap`` (so that where it does not settle the model, the
    rank-group steps after it still run)."""
    small_group_share: float = 0.1
    """The most of the limit the rank-group steps after the bound may take on a small
    model, so that the closing minimisation after them (where the gap is then at most
    ``close_gap``) gets the rest: on 4 docs of 7K tokens at N = 4 the steps reach the
    optimum 1634 within 0.031 deterministic seconds; run on to ``search_share``, they left
    its proof 0.056 of the 0.1 it needs at the default limit (any share from 0.08 to 0.2
    proves it there)."""
    bisect_share: float = 0.1
    """The share of the limit left to the closing yes/no questions, which raise the bound
    where the optimisation cannot."""
    probe_share: float = 0.06
    """The most of the limit any one yes/no question may take, so that one undecided
    question leaves time for the next."""
    group_step_share: float = 0.01
    """The first limit of one rank-group step (:func:`.lns.descend` doubles it when
    stuck)."""
    max_undecided: int = 2
    """The yes/no questions stop after this many undecided ones in a row."""


TUNING = Tuning()
"""The tuning every ILP solve uses (a solve takes another only where a caller passes one)."""
