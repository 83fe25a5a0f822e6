"""flashcp: the balanced pass, the token-neutral exchange and Algorithm 1's fallback."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner_service.core.cost import comm_volumes, imbalance, rank_workloads
from planner_service.core.plan import Shard
from planner_service.core.request import debug_request
from planner_service.core.validate import validate_plan
from planner_service.data import make_source, pack_sequences
from planner_service.solvers.flashcp import flashcp_shards, refine
from planner_service.solvers.flashcp.paper import algorithm1
from planner_service.solvers.flashcp.ranks import Ranks, zigzag
from planner_service.solvers.registry import solve


def tokens(shards):
    return [sum(s.end - s.start for s in rank) for rank in shards]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    doc_lengths=st.lists(st.integers(1, 20000), min_size=1, max_size=40),
    cp_size=st.integers(1, 8),
    target=st.sampled_from([1.0, 1.02, 1.05, 1.2]),
)
def test_any_request_gives_a_valid_plan_with_minimal_padding(doc_lengths, cp_size, target):
    request = debug_request(doc_lengths=tuple(doc_lengths), cp_size=cp_size, context_length=None,
                            imbalance_target=target)
    plan = solve(request)  # validates
    total = sum(doc_lengths)
    assert plan.metrics.tokens_per_rank == -(-total // cp_size)


@pytest.mark.parametrize(("dataset", "n"), [("wlbllm", 4), ("code", 8), ("family:pile", 4)])
def test_meets_r_on_packed_128k_batches(dataset, n):
    sequences = pack_sequences(make_source(dataset), context_length=131072, num_sequences=30, seed=1)
    worst = max(imbalance(rank_workloads(flashcp_shards(seq, n, 1.05)[0])) for seq in sequences)
    assert worst <= 1.05


def test_zigzags_heavy_docs_over_fewer_ranks_than_all():
    # Algorithm 1 cuts every Per-Doc doc over all N ranks; the balanced pass uses only as
    # many ranks as balance needs, and each of them needs less of the doc's prefix.
    widths = []
    for seq in pack_sequences(make_source("code"), context_length=131072, num_sequences=30, seed=3):
        shards, zigzagged = flashcp_shards(seq, 8, 1.05)
        for doc in zigzagged:
            widths.append(sum(any(s.doc == doc for s in rank) for rank in shards))
    assert widths and min(widths) < 8


def test_beats_algorithm1_comm_on_the_debug_request():
    request = debug_request()
    ours = solve(request)
    _, paper, _ = algorithm1(request.doc_lengths, 4, 1.05)
    assert ours.metrics.imbalance <= 1.05
    assert ours.metrics.alltoallv_tokens < max(comm_volumes(paper.shards).alltoallv_recv)


def test_exchange_moves_work_without_moving_tokens():
    # Rank 0: doc 0 [0, 16) + doc 1 [0, 4) = 146 pairs; rank 1: docs 2, 3 of 10 = 110 pairs.
    ranks = Ranks(2, 20)
    ranks.add(0, 0, 0, 16)
    ranks.add(0, 1, 0, 4)
    ranks.add(1, 2, 0, 10)
    ranks.add(1, 3, 0, 10)
    allowed = 1.05 * 256 / 2
    refine.exchange(ranks, allowed)
    assert tokens(ranks.shards) == [20, 20]
    assert ranks.work == rank_workloads(ranks.shards)
    assert max(ranks.work) <= allowed
    # Moving doc 0's last token [15, 16) for doc 2's first would balance too, but rank 1
    # would then need doc 0's prefix up to 15: 16 KV tokens in all. The fold gives it a
    # middle stretch [5, 8) of doc 0 for doc 2's first three tokens instead: it needs
    # [0, 5) of doc 0 and [0, 3) of doc 2, and rank 0 needs [5, 8) back.
    assert sorted((s.doc, s.start, s.end) for s in ranks.shards[1]) == [(0, 5, 8), (2, 3, 10), (3, 0, 10)]
    assert comm_volumes(ranks.shards).alltoallv_recv == (3, 8)


def position(intervals, k, top):
    """The k-th highest or lowest position, the slow way."""
    points = sorted(p for a, b in intervals for p in range(a, b))
    return points[-k] if top else points[k - 1]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.data())
def test_descend_keeps_tokens_and_positions_and_lowers_the_receive(data):
    """Random layouts (2 to 4 ranks, up to 6 docs of up to 80 tokens, each cut into up to
    4 pieces dealt to ranks): ``refine.descend`` keeps every rank's token count and every
    position exactly once, keeps each rank's workload within ``allowed`` (and its
    bookkeeping equal to the recomputed workload), and returns the critical receive
    ``comm_volumes`` reports on the result, never above the one before."""
    from planner_service.core.cost import shard_workload

    n = data.draw(st.integers(2, 4))
    lengths = data.draw(st.lists(st.integers(1, 80), min_size=1, max_size=6))
    ranks = Ranks(n, sum(lengths))
    for d, length in enumerate(lengths):
        cuts = sorted(data.draw(st.sets(st.integers(1, length - 1), max_size=3)) if length > 1 else [])
        for a, b in zip([0, *cuts], [*cuts, length], strict=True):
            ranks.add(data.draw(st.integers(0, n - 1)), d, a, b)
    allowed = max(ranks.work) * data.draw(st.sampled_from([1.0, 1.1, 1.5]))
    before_tokens = list(ranks.tokens)
    before = max(comm_volumes(ranks.shards).alltoallv_recv)
    result = refine.descend(ranks, allowed, 8)
    assert [sum(s.end - s.start for s in r) for r in ranks.shards] == before_tokens
    assert sorted((s.doc, p) for r in ranks.shards for s in r for p in range(s.start, s.end)) == sorted(
        (d, p) for d, length in enumerate(lengths) for p in range(length))
    work = [sum(shard_workload(s.start, s.end - s.start) for s in r) for r in ranks.shards]
    assert work == ranks.work and max(work) <= allowed
    assert result == max(comm_volumes(ranks.shards).alltoallv_recv) <= before


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 80), min_size=2, max_size=8, unique=True),
       st.lists(st.integers(0, 80), min_size=2, max_size=8, unique=True))
def test_crossing_equals_the_slow_reference(a, b):
    def intervals(points):
        points = sorted(points)[: len(points) // 2 * 2]
        return [(points[i], points[i + 1]) for i in range(0, len(points), 2)]

    mine, theirs = intervals(a), intervals(b)
    limit = min(sum(y - x for x, y in mine), sum(y - x for x, y in theirs))
    expected = 0
    for k in range(1, limit + 1):
        if position(mine, k, True) <= position(theirs, k, False):
            break
        expected = k
    assert refine.crossing(mine, theirs) == expected


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.data())
def test_fold_keeps_positions_and_lowers_the_receive_comm_volumes_reports(data):
    """Two ranks and three docs of up to 60 tokens: doc x (ends on rank 0's top stretch),
    doc y (its lowest positions on rank 1) and doc z (cut between them). Whatever ``refine.fold``
    returns must move the same positions as the top move it replaces, move work within
    [wanted, most], and give a larger receive below the top move's, both as comm_volumes
    computes them on the whole layout (the reference)."""
    from planner_service.core.cost import shard_workload

    lengths = [data.draw(st.integers(2, 60)) for _ in range(3)]
    x, y, z = 0, 1, 2
    cut = {d: sorted(data.draw(st.sets(st.integers(1, lengths[d] - 1), max_size=3))) for d in (x, y, z)}
    pieces = {d: list(zip([0, *cut[d]], [*cut[d], lengths[d]], strict=True)) for d in (x, y, z)}
    # Rank 0 holds x's last piece; rank 1 holds y's first piece; the rest are dealt.
    owner = {(d, i): data.draw(st.integers(0, 1)) for d in (x, y, z) for i in range(len(pieces[d]))}
    owner[x, len(pieces[x]) - 1], owner[y, 0] = 0, 1
    held = [{}, {}]
    for (d, i), r in owner.items():
        held[r].setdefault(d, []).append(pieces[d][i])
    held = [{d: refine.merged(iv) for d, iv in h.items()} for h in held]
    if x not in held[0] or y not in held[1]:
        return
    count = data.draw(st.integers(1, min(held[0][x][-1][1] - held[0][x][-1][0],
                                          sum(b - a for a, b in held[1][y]))))
    goal = data.draw(st.integers(1, 4000))
    most = data.draw(st.integers(goal, 8000))

    def layout(mine_x, given_x, their_y, given_y):
        ranks = [dict(held[0]), dict(held[1])]
        ranks[0][x], ranks[1][y] = mine_x, their_y
        ranks[1][x] = refine.merged(held[1].get(x, []) + given_x)
        ranks[0][y] = refine.merged(held[0].get(y, []) + given_y)
        return [[Shard(d, a, b) for d, iv in r.items() for a, b in iv] for r in ranks]

    mine_kept, mine_given = refine.take(held[0][x], count, True)
    their_kept, their_given = refine.take(held[1][y], count, False)
    top = layout(mine_kept, mine_given, their_kept, their_given)
    fold = refine.fold(held[0], held[1], x, y, goal, most, count)
    if fold is None:
        return
    folded = layout(*fold)
    for a, b in zip(top, folded, strict=True):  # same tokens per rank, same positions overall
        assert sum(s.end - s.start for s in a) == sum(s.end - s.start for s in b)
    assert sorted((d, p) for r in top for d, a, b in r for p in range(a, b)) == sorted(
        (d, p) for r in folded for d, a, b in r for p in range(a, b))
    work = lambda shards: sum(shard_workload(s.start, s.end - s.start) for s in shards)  # noqa: E731
    moved = work(folded[1]) - sum(work([Shard(d, a, b) for a, b in iv]) for d, iv in held[1].items())
    top_moved = work(top[1]) - sum(work([Shard(d, a, b) for a, b in iv]) for d, iv in held[1].items())
    assert min(goal, top_moved) <= moved <= most
    assert max(comm_volumes(folded).alltoallv_recv) < max(comm_volumes(top).alltoallv_recv)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 80), min_size=2, max_size=8, unique=True),
       st.lists(st.integers(0, 80), min_size=2, max_size=8, unique=True),
       st.integers(1, 3000))
def test_count_for_equals_the_slow_reference(a, b, goal):

    def intervals(points):
        points = sorted(points)[: len(points) // 2 * 2]
        return [(points[i], points[i + 1]) for i in range(0, len(points), 2)]

    mine, theirs = intervals(a), intervals(b)
    limit = refine.crossing(mine, theirs)
    if limit == 0:
        return
    # Pair k moves (my k-th highest + 1) - (their k-th lowest + 1): add pairs while within goal.
    expected, moved = 0, 0
    for k in range(1, limit + 1):
        moved += position(mine, k, True) - position(theirs, k, False)
        if moved > goal:
            break
        expected = k
    assert refine.count_for(mine, theirs, goal, limit) == max(1, expected)


def test_zigzag_gives_each_rank_two_chunks_of_equal_size():
    ranks = Ranks(3, 100)
    zigzag(ranks, [0, 1, 2], doc=0, length=61)
    assert tokens(ranks.shards) in ([20, 20, 21], [20, 21, 20], [21, 20, 20])
    assert all(len(rank) == 2 for rank in ranks.shards)
    assert max(ranks.work) - min(ranks.work) <= 61


def test_same_request_gives_the_same_plan():
    request = debug_request(doc_lengths=tuple(range(500, 9000, 700)), cp_size=8, context_length=None)
    assert solve(request).to_json() == solve(request).to_json()


def test_plans_validate_on_code_batches():
    for seq in pack_sequences(make_source("code"), context_length=131072, num_sequences=10, seed=2):
        validate_plan(solve(debug_request(doc_lengths=tuple(seq), cp_size=8, context_length=131072)))
