"""Runs of equal docs on few ranks (``few.place_run``): the same docs to the same ranks as
the least-key rule doc by doc (``runs.place_run_reference``, which ``place``'s heap follows
on N <= ``place.REFRESH`` ranks), from layouts whose token counts differ widely (keys
that cross as the density falls, as after the long docs of a mixed-length request)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from planner_service.core.cost import doc_workload
from planner_service.core.request import PlanRequest
from planner_service.solvers.flashcp import drift, few, runs
from planner_service.solvers.flashcp.ranks import Ranks
from planner_service.solvers.registry import solve


def layout(n: int, cap: int, held: list[tuple[int, int]]) -> Ranks:
    ranks = Ranks(n, cap)
    ranks.tokens = [t for t, _ in held]
    ranks.work = [w for _, w in held]
    return ranks


@pytest.mark.parametrize("n", (2, 3, 5, 8))
@pytest.mark.parametrize("seed", range(10))
def test_few_ranks_place_as_the_rule_doc_by_doc(n, seed):
    rng = random.Random(seed)
    length = rng.choice((2, 3, 9, 40, 89))
    count = rng.randint(200, 3000)
    # Widely different token counts (up to half the capacity) and workloads near a mix of
    # long and short docs.
    later = [rng.randint(1, length) for _ in range(rng.choice((0, 50, 2000)))]
    rest_tokens = count * length + sum(later)
    rest_work = count * doc_workload(length) + sum(map(doc_workload, later))
    cap = -(-rest_tokens // n) * 2 + rng.randint(0, 3 * length)
    held = []
    for _ in range(n):
        tokens = rng.randint(0, cap // 2)
        held.append((tokens, tokens * rng.randint(length, 4 * length)))
    total = rest_work + sum(w for _, w in held)
    allowed = rng.choice((1.0, 1.05, 100.0)) * total / n
    slow, fast = layout(n, cap, held), layout(n, cap, held)
    want = runs.place_run_reference(length, range(count), slow, allowed, rest_tokens, rest_work,
                                    held_docs=1)
    got = few.place_run(length, range(count), fast, allowed, rest_tokens, rest_work)
    # few.place_run may stop early (the heap goes on); what it placed is the rule's.
    assert got.placed <= want.placed
    again = layout(n, cap, held)
    runs.place_run_reference(length, range(got.placed), again, allowed, rest_tokens, rest_work,
                             held_docs=1)
    assert (fast.shards, fast.tokens, fast.work) == (again.shards, again.tokens, again.work)
    if got.placed:
        assert got.density == float(runs.run_densities(length, got.placed, rest_tokens,
                                                        rest_work)[-1])


def test_repaired_moves_the_found_rank_up_and_keeps_the_length():
    predicted = np.array([0, 1, 2, 3, 2, 1])
    assert few.repaired(predicted, 1, 2).tolist() == [0, 2, 1, 3, 2, 1]
    assert few.repaired(predicted, 5, 0).tolist() == [0, 1, 2, 3, 2, 0]


def test_drift_prediction_is_a_sequence_of_ranks_with_room():
    work = np.array([5000, 90000, 40000], dtype=np.int64)
    tokens = np.array([300, 4000, 1500], dtype=np.int64)
    fits = np.array([50, 10, 30], dtype=np.int64)
    densities = np.linspace(9.0, 8.0, 60)
    ranks = drift.drift_ranks(work, tokens, fits, 20, densities)
    assert ranks is not None and len(ranks) == 60
    assert (np.bincount(ranks, minlength=3) <= fits).all()
    assert drift.drift_ranks(work, tokens, np.zeros(3, dtype=np.int64), 20, densities) is None


@pytest.mark.parametrize("n", (1, 2, 3, 5, 8))
@pytest.mark.parametrize("seed", range(12))
def test_loop_steps_place_as_the_rule_doc_by_doc(n, seed):
    """``few.loop_steps`` (the rest of a run whose prediction misses) from layouts with
    widely different token counts, some ranks without room, and allowances that stop it."""
    rng = random.Random(100 + seed)
    length = rng.choice((1, 2, 3, 9, 40))
    count = rng.randint(1, 1500)
    later = [rng.randint(1, length) for _ in range(rng.choice((0, 50)))]
    rest_tokens = count * length + sum(later)
    rest_work = count * doc_workload(length) + sum(map(doc_workload, later))
    cap = -(-rest_tokens // n) + rng.randint(0, 3 * length)
    held = []
    for _ in range(n):
        tokens = rng.choice((0, cap, cap - length + 1, rng.randint(0, cap)))
        held.append((tokens, tokens * rng.randint(1, 2 * length)))
    allowed = rng.choice((1.0, 1.05, 100.0)) * (rest_work + sum(w for _, w in held)) / n
    slow, fast = layout(n, cap, held), layout(n, cap, held)
    want = runs.place_run_reference(length, range(count), slow, allowed, rest_tokens, rest_work,
                                    held_docs=1)
    densities = runs.run_densities(length, count, rest_tokens, rest_work)
    chosen, stopped = few.loop_steps(np.array(fast.work, dtype=np.int64),
                                     np.array(fast.tokens, dtype=np.int64), cap, length, allowed,
                                     densities)
    runs.add_run(fast, chosen, range(len(chosen)), length)
    assert stopped == (want.placed < count)
    assert (fast.shards, fast.tokens, fast.work) == (slow.shards, slow.tokens, slow.work)


def test_drift_prediction_declines_when_capped_candidates_fall_short():
    """One rank with room for most docs, the others for one each: each rank's candidates
    are capped near twice its share, fewer than the block; no prediction (not an index
    error)."""
    work = np.zeros(8, dtype=np.int64)
    tokens = np.zeros(8, dtype=np.int64)
    fits = np.array([2000] + [1] * 7, dtype=np.int64)
    densities = np.linspace(3.0, 2.9, 300)
    assert drift.drift_ranks(work, tokens, fits, 7, densities) is None


def test_runs_after_uneven_room_solve_and_validate():
    """Runs of short docs after long ones leave one rank far more room than the others
    (the case above, inside ``place``): the request solves, and its plan validates."""
    lengths = [5000] * 211 + [1000] * 201 + [100] * 174 + [64] * 212 + [7] * 212 + [1] * 200
    request = PlanRequest(doc_lengths=tuple(lengths), cp_size=8, context_length=None,
                          imbalance_target=1.05)
    plan = solve(request, check=True)
    assert plan.metrics.imbalance <= 1.05
