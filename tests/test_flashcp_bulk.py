"""flashcp's bulk pass (``solvers/flashcp/bulk.py``): the cut against its plain reference,
and valid meet-or-declare plans on many-document requests."""

from __future__ import annotations

import numpy as np
import pytest

from planner_service.core.request import PlanRequest
from planner_service.solvers.flashcp import bulk
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
    assert bulk.bulk_applies(np.sort(lengths)[::-1], n)
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
    met = max(work) / (sum(work) / n) <= 1.05
    assert layout.info.get("imbalance_target_met", True) is met
    solve(request, check=True)  # the plan passes core/validate's checks


def test_bulk_not_tried_on_few_docs() -> None:
    assert not bulk.bulk_applies(np.full(4000, 5, dtype=np.int64), 8)
    assert not bulk.bulk_applies(np.full(5000, 5, dtype=np.int64), 1024)
    assert not bulk.bulk_applies(np.full(100000, 20, dtype=np.int64), 8)  # one equal run
    two = np.array([21] * 97152 + [20] * 2848, dtype=np.int64)
    assert not bulk.bulk_applies(two, 1024)


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
