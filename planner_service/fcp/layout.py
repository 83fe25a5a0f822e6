"""From a micro-batch's groups and degrees to rank ranges and a validated Plan.

Each group gets a contiguous rank range; groups that fit in one node are kept inside a
node when possible (the cost model gave them intra-node bandwidth). Each group's shards
come from an ordinary strategy's solver (flashcp by default) run on the group's docs,
with doc indices and ranks mapped into the micro-batch plan.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from planner_service.core.build import GroupLayout, Layout, build_plan
from planner_service.core.model import ModelSpec
from planner_service.core.plan import Plan, Shard
from planner_service.core.request import PlanRequest
from planner_service.core.validate import validate_plan
from planner_service.solvers.registry import get_strategy


def place_groups(degrees: Sequence[int], num_ranks: int, ranks_per_node: int) -> list[int]:
    """First rank of each group: contiguous ranges, disjoint, inside [0, num_ranks).

    Groups larger than a node go first from rank 0; the others go best-fit into the free
    tail of a node, so that they do not straddle a node boundary. If that leaves no room
    for some group (fragmented tails), all groups are packed left to right instead.
    """
    assert sum(degrees) <= num_ranks, "degrees exceed the ranks"
    order = sorted(range(len(degrees)), key=lambda g: (-degrees[g], g))
    starts = [0] * len(degrees)
    cursor = 0
    for g in order:
        if degrees[g] > ranks_per_node:
            starts[g] = cursor
            cursor += degrees[g]
    # Free segments (room, start) of every node from the cursor on.
    segments: list[tuple[int, int]] = []
    pos = cursor
    while pos < num_ranks:
        end = min(num_ranks, (pos // ranks_per_node + 1) * ranks_per_node)
        segments.append((end - pos, pos))
        pos = end
    segments.sort()
    for g in order:
        d = degrees[g]
        if d > ranks_per_node:
            continue
        at = bisect.bisect_left(segments, (d, -1))
        if at == len(segments):
            return _left_to_right(degrees, order)
        room, start = segments.pop(at)
        starts[g] = start
        if room > d:
            bisect.insort(segments, (room - d, start + d))
    return starts


def _left_to_right(degrees: Sequence[int], order: Sequence[int]) -> list[int]:
    starts = [0] * len(degrees)
    cursor = 0
    for g in order:
        starts[g] = cursor
        cursor += degrees[g]
    return starts


def group_layouts(
    sequences: Sequence[Sequence[int]],
    groups: Sequence[Sequence[int]],
    starts: Sequence[int],
    degrees: Sequence[int],
    *,
    strategy: str,
    model: ModelSpec,
    kernel: str,
    link: str,
    imbalance_target: float,
) -> list[GroupLayout]:
    """Each group's shards from ``strategy``'s solver, in plan doc indices and global ranks.

    Plan doc indices number all docs of ``sequences`` in order; ``groups`` index into
    ``sequences``. Returned in rank order.
    """
    intra = get_strategy(strategy)
    first_doc = [0]
    for seq in sequences:
        first_doc.append(first_doc[-1] + len(seq))
    layouts = []
    for members, start, degree in zip(groups, starts, degrees, strict=True):
        global_doc = [first_doc[s] + t for s in members for t in range(len(sequences[s]))]
        request = PlanRequest(
            doc_lengths=tuple(length for s in members for length in sequences[s]),
            cp_size=degree, strategy=strategy, model=model, kernel=kernel, link=link,
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


def micro_batch_plan(
    sequences: Sequence[Sequence[int]],
    groups: Sequence[Sequence[int]],
    starts: Sequence[int],
    degrees: Sequence[int],
    *,
    num_ranks: int,
    strategy: str,
    model: ModelSpec,
    kernel: str,
    link: str,
    imbalance_target: float,
    info: dict[str, Any],
) -> Plan:
    """The validated plan of one micro-batch; PlanError only on an internal bug.

    ``sequences`` are this micro-batch's sequences (doc lengths) in plan order and
    ``groups`` index into them. The plan's doc_lengths are all their docs in that order;
    ``info["sequences"]`` records ``[first_doc, num_docs]`` of each.
    """
    layouts = group_layouts(
        sequences, groups, starts, degrees, strategy=strategy, model=model, kernel=kernel,
        link=link, imbalance_target=imbalance_target,
    )
    first_doc = 0
    spans = []
    for seq in sequences:
        spans.append([first_doc, len(seq)])
        first_doc += len(seq)
    plan = build_plan(
        Layout(groups=layouts, info={**info, "sequences": spans}),
        strategy="fcp",
        cp_size=num_ranks,
        doc_lengths=[length for seq in sequences for length in seq],
        context_length=None,
        comm_mode=get_strategy(strategy).comm_mode,
        model=model,
        kernel=kernel,
        link=link,
    )
    validate_plan(plan)
    return plan
