"""A per-rank bound on the KV a plan holds: ``PlanRequest.max_kv_tokens_per_rank``.

A rank's KV peak is its ``rank_stats.kv_tokens_peak`` (``cost.kv_tokens_peak``, what the
worker runtime's counter reports): in the gather modes its own tokens plus the distinct
remote KV it attends, i.e. per doc it holds the end of its last shard of that doc; in
``p2p_ring`` its own tokens plus ``min(d - 1, 2)`` blocks of the group's tokens per rank.
A plan meets the bound when every rank's peak is at most the bound.

Every strategy meets the bound or raises ``KvBoundError``, a one-line ValueError naming
the field, the smallest bound the strategy can meet for the request, and how that figure
was found:

- strategies whose plan does not depend on the bound (the baselines) are checked once
  their plan is built (``check_plan``, called by ``registry.solve`` for every strategy);
  the figure is their plan's peak;
- ``flashcp``, ``fcp`` and ``auto`` try a fixed, finite list of candidate layouts in
  order and return the first within the bound (``first_within``); the figure is the
  least peak over the list. The list does not depend on the bound, so such a strategy
  meets every bound at or above the figure and none below it: the figure is the least
  peak these candidates produce, not a proven minimum over all plans. ``ilp`` meets every
  bound from its figure on too, and may meet a smaller one where its bounded CP-SAT
  solve finds a placement in time (``ilp.bounded``).

Beside it the message gives ``kv_floor``, a true lower bound for any plan of any
strategy; when the two are equal the figure is the minimum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from planner_service.core.build import GroupLayout, Layout
from planner_service.core.cost import CommVolumes, alltoallv_receives, kv_tokens_peak
from planner_service.core.errors import FieldError
from planner_service.core.plan import Plan, Shard
from planner_service.core.step_time import held_kv_mode

FIELD = "max_kv_tokens_per_rank"
GATHER_MODES = ("full", "compact_allgather", "alltoallv")


class KvBoundError(FieldError):
    """The request's ``max_kv_tokens_per_rank`` is below what the strategy can meet.

    ``least``: the smallest bound the strategy meets for this request (see ``how``);
    ``floor``: a lower bound on the peak of any plan (``kv_floor``)."""

    def __init__(self, bound: int, least: int, how: str, floor: int) -> None:
        lower = ("and no plan can hold less" if least <= floor
                 else f"no plan can hold less than {floor}")
        super().__init__(FIELD, f"{FIELD}={bound} is below the smallest this strategy can meet for "
                         f"this request: {least} ({how}; {lower})")
        self.bound, self.least, self.how, self.floor = bound, least, how, floor

    def __reduce__(self) -> tuple[type[KvBoundError], tuple[int, int, str, int]]:
        # Raised in the service's worker processes and pickled back to the server.
        return type(self), (self.bound, self.least, self.how, self.floor)


FIXED = "its plan's KV peak, which does not depend on the bound"
"""``how`` of a strategy whose plan is the same whatever the bound."""
CANDIDATES = "the least KV peak of its candidate plans, docs/strategies.md"
"""``how`` of a strategy that tries a fixed list of candidates (``first_within``)."""


def kv_floor(doc_lengths: Sequence[int], num_ranks: int, comm_mode: str) -> int:
    """A lower bound on the largest KV peak of any plan of the docs on ``num_ranks`` ranks.

    Some rank holds at least ceil(S / N) tokens, and every rank's peak counts its own
    tokens. In a gather mode the rank holding a doc's last token keeps the doc's whole
    prefix: at least L. (In ``p2p_ring`` a one-group plan holds at least
    ``(1 + min(N - 1, 2)) ceil(S / N)``, but a plan of several groups may use degree-one
    groups, so only ceil(S / N) holds for every plan.) O(D)."""
    floor = -(-sum(doc_lengths) // num_ranks)
    if comm_mode in GATHER_MODES:
        floor = max(floor, max(doc_lengths, default=0))
    return floor


def group_peak(shards_per_rank: Sequence[Iterable[Shard]], comm_mode: str) -> int:
    """The largest ``cost.kv_tokens_peak`` of one group's ranks, as the plan builder will
    measure it (empty shards dropped, as its canonical form does). O(s)."""
    ranks = [[s for s in rank if s.end > s.start] for rank in shards_per_rank]
    if not ranks:
        return 0
    tokens = [sum(s.end - s.start for s in rank) for rank in ranks]
    recv = tuple(alltoallv_receives(ranks))
    volumes = CommVolumes(alltoallv_recv=recv, allgather_send=(0,) * len(ranks))
    return max(kv_tokens_peak(comm_mode, volumes, tokens, max(tokens)))


def listed(layout: Layout) -> Layout:
    """The layout with every rank's shards as a list (a solver may give iterators, which
    measuring would consume)."""
    return Layout([GroupLayout(tuple(g.ranks), [list(rank) for rank in g.shards])
                   for g in layout.groups], layout.info)


def layout_peak(layout: Layout, comm_mode: str) -> int:
    """The largest KV peak of a layout's ranks (its shards must be lists: ``listed``). O(s)."""
    return max((group_peak(g.shards, comm_mode) for g in layout.groups), default=0)


def plan_peak(plan: Plan) -> int:
    """The largest ``rank_stats.kv_tokens_peak`` of a plan. O(N)."""
    return max((max(g.rank_stats.kv_tokens_peak, default=0) for g in plan.groups), default=0)


def check_plan(plan: Plan, bound: int | None) -> None:
    """Raise ``KvBoundError`` (figure: the plan's own peak) if the plan is over ``bound``."""
    if bound is None:
        return
    peak = plan_peak(plan)
    if peak > bound:
        raise KvBoundError(bound, peak, FIXED,
                           kv_floor(plan.doc_lengths, plan.cp_size,
                                    held_kv_mode(plan.kernel, plan.comm_mode)))


class Candidate(NamedTuple):
    """One layout ``first_within`` may return."""

    name: str
    """Recorded as the plan's ``info.kv_candidate`` when chosen."""
    solve: Callable[[], Layout]
    """Makes the layout; may raise ``KvBoundError`` (a candidate made of parts that each
    hold the bound, e.g. FCP's groups): its ``least`` is then the candidate's figure."""


class Within(NamedTuple):
    """``first_within``'s answer."""

    layout: Layout
    """The chosen layout, shards as lists, ``kv_candidate`` added to its info."""
    peak: int


def first_within(candidates: Iterable[Candidate], *, bound: int, comm_mode: str,
                 doc_lengths: Sequence[int], num_ranks: int, how: str = CANDIDATES) -> Within:
    """The first candidate whose KV peak is at most ``bound``.

    Raises ``KvBoundError`` naming the least peak over all candidates if none is. Cost:
    the candidates' solves, stopping at the first within the bound, plus O(s) per layout
    measured."""
    least: int | None = None
    for candidate in candidates:
        try:
            layout = listed(candidate.solve())
        except KvBoundError as exc:
            least = exc.least if least is None else min(least, exc.least)
            continue
        peak = layout_peak(layout, comm_mode)
        if peak <= bound:
            return Within(Layout(layout.groups, {**layout.info, "kv_candidate": candidate.name}),
                          peak)
        least = peak if least is None else min(least, peak)
    assert least is not None, "first_within needs at least one candidate"
    raise KvBoundError(bound, least, how, kv_floor(doc_lengths, num_ranks, comm_mode))
