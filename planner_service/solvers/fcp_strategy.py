"""Strategy ``fcp`` for one packed sequence: every document is an FCP sequence.

FCP schedules a batch of sequences onto CP groups of any degree. A packed sequence on
``cp_size`` ranks is such a batch once each document is taken as one sequence (documents
never attend across their boundary, so nothing ties two of them to one group): FCP
then splits the ranks into groups, long documents on many ranks, short ones on few, with
no KV exchange for documents that end up alone on one rank. The plan has one group per
CP group, each with the intra-group shards of ``intra`` (flashcp by default).

Options: ``memory_tokens`` (E; default twice the even share ``2 ceil(S / N)``, room for
groups of unequal load), ``intra``, ``profile`` and ``search`` (see planner_service.fcp).
Always one micro-batch: the plan covers the whole packed sequence.

With ``max_kv_tokens_per_rank`` (``solvers.kv_bound``) every group's intra plan is held
to the bound in the plan's exchange (``group_layouts``), and the plan is the first of
these candidates whose groups all hold it (``kv_bound.first_within``):

1. ``fcp``: FCP's grouping at the request's E (the plan without a bound, when its groups
   hold it unchanged);
2. ``fcp memory_tokens=<T>``: FCP's grouping at E = T = ceil(S / N), the even share, if
   below the request's E: no group holds more than T tokens per rank, so groups get more
   ranks for their tokens (a degree-one group's peak is all its tokens);
3. ``fcp one-group``: one group of all N ranks, i.e. the intra strategy's plan of the
   whole sequence (flashcp's candidates, down to its ``memory_first`` layout).

A candidate's figure is the largest of its groups' (the least bound all its groups meet),
and the refusal names the least figure over the three: FCP meets every bound from it on.
Cost: at most three FCP schedules (one for 3.) and the intra solves of their groups.

The intra-group strategy is looked up by name with the ``lookup`` the caller passes (the
registry's ``get_strategy``), so this module does not import the registry that lists it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple, Protocol

from planner_service.core.build import GroupLayout, Layout
from planner_service.core.errors import FieldError
from planner_service.core.mask import CAUSAL, AttentionMask
from planner_service.core.model import ModelSpec
from planner_service.core.plan import Shard
from planner_service.core.request import MAX_TOKENS, PlanRequest, check_int
from planner_service.core.step_time import held_kv_mode
from planner_service.fcp.cost_model import DEFAULT_PROFILE, get_profile
from planner_service.fcp.grouping import check_options, group_table, memory_error
from planner_service.fcp.placement import place_groups
from planner_service.fcp.schedule import plan_global_batch, sequence_stats
from planner_service.solvers.balance import declared, missed
from planner_service.solvers.flashcp_masked import redeclared
from planner_service.solvers.group_plans import solve_groups
from planner_service.solvers.kv_bound import (
    Candidate,
    KvBoundError,
    first_within,
    kv_floor,
    listed,
)

OPTIONS = {
    "memory_tokens": "E, tokens one rank can hold (default 2 x ceil(total / cp_size))",
    "intra": "intra-group strategy (default flashcp; zigzag is the FCP paper's ring layout)",
    "profile": f"FCP cost profile name or file:PATH (default {DEFAULT_PROFILE})",
    "search": "portfolio (default) or paper: the stage-1 groupings tried",
}


HOW = "the least over its candidate groupings of the largest KV figure of their groups"
"""``KvBoundError.how`` of ``fcp`` (module docstring)."""


class Intra(Protocol):
    """What FCP needs of an intra-group strategy (the registry's ``Strategy`` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def solver(self) -> Callable[[Sequence[int], PlanRequest], Layout]: ...
    @property
    def comm_mode(self) -> str: ...


def fcp_layout(doc_lengths: Sequence[int], request: PlanRequest, *,
               lookup: Callable[[str], Intra]) -> Layout:
    """FCP over the docs of one packed sequence (module docstring).

    Raises FieldError naming the option for bad options, or saying how much memory is
    missing when ``memory_tokens * cp_size`` cannot hold the sequence.
    """
    n = request.cp_size
    total = sum(doc_lengths)
    opts = request.options
    memory = opts.get("memory_tokens", 2 * -(-total // n))
    check_int(memory, "options.memory_tokens", 1, MAX_TOKENS)
    if total > n * memory:  # one micro-batch: the whole sequence on N ranks of E tokens
        raise memory_error(total, n, memory, "options.memory_tokens: the packed sequence",
                           "options.memory_tokens")
    intra = opts.get("intra", "flashcp")
    if intra == "fcp" or not isinstance(intra, str):
        raise FieldError("options.intra", f"options.intra must be a strategy other than fcp, "
                         f"got {intra!r}")
    try:
        profile = get_profile(opts.get("profile", DEFAULT_PROFILE))
    except ValueError as exc:
        raise FieldError("options.profile", f"options.profile: {exc}") from None
    try:
        strategy = lookup(intra)
    except ValueError as exc:
        raise FieldError("options.intra", f"options.intra: {exc}") from None
    search = opts.get("search", "portfolio")
    check_options(search, "dp", prefix="options.")
    sequences = [(length,) for length in doc_lengths]
    # The plan's exchange, which a KV bound is measured in (unused without one).
    mode = None if request.max_kv_tokens_per_rank is None else (
        request.comm_mode or lookup("fcp").comm_mode)

    def grouped(memory_tokens: int) -> Layout:
        found = plan_global_batch(
            sequences, num_ranks=n, memory_tokens=memory_tokens, profile=profile,
            search=search, micro_batches=1, mask=request.mask,
        )
        grouping = found.groupings[0]
        return _layout(grouping.groups, grouping.degrees, grouping.makespan_ms,
                       grouping.candidate, memory_tokens)

    def _layout(groups: Sequence[Sequence[int]], degrees: Sequence[int], makespan_ms: float,
                candidate: str, memory_tokens: int) -> Layout:
        starts = place_groups(degrees, n, profile.ranks_per_node)
        plans = group_layouts(
            sequences, groups, starts, degrees, intra=strategy,
            model=request.model, kernel=request.kernel, link=request.link,
            imbalance_target=request.imbalance_target,
            max_kv_tokens_per_rank=request.max_kv_tokens_per_rank, comm_mode=mode,
            mask=request.mask,
        )
        return weighed(Layout(groups=plans.layouts, info=declared({
            "fcp_degrees": list(degrees),
            "fcp_group_docs": [list(g) for g in groups],
            "fcp_est_makespan_ms": makespan_ms,
            "fcp_candidate": candidate,
            "fcp_profile": profile.name,
            "intra_strategy": intra,
            "memory_tokens": memory_tokens,
        }, plans.missed, request.imbalance_target)))

    def one_group() -> Layout:
        every = list(range(len(sequences)))
        table = group_table(sequence_stats(sequences, (), profile, request.mask), [every], n,
                            total, profile)
        return _layout([every], [n], float(table[0, n]), "one-group", memory)

    def weighed(layout: Layout) -> Layout:
        # Under a mask the groups' balance is declared from the layer-weighted work.
        return layout if request.mask.is_causal else redeclared(listed(layout), request)

    bound = request.max_kv_tokens_per_rank
    if bound is None or mode is None:
        return grouped(memory)
    even = -(-total // n)
    candidates = [Candidate("fcp", lambda: grouped(memory))]
    if even < memory:
        candidates.append(Candidate(f"fcp memory_tokens={even}", lambda: grouped(even)))
    candidates.append(Candidate("fcp one-group", one_group))
    return first_within(candidates, bound=bound, comm_mode=held_kv_mode(request.kernel, mode),
                        doc_lengths=doc_lengths,
                        num_ranks=n, how=HOW).layout


class GroupPlans(NamedTuple):
    """The groups' layouts and what their intra plans declare."""

    layouts: list[GroupLayout]
    """In plan doc indices and global ranks, in rank order."""
    missed: list[float]
    """The imbalance of every group whose intra plan declares it missed R
    (``balance.missed``), in group order."""


def group_layouts(
    sequences: Sequence[Sequence[int]],
    groups: Sequence[Sequence[int]],
    starts: Sequence[int],
    degrees: Sequence[int],
    *,
    intra: Intra,
    model: ModelSpec,
    kernel: str,
    link: str,
    imbalance_target: float,
    max_kv_tokens_per_rank: int | None = None,
    comm_mode: str | None = None,
    workers: int | None = None,
    mask: AttentionMask = CAUSAL,
) -> GroupPlans:
    """Each group's shards from the ``intra`` strategy's solver, in plan doc indices and
    global ranks, and the imbalances of the groups that declare R missed.

    Plan doc indices number all docs of ``sequences`` in order; ``groups`` index into
    ``sequences``. Returned in rank order.

    With ``max_kv_tokens_per_rank``, every group is held to it in ``comm_mode`` (the plan's
    exchange, which the intra solver is then asked for): the intra solver meets it or
    raises ``KvBoundError``, and a layout over it (a strategy whose plan does not depend on
    the bound) counts as that strategy's refusal, its peak the figure. Every group is
    solved; if any refuses, raises ``KvBoundError`` naming the largest figure among the
    refusals: the least bound every group meets, the groups that met this bound meeting
    any larger one (their strategies meet every bound from their own figure on).

    ``mask``: every group's request carries it (the intra strategy plans for it).

    The groups are solved by ``group_plans.solve_groups``, on ``workers`` processes (None:
    as many as pay off); the result does not depend on it.
    """
    bound = max_kv_tokens_per_rank
    first_doc = [0]
    for seq in sequences:
        first_doc.append(first_doc[-1] + len(seq))
    requests, global_docs = [], []
    for members, degree in zip(groups, degrees, strict=True):
        global_docs.append([first_doc[s] + t for s in members for t in range(len(sequences[s]))])
        request = PlanRequest(
            doc_lengths=tuple(length for s in members for length in sequences[s]),
            cp_size=degree, strategy=intra.name, model=model, kernel=kernel, link=link,
            imbalance_target=imbalance_target, mask=mask,
        )
        if bound is not None:
            request = replace(request, max_kv_tokens_per_rank=bound, comm_mode=comm_mode)
        requests.append(request)
    layouts = []
    reached: list[float] = []
    refused: list[KvBoundError] = []
    for solved, global_doc, start in zip(solve_groups(intra.solver, requests, comm_mode, workers),
                                         global_docs, starts, strict=True):
        if isinstance(solved, KvBoundError):
            refused.append(solved)
            continue
        group_reached = missed(solved.info)
        if group_reached is not None:
            reached.append(group_reached)
        for sub in solved.groups:
            layouts.append(GroupLayout(
                ranks=tuple(start + r for r in sub.ranks),
                shards=[
                    [Shard(global_doc[s.doc], s.start, s.end) for s in rank] for rank in sub.shards
                ],
            ))
    if refused:
        assert bound is not None and comm_mode is not None
        worst = max(refused, key=lambda exc: exc.least)
        raise KvBoundError(bound, worst.least, f"its largest group figure: {worst.how}",
                           kv_floor([x for seq in sequences for x in seq], sum(degrees),
                                    held_kv_mode(kernel, comm_mode)))
    layouts.sort(key=lambda g: g.ranks[0])
    return GroupPlans(layouts, reached)
