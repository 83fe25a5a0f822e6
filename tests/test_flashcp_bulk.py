"""flashcp's bulk pass (``solvers/flashcp/bulk.py``): the cut against its plain reference,
and valid meet-or-declare plans on many-document requests."""

from __future__ import annotations

import numpy as np
import pytest

from bench.scale import mixed_lengths
from planner_service.core.cost import imbalance
from planner_service.core.request import PlanRequest
from planner_service.solvers.flashcp import bulk
from planner_service.solvers.flashcp import place as place_module
from planner_service.solvers.flashcp import solve as flashcp_solve_module
from planner_service.solvers.flashcp.place import place
from planner_service.solvers.flashcp.ranks import Ranks
from planner_service.solvers.flashcp.solve import flashcp_layout
from planner_service.solvers.registry import solve


def _lengths(seed: int, docs: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(2.0, 1.0, docs).astype(np.int64)).tolist()


@pytest.mark.parametrize("seed", range(5))
def test_cut_matches_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 30, 200).astype(np.int64)
    docs = rng.permutation(200).astype(np.int64)
    n = 7
    cap = -(-int(lengths.sum()) // n) + 5
    fast, slow = Ranks(n, cap), Ranks(n, cap)
    intervals = bulk.stream_intervals(fast, lengths.tolist(), float(lengths.sum()))
    bulk.cut(fast, docs, lengths, intervals)
    bulk.cut_reference(slow, docs.tolist(), lengths.tolist(), intervals)
    assert [sorted(s) for s in fast.shards] == [sorted(s) for s in slow.shards]
    assert fast.tokens == slow.tokens and fast.work == slow.work
    assert sum(fast.tokens) == int(lengths.sum()) and max(fast.tokens) <= cap


@pytest.mark.parametrize(("seed", "n"), [(0, 8), (1, 8), (2, 16)])
def test_bulk_plans_valid_and_meet_or_declare(seed: int, n: int) -> None:
    seq = _lengths(seed, 5000)
    lengths = np.array(seq, dtype=np.int64)
    assert bulk.bulk_head(np.sort(lengths)[::-1], n) > 0
    _check_plan(seq, n)


def test_bulk_not_tried_on_few_docs() -> None:
    assert not bulk.bulk_head(np.full(4000, 5, dtype=np.int64), 8)
    assert not bulk.bulk_head(np.full(5000, 5, dtype=np.int64), 1024)
    assert not bulk.bulk_head(np.full(100000, 20, dtype=np.int64), 8)  # one equal run
    two = np.array([21] * 97152 + [20] * 2848, dtype=np.int64)
    assert not bulk.bulk_head(two, 1024)


@pytest.mark.parametrize("seed", range(12))
def test_sorted_union_equals_numpy_union(seed: int) -> None:
    """``bulk.sorted_union`` gives ``np.union1d``'s array (values and dtype): sorted runs
    as ``cut`` passes them, unsorted values with repeats, one side or both empty."""
    rng = np.random.default_rng(seed)
    size = int(rng.integers(0, 3000))
    starts = np.cumsum(rng.integers(1, 40, size), dtype=np.int64)
    picks = np.sort(rng.choice(max(1, size * 20), int(rng.integers(0, 200)))).astype(np.int64)
    loose = rng.integers(-5, 50, int(rng.integers(0, 100))).astype(np.int64)
    for a, b in ((starts, picks), (picks, starts), (loose, picks), (starts[:0], loose),
                 (starts[:0], starts[:0]), (starts, starts)):
        got, want = bulk.sorted_union(a, b), np.union1d(a, b)
        assert got.dtype == want.dtype and np.array_equal(got, want)


def _head_reference(lengths: list[int], n: int) -> int:
    """``bulk.bulk_head``'s rule in plain Python: lengths longest first."""
    d = len(lengths)
    if (n < 2 or d <= bulk.BULK_DOCS or d < bulk.BULK_PER_RANK * n
            or d <= bulk.HEAD_PER_RANK * n):
        return 0
    cap = -(-sum(lengths) // n)
    head = bulk.HEAD_PER_RANK * n
    while head < d and lengths[head] * bulk.BULK_ROOM > cap:
        head += 1
    if head > bulk.HEAD_PER_RANK * n and n < bulk.EXTEND_RANKS:
        return 0
    if head > bulk.HEAD_CAP * n or d - head < (bulk.BULK_PER_RANK - bulk.HEAD_PER_RANK) * n:
        return 0
    short = lengths[head:]
    if sum(a != b for a, b in zip(short[:-1], short[1:], strict=True)) < bulk.FEW_LENGTHS:
        return 0
    return head


def _mixed(seed: int, docs: int, long_share: float) -> list[int]:
    """Short lognormal docs with a share of long ones (hundreds to thousands of tokens)."""
    rng = np.random.default_rng(seed)
    short = np.maximum(1, rng.lognormal(1.5, 0.8, docs).astype(np.int64))
    long = rng.integers(100, 3000, docs)
    return np.where(rng.random(docs) < long_share, long, short).tolist()


@pytest.mark.parametrize(("seed", "docs", "n", "long_share"), [
    (0, 5000, 8, 0.0), (1, 20000, 256, 0.05), (2, 20000, 256, 0.3), (3, 50000, 1024, 0.1),
    (4, 8000, 64, 0.02), (5, 16384, 1024, 0.01), (6, 20000, 1, 0.1), (7, 20000, 512, 0.0)])
def test_bulk_head_matches_reference(seed: int, docs: int, n: int, long_share: float) -> None:
    seq = sorted(_mixed(seed, docs, long_share), reverse=True)
    assert bulk.bulk_head(np.array(seq, dtype=np.int64), n) == _head_reference(seq, n)


def test_bulk_head_edges() -> None:
    by_length = lambda seq: np.array(sorted(seq, reverse=True), dtype=np.int64)  # noqa: E731
    assert bulk.bulk_head(by_length(_mixed(0, 20000, 0.1)), 1) == 0  # one rank
    assert bulk.bulk_head(by_length([1] * 20000), 64) == 0  # one length: the balanced pass
    # Nearly as many ranks as tokens (T = 2): fewer than BULK_PER_RANK docs per rank, so
    # not tried (docs hold at least a token each: the bulk pass never sees more ranks
    # than tokens).
    assert bulk.bulk_head(by_length([1] * 5000 + [2] * 5000), 8192) == 0
    assert bulk.bulk_head(by_length([1] * 5000 + [2] * 5000), 20000) == 0
    # One long doc among many short ones: the 4N longest already leave short docs only.
    one = [50000] + [1 + i % 9 for i in range(20000)]
    assert bulk.bulk_head(by_length(one), 64) == bulk.HEAD_PER_RANK * 64
    # Long docs beyond the 4N longest on fewer than EXTEND_RANKS ranks: not tried.
    assert bulk.bulk_head(by_length(_mixed(4, 8000, 0.1)), 32) == 0
    # Long docs beyond HEAD_CAP per rank: not tried.
    assert bulk.bulk_head(by_length(_mixed(1, 20000, 0.9)), 256) == 0
    # Where the 4N longest leave short docs only, the head is 4N (the rule before the
    # head adapted), and where more are long, it holds every long doc.
    seq = by_length(_mixed(2, 20000, 0.1))
    head = bulk.bulk_head(seq, 256)
    cap = -(-int(seq.sum()) // 256)
    assert head > bulk.HEAD_PER_RANK * 256
    assert bulk.BULK_ROOM * int(seq[head]) <= cap < bulk.BULK_ROOM * int(seq[head - 1])


@pytest.mark.parametrize("n", [1, 2, 3, 8, 9])
def test_need_order_both_ends(n: int) -> None:
    """``need_order`` with ``both_ends``: the need order's first, last, second, second
    last, ...; a permutation of the ranks."""
    rng = np.random.default_rng(n)
    ranks = Ranks(n, 100)
    for r in range(n):
        ranks.tokens[r] = int(rng.integers(0, 100))
        ranks.work[r] = int(rng.integers(0, 5000))
    plain = bulk.need_order(ranks, 3000.0, False)
    assert sorted(plain) == list(range(n))
    want = []
    lo, hi = 0, n - 1
    while lo <= hi:
        want.append(plain[lo])
        lo += 1
        if lo <= hi:
            want.append(plain[hi])
            hi -= 1
    assert bulk.need_order(ranks, 3000.0, True) == want


def _check_plan(seq: list[int], n: int) -> tuple[bool, float]:
    """A valid flashcp plan that meets R or declares it: (declared met, imbalance)."""
    request = PlanRequest(doc_lengths=tuple(seq), cp_size=n, context_length=None,
                          imbalance_target=1.05)
    layout = flashcp_layout(seq, request)
    shards = layout.groups[0].shards
    cap = -(-sum(seq) // n)
    covered = [0] * len(seq)
    work = []
    for rank in shards:
        assert sum(s.end - s.start for s in rank) <= cap
        work.append(sum((s.start + s.end + 1) * (s.end - s.start) // 2 for s in rank))
        for s in rank:
            assert 0 <= s.start < s.end <= seq[s.doc]
            covered[s.doc] += s.end - s.start
    assert covered == seq
    imb = max(work) / (sum(work) / n)
    met = imb <= 1.05
    assert layout.info.get("imbalance_target_met", True) is met
    solve(request, check=True)
    return met, imb


@pytest.mark.parametrize(("seed", "docs", "n", "long_share"), [
    (1, 20000, 256, 0.1), (3, 50000, 1024, 0.1), (4, 30000, 512, 0.1)])
def test_extended_head_plans_valid_and_meet_or_declare(seed: int, docs: int, n: int,
                                                       long_share: float) -> None:
    seq = _mixed(seed, docs, long_share)
    head = bulk.bulk_head(np.array(sorted(seq, reverse=True), dtype=np.int64), n)
    assert head > bulk.HEAD_PER_RANK * n  # the head is extended
    _check_plan(seq, n)


def test_extended_head_with_docs_longer_than_a_rank() -> None:
    """Docs longer than T among the head (spilled, then zigzagged): valid plans."""
    rng = np.random.default_rng(9)
    seq = _mixed(9, 30000, 0.1)
    cap = -(-sum(seq) // 512)
    for i in rng.choice(len(seq), 40, replace=False).tolist():
        seq[i] = int(rng.integers(cap + 1, 3 * cap))
    _check_plan(seq, 512)


def test_many_one_token_docs_with_a_long_one() -> None:
    """Thousands of 1-token docs and a few short lengths, one long doc: valid plans."""
    seq = [1] * 6000 + [2, 3, 4, 5, 6] * 200 + [30000]
    for n in (8, 64):
        _check_plan(seq, n)


@pytest.mark.parametrize("seed", [39, 348, 415, 441, 495, 730])
def test_fill_reserve_keeps_room_for_the_fill(seed: int) -> None:
    """``place`` with ``fill_reserve`` 1, on heads it places whole (lognormal lengths):
    each rank's workload plus its room left (the least its fill can weigh) stays within
    the allowed workload, which without the reserve it does not; the docs it turns away
    are spilled, none lost; with 0, as without it."""
    rng = np.random.default_rng(seed)
    n, docs = int(rng.integers(2, 9)), int(rng.integers(20, 200))
    seq = np.maximum(1, rng.lognormal(2.5, 1.2, docs).astype(np.int64)).tolist()
    lengths = np.array(seq, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable").tolist()
    total_work = int((lengths * (lengths + 1) // 2).sum())
    allowed = 1.05 * total_work / n
    head = order[:int(rng.integers(n, docs // 2))]

    def ends(ranks: Ranks) -> int:
        assert all(s.start == 0 and s.end == seq[s.doc] for r in ranks.shards for s in r)
        return max(w + ranks.capacity - t for w, t in zip(ranks.work, ranks.tokens,
                                                          strict=True))

    ranks, spill = place(seq, head, n, allowed, True, total_work, lengths=lengths,
                         fill_reserve=1)
    assert ends(ranks) <= allowed and spill
    assert sorted([s.doc for r in ranks.shards for s in r] + [d for d, _ in spill]) == sorted(head)
    plain, plain_spill = place(seq, head, n, allowed, True, total_work, lengths=lengths)
    assert ends(plain) > allowed
    zero, zero_spill = place(seq, head, n, allowed, True, total_work, lengths=lengths,
                             fill_reserve=0)
    assert plain.shards == zero.shards and plain_spill == zero_spill


def test_below_extend_ranks_the_layout_made_for_the_fill_follows_a_plain_miss(monkeypatch) -> None:
    """On fewer than EXTEND_RANKS ranks the plain bulk layout is tried first; where it misses
    R (Wikipedia-like lengths, 20,000 docs at N = 32) the layout made for the fill comes
    next, and meeting R it gives the plan, without any full pass."""
    seq = mixed_lengths("family:wikipedia", 20000, 400_000)
    n = 32
    assert n < bulk.EXTEND_RANKS
    head = bulk.bulk_head(np.sort(np.asarray(seq, dtype=np.int64))[::-1], n)
    assert head
    made = _bulk_layouts(seq, n, [(head, False, False), (head, True, False)])
    assert imbalance(made[0].work) > 1.05 >= imbalance(made[1].work)
    _solved_without_full_passes(monkeypatch, seq, n)


def test_fill_counted_at_its_density_follows_a_fill_layout_miss(monkeypatch) -> None:
    """Where the layout made for the fill misses R because its head leaves ranks needing a
    denser or lighter fill than the short docs hold (WLB-LLM lengths, 30,000 docs, 600K
    tokens, N = 256: most docs near a rank's mean workload taken whole), the layout with
    the fill counted at the short docs' own density comes next and meets R, without any
    full pass."""
    seq = mixed_lengths("wlbllm", 30000, 600_000)
    n = 256
    by_length = np.sort(np.asarray(seq, dtype=np.int64))[::-1]
    head = bulk.bulk_head(by_length, n)
    tries = bulk.bulk_tries(by_length, n)
    assert head and tries == [bulk.BulkTry(head, True, False),
                              bulk.BulkTry(bulk.HEAD_PER_RANK * n, True, True)]
    made = _bulk_layouts(seq, n, tries)
    assert imbalance(made[0].work) > 1.05 >= imbalance(made[1].work)
    for ranks in made:
        assert sum(ranks.tokens) == sum(seq) and max(ranks.tokens) <= ranks.capacity
    _solved_without_full_passes(monkeypatch, seq, n)


def test_fill_at_its_density_on_many_ranks_with_few_docs_each(monkeypatch) -> None:
    """On many ranks with fewer than BULK_PER_RANK docs a rank (C4-like lengths, 5,000
    docs, 2M tokens, N = 700) the bulk pass proper is not tried, the layout with the fill
    at its density is, and meets R without any full pass (which reach 1.30 there)."""
    seq = mixed_lengths("family:c4", 5000, 2_000_000)
    n = 700
    by_length = np.sort(np.asarray(seq, dtype=np.int64))[::-1]
    assert bulk.bulk_head(by_length, n) == 0
    assert bulk.bulk_tries(by_length, n) == [bulk.BulkTry(bulk.HEAD_PER_RANK * n, True, True)]
    _solved_without_full_passes(monkeypatch, seq, n)


def _bulk_layouts(seq: list[int], n: int, tries) -> list[Ranks]:
    """``bulk.bulk_layout`` for each (head, for_fill, at_density) of ``tries`` at R = 1.05,
    as ``flashcp_solve`` calls it."""
    lengths = np.asarray(seq, dtype=np.int64)
    order = sorted(range(len(seq)), key=lambda i: (-seq[i], i))
    total_work = int((lengths * (lengths + 1) // 2).sum())
    allowed = 1.05 * total_work / n
    return [bulk.bulk_layout(seq, order, lengths, n, allowed, total_work, *t) for t in tries]


def _solved_without_full_passes(monkeypatch, seq: list[int], n: int) -> None:
    def no_pass(*args, **kwargs):
        raise AssertionError("a full pass ran")

    monkeypatch.setattr(flashcp_solve_module, "passes", no_pass)
    plan = solve(PlanRequest(doc_lengths=tuple(seq), cp_size=n, imbalance_target=1.05,
                             context_length=None))
    assert plan.metrics.imbalance <= 1.05


def test_bulk_tries_edges() -> None:
    def by_length(seq):
        return np.sort(np.asarray(seq, dtype=np.int64))[::-1]

    mixed = by_length(_mixed(0, 20000, 0.1))
    assert bulk.bulk_tries(mixed, 1) == []
    assert bulk.bulk_tries(mixed[:bulk.BULK_DOCS], 1024) == []  # few docs
    # Fewer than DENSE_FILL_PER_RANK short docs a rank past the 4N longest.
    assert bulk.DENSE_FILL_PER_RANK * 1024 == 2048
    enough = by_length([500] * 4096 + list(range(1, 9)) * 256)
    assert bulk.bulk_tries(enough, 1024) == [bulk.BulkTry(4096, True, True)]
    assert bulk.bulk_tries(enough[:-1], 1024) == []
    assert bulk.bulk_tries(by_length([7] * 4096 + [1, 2, 3] * 2000), 1024) == []  # 3 lengths
    # Fewer than EXTEND_RANKS ranks and no bulk head: only the full passes.
    assert bulk.bulk_head(by_length(_mixed(4, 8000, 0.1)), 32) == 0
    assert bulk.bulk_tries(by_length(_mixed(4, 8000, 0.1)), 32) == []
    stream = np.array([1, 2, 3], dtype=np.int64)
    assert bulk.stream_density(stream) == (1 + 3 + 6) / 6
    assert bulk.stream_density(stream[:0]) == 0.0


@pytest.mark.parametrize("seed", range(40))
def test_zigzag_ranks_matches_reference(seed: int) -> None:
    """``place.zigzag_ranks`` (the lag order built for the most lagging ranks first) picks
    the ranks ``zigzag_ranks_reference`` (the whole order) picks: few and many ranks,
    tied lags (integer figures at an integer density), widths the partial order cannot
    serve (little room, the widest width), and no width at all."""
    rng = np.random.default_rng(seed)
    n = int(rng.choice([1, 2, 5, 64, 128, 129, 300, 700]))
    capacity = int(rng.integers(50, 3000))
    tokens = rng.integers(0, capacity + 1, n).astype(np.float64)
    if seed % 3 == 0:
        tokens[:] = rng.integers(0, 3, n) * (capacity // 4)  # many equal rooms
    work = rng.integers(0, 10, n).astype(np.float64) * float(rng.integers(1, 1000))
    density = float(rng.choice([0.0, 1.0, 7.0, rng.random() * 50]))
    length = int(rng.choice([2, 17, capacity // 2, capacity * 3, n * 40 + 1]))
    doc_work = length * (length + 1) // 2
    allowed = float(work.max() + doc_work / rng.choice([1, 2, 8, 64, max(2, n)]))
    fill = float(rng.choice([0.0, density, density / 4]))
    args = (work, tokens, capacity, length, doc_work, allowed, fill, density)
    assert place_module.zigzag_ranks(*args) == place_module.zigzag_ranks_reference(*args)


def test_exchange_moves() -> None:
    """More exchange moves only where few ranks pass R (at most 1 in FEW_OVER): OVER_MOVES
    per rank over, at least the default."""
    allowed = 10.0
    n = 64
    few = [11] * (n // bulk.FEW_OVER) + [9] * (n - n // bulk.FEW_OVER)
    assert bulk.exchange_moves(few, allowed) == max(bulk.EXCHANGE_MOVES,
                                                    bulk.OVER_MOVES * (n // bulk.FEW_OVER))
    many = [11] * (n // bulk.FEW_OVER + 1) + [9] * (n - n // bulk.FEW_OVER - 1)
    assert bulk.exchange_moves(many, allowed) == bulk.EXCHANGE_MOVES
    assert bulk.exchange_moves([10] * n, allowed) == bulk.EXCHANGE_MOVES  # none over
    assert bulk.exchange_moves([11] + [0] * 99, allowed) == bulk.EXCHANGE_MOVES
