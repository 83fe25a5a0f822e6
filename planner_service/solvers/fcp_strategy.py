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

The intra-group strategy is looked up by name with the ``lookup`` the caller passes (the
registry's ``get_strategy``), so this module does not import the registry that lists it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from planner_service.core.build import GroupLayout, Layout
from planner_service.core.errors import FieldError
from planner_service.core.model import ModelSpec
from planner_service.core.plan import Shard
from planner_service.core.request import MAX_TOKENS, PlanRequest, check_int
from planner_service.fcp.cost_model import DEFAULT_PROFILE, get_profile
from planner_service.fcp.grouping import check_options, memory_error
from planner_service.fcp.placement import place_groups
from planner_service.fcp.schedule import plan_global_batch

OPTIONS = {
    "memory_tokens": "E, tokens one rank can hold (default 2 x ceil(total / cp_size))",
    "intra": "intra-group strategy (default flashcp; zigzag is the FCP paper's ring layout)",
    "profile": f"FCP cost profile name or file:PATH (default {DEFAULT_PROFILE})",
    "search": "portfolio (default) or paper: the stage-1 groupings tried",
}


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
    found = plan_global_batch(
        sequences, num_ranks=n, memory_tokens=memory, profile=profile, search=search,
        micro_batches=1,
    )
    grouping = found.groupings[0]
    starts = place_groups(grouping.degrees, n, profile.ranks_per_node)
    layouts = group_layouts(
        sequences, grouping.groups, starts, grouping.degrees, intra=strategy,
        model=request.model, kernel=request.kernel, link=request.link,
        imbalance_target=request.imbalance_target,
    )
    return Layout(groups=layouts, info={
        "fcp_degrees": list(grouping.degrees),
        "fcp_group_docs": [list(g) for g in grouping.groups],
        "fcp_est_makespan_ms": grouping.makespan_ms,
        "fcp_candidate": grouping.candidate,
        "fcp_profile": profile.name,
        "intra_strategy": intra,
        "memory_tokens": memory,
    })


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
) -> list[GroupLayout]:
    """Each group's shards from the ``intra`` strategy's solver, in plan doc indices and
    global ranks.

    Plan doc indices number all docs of ``sequences`` in order; ``groups`` index into
    ``sequences``. Returned in rank order.
    """
    first_doc = [0]
    for seq in sequences:
        first_doc.append(first_doc[-1] + len(seq))
    layouts = []
    for members, start, degree in zip(groups, starts, degrees, strict=True):
        global_doc = [first_doc[s] + t for s in members for t in range(len(sequences[s]))]
        request = PlanRequest(
            doc_lengths=tuple(length for s in members for length in sequences[s]),
            cp_size=degree, strategy=intra.name, model=model, kernel=kernel, link=link,
            imbalance_target=imbalance_target,
        )
        for sub in intra.solver(request.doc_lengths, request).groups:
            layouts.append(GroupLayout(
                ranks=tuple(start + r for r in sub.ranks),
                shards=[
                    [Shard(global_doc[s.doc], s.start, s.end) for s in rank] for rank in sub.shards
                ],
            ))
    layouts.sort(key=lambda g: g.ranks[0])
    return layouts
