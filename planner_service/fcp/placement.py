"""From a micro-batch's group degrees to rank ranges.

Each group gets a contiguous rank range; groups that fit in one node are kept inside a
node when possible (the cost model gave them intra-node bandwidth). The groups' shards
come from another strategy: ``planner_service.solvers.fcp_strategy.group_layouts``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


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
