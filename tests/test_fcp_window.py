"""FCP under an attention mask: the windowed attention units against the pair counts of
core/window_work.py, stage 2 on them against the brute force, and the ``fcp`` strategy's
plans under masks (valid, balanced on the layer-weighted work or declaring the miss)."""

from __future__ import annotations

import numpy as np
import pytest

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.mask import CAUSAL, parse_mask
from planner_service.core.request import PlanRequest
from planner_service.fcp.brute import brute_degrees
from planner_service.fcp.cost_model import PROFILES
from planner_service.fcp.grouping import group_table
from planner_service.fcp.portfolio import solve_micro_batch
from planner_service.fcp.schedule import plan_global_batch, sequence_stats
from planner_service.fcp.seq_stats import mask_units
from planner_service.solvers.balance import TARGET_MET
from planner_service.solvers.registry import solve

PROFILE = PROFILES["h100-llama3-8b-ib"]
MASKS = ("5x1024,1xfull", "1x128", "1x1,3x64,1xfull", "2x4096")
REL = 1e-12


def reference_units(lengths, mask):
    """Per doc, the layer mean of ``2 shard_window_workload(0, L, W) - L``."""
    layers = sum(g.layers for g in mask.groups)
    return [sum(g.layers * (2 * ww.shard_window_workload(0, length, g.window) - length)
                for g in mask.groups) / layers for length in lengths]


def test_mask_units_are_the_pair_counts():
    rng = np.random.default_rng(3)
    lengths = [1, 2, 63, 64, 65, 127, 128, 129, 1024, 5000, *rng.integers(1, 70000, 30).tolist()]
    for text in MASKS:
        mask = parse_mask(layers=text)
        got = mask_units(np.asarray(lengths, dtype=np.float64), mask)
        assert got.tolist() == pytest.approx(reference_units(lengths, mask), rel=REL)
    # A window no document fills, and a causal group, give the causal units L^2 exactly.
    wide = mask_units(np.asarray(lengths, dtype=np.float64), parse_mask(window=70000))
    assert wide.tolist() == [float(length) ** 2 for length in lengths]


def test_causal_mask_gives_todays_stats():
    seqs = [[4000, 300], [9000], [17, 1, 5]]
    base = sequence_stats(seqs, (), PROFILE)
    same = sequence_stats(seqs, (), PROFILE, CAUSAL)
    assert np.array_equal(base.units, same.units) and np.array_equal(base.tokens, same.tokens)
    with pytest.raises(ValueError, match="full_attention"):
        sequence_stats(seqs, (True, False, False), PROFILE, parse_mask(window=128))


def test_stage_two_on_windowed_units_equals_brute_force():
    rng = np.random.default_rng(4)
    checked = 0
    while checked < 60:
        n = int(rng.integers(1, 7))
        memory = int(rng.choice([1024, 2048, 4096, 8192]))
        seqs = [[int(x) for x in rng.integers(1, 6000, size=int(rng.integers(1, 3)))]
                for _ in range(int(rng.integers(1, 6)))]
        if sum(map(sum, seqs)) > n * memory:
            continue
        mask = parse_mask(layers=MASKS[checked % len(MASKS)])
        stats = sequence_stats(seqs, (), PROFILE, mask)
        found = solve_micro_batch(stats, range(len(seqs)), n, memory, PROFILE, method="dp")
        table = group_table(stats, [list(g) for g in found.groups], n, memory, PROFILE)
        assert brute_degrees(table).makespan_ms == pytest.approx(found.makespan_ms, rel=REL)
        checked += 1


def test_windowed_units_change_the_degrees_where_they_should():
    """Under a short window the work is near linear in tokens: the long sequence no longer
    dominates, and the makespan estimate falls."""
    seqs = [[65536], [4096] * 4, [2048] * 8]
    causal = plan_global_batch(seqs, num_ranks=16, memory_tokens=16384, profile=PROFILE)
    local = plan_global_batch(seqs, num_ranks=16, memory_tokens=16384, profile=PROFILE,
                              mask=parse_mask(window=128))
    assert local.makespan_ms < causal.makespan_ms


def _weighted(plan, mask):
    return [ww.mask_figures_of(cost.shard_arrays(g.shards), mask, comm_mode="alltoallv",
                               tokens_per_rank=0).imbalance for g in plan.groups]


@pytest.mark.parametrize("docs,n,text,intra", [
    ((65536, 32768, 16384, 8192, 4096, 2048, 1024, 1024), 8, "5x1024,1xfull", "flashcp"),
    ((32768, 16384, 16384, 8192, 3000, 3000, 1000, 500, 500), 16, "5x1024,1xfull", "flashcp"),
    ((32768, 16384, 16384, 8192, 3000, 3000, 1000, 500, 500), 16, "1x256", "zigzag"),
    ((4099, 37, 1023, 8191), 4, "1x128", "zigzag"),
])
def test_fcp_plans_under_a_mask(docs, n, text, intra):
    mask = parse_mask(layers=text)
    request = PlanRequest(doc_lengths=docs, cp_size=n, strategy="fcp", mask=mask,
                          options={"intra": intra})
    plan = solve(request)  # validated
    assert plan.to_json() == solve(request).to_json()
    imbalances = _weighted(plan, mask)
    missed = max(imbalances) > plan.info.get("imbalance_target", request.imbalance_target)
    assert (plan.info.get(TARGET_MET) is False) == missed
    if intra == "flashcp":  # flashcp balances the weighted work of every group itself
        assert not missed
    # The degrees come from the windowed units: the same as the causal request's only if
    # the schedule on them agrees.
    units = plan_global_batch([(x,) for x in docs], num_ranks=n, memory_tokens=2 * -(
        -sum(docs) // n), profile=plan.info["fcp_profile"], micro_batches=1, mask=mask)
    assert list(units.groupings[0].degrees) == plan.info["fcp_degrees"]
