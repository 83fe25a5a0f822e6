"""The contiguous halo baseline (solvers/contiguous_halo.py): valid plans at every size,
equal-token contiguous ranges, and an exchange of halos only under a window."""

import itertools

import pytest

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.request import debug_request
from planner_service.core.validate import validate_plan
from planner_service.solvers.contiguous_halo import contiguous_halo_layout
from planner_service.solvers.registry import solve

DEBUG = debug_request().doc_lengths


EVERY_SIZE = range(1, 1025)
SOME_SIZES = (1, 2, 3, 7, 64, 999, 1023, 1024)


@pytest.mark.parametrize("lengths,sizes", [
    (DEBUG, EVERY_SIZE), ((131072,), SOME_SIZES), ((1,) * 3000, SOME_SIZES), ((3,), EVERY_SIZE),
    ((1, 1), SOME_SIZES)], ids=["debug", "one-doc", "one-token-docs", "3-tokens", "2-tokens"])
def test_ranges_are_contiguous_and_equal_for_every_cp_size(lengths, sizes):
    total = sum(lengths)
    offsets = list(itertools.accumulate(lengths, initial=0))
    for n in sizes:
        layout = contiguous_halo_layout(lengths, debug_request(doc_lengths=lengths, cp_size=n,
                                                               context_length=None))
        (group,) = layout.groups
        assert group.ranks == tuple(range(n))
        sizes = [sum(s.end - s.start for s in rank) for rank in group.shards]
        assert set(sizes) <= {total // n, -(-total // n)} and sum(sizes) == total
        # Rank by rank, shard by shard, the packed sequence in order.
        position = 0
        for shard in itertools.chain.from_iterable(group.shards):
            assert offsets[shard.doc] + shard.start == position and shard.end > shard.start
            position = offsets[shard.doc] + shard.end
        assert position == total


@pytest.mark.parametrize("lengths,context", [
    (DEBUG, 32768), ((131072,), 131072), ((1,) * 4000, 4096), ((3,), 8), ((1, 1), None)],
    ids=["debug", "one-doc-filling-the-context", "one-token-docs", "3-tokens", "2-tokens"])
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 5, 7, 8, 16, 100, 257, 1000, 1024])
def test_plans_are_valid(lengths, context, cp_size):
    request = debug_request(doc_lengths=lengths, cp_size=cp_size, context_length=context,
                            strategy="contiguous_halo")
    plan = solve(request)  # the registry validates every plan it returns
    validate_plan(plan)
    assert plan.comm_mode == "alltoallv"
    assert solve(request).plan_id == plan.plan_id


@pytest.mark.parametrize("window", [1, 7, 128, 4096])
def test_a_long_doc_moves_only_the_halo_under_a_window(window):
    lengths = (100_000, 17, 5000)
    n = 8
    layout = contiguous_halo_layout(lengths, debug_request(doc_lengths=lengths, cp_size=n,
                                                           context_length=None))
    shards = layout.groups[0].shards
    arrays = cost.shard_arrays(shards)
    volumes = ww.window_comm_volumes_of(arrays, window)
    # Each rank's first shard continues the previous rank's: its halo is all it receives.
    expected = tuple(min(window - 1, rank[0].start) for rank in shards)
    assert volumes.alltoallv_recv == expected
    assert ww.ring_schedule_of(arrays, window).steps_run == (1 if window > 1 else 0)
    assert max(volumes.alltoallv_recv) < max(cost.comm_volumes(shards).alltoallv_recv)
