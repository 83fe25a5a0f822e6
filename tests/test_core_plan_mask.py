"""A request's attention mask in the plan: recorded only when not causal, layer-weighted
metrics and per-window ``layers`` figures, recomputed by the validator."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.build import GroupLayout, Layout, build_plan
from planner_service.core.errors import FieldError
from planner_service.core.mask import CAUSAL, AttentionMask, parse_mask
from planner_service.core.plan import Plan, Shard, content_hash
from planner_service.core.request import debug_request
from planner_service.core.validate import PlanError, validate_plan
from planner_service.solvers.registry import solve

GEMMA = parse_mask(layers="5x1024,1xfull")
STRATEGIES = ("flashcp", "per_doc", "contiguous_halo", "ring", "llama3", "zigzag")


def rehash(plan: Plan) -> Plan:
    return replace(plan, plan_id=content_hash(plan.body_dict()))


def test_a_request_without_a_mask_is_causal_and_a_bad_one_names_layers() -> None:
    assert debug_request().mask == CAUSAL
    with pytest.raises(FieldError) as err:
        debug_request(mask="5x1024,1xfull")
    assert err.value.field == "layers"
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_causal_mask_of_any_layer_count_gives_todays_bytes(strategy: str) -> None:
    plain = solve(debug_request(strategy=strategy))
    for mask in (CAUSAL, AttentionMask.uniform(None, 32)):
        plan = solve(debug_request(strategy=strategy, mask=mask))
        assert plan.to_json() == plain.to_json()
    assert "mask" not in json.loads(plain.to_json())
    assert "layers" not in plain.to_json()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_masked_plan_records_its_mask_and_round_trips(strategy: str) -> None:
    plan = solve(debug_request(strategy=strategy, mask=GEMMA))
    data = json.loads(plan.to_json())
    assert data["mask"] == [{"window": 1024, "count": 5}, {"window": None, "count": 1}]
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.to_json() == plan.to_json()
    validate_plan(back)
    assert plan.plan_id != solve(debug_request(strategy=strategy)).plan_id


@pytest.mark.parametrize("comm_mode", ["alltoallv", "compact_allgather", "full", "p2p_ring"])
def test_masked_metrics_are_the_layer_weighted_window_figures(comm_mode: str) -> None:
    mask = parse_mask(layers="3x7,2x300,1xfull")
    # per_doc: a layout that does not depend on the mask, so its causal layer is today's.
    small = dict(doc_lengths=(411, 37, 1023, 91, 1, 511, 207), context_length=None,
                 strategy="per_doc")
    plan = solve(debug_request(mask=mask, comm_mode=comm_mode, **small))
    group = plan.groups[0]
    arrays = cost.shard_arrays(group.shards)
    assert arrays is not None
    tokens_per_rank = plan.metrics.tokens_per_rank
    figures = ww.mask_figures_of(arrays, mask, comm_mode=comm_mode,
                                 tokens_per_rank=tokens_per_rank, skip_ring_steps=True)
    m, stats = plan.metrics, group.rank_stats
    assert m.imbalance == pytest.approx(figures.imbalance, rel=1e-12)
    assert m.max_workload == max(figures.workload)
    assert m.comm_tokens == figures.comm_tokens
    assert m.full_comm_tokens == mask.num_layers * (plan.cp_size - 1) * tokens_per_rank
    assert stats.workload == figures.workload
    assert m.layers is not None and stats.layers is not None
    assert [layer.window for layer in m.layers] == [7, 300, None]
    for layer, ranks, f in zip(m.layers, stats.layers, figures.layers, strict=True):
        assert layer.count == f.layers and ranks.workload == f.workload
        assert layer.comm_tokens == max(f.recv)
        assert ranks.alltoallv_recv == f.volumes.alltoallv_recv
        assert layer.alltoallv_tokens == f.volumes.alltoallv_tokens
        # The token-by-token reference of the same layer.
        ref = ww.reference_comm_volumes(group.shards, f.window)
        assert ref == f.volumes
    assert stats.kv_tokens_peak == tuple(max(r.kv_tokens_peak[i] for r in stats.layers)
                                         for i in range(plan.cp_size))
    # The causal layer's figures are today's causal plan's.
    causal = solve(debug_request(comm_mode=comm_mode, **small))
    assert m.layers[-1].max_workload == causal.metrics.max_workload
    assert m.layers[-1].alltoallv_tokens == causal.metrics.alltoallv_tokens


@pytest.mark.parametrize("cp_size", [2, 3, 5])
def test_a_ring_plans_window_layers_count_the_steps_the_runtime_runs(cp_size: int) -> None:
    """p2p_ring under windows 1, 7, 128 and one at least every doc: each window layer's
    figures are ``steps_run`` blocks of tokens per rank, ``steps_run`` the last step some
    rank's windows reach (the key-set reference ``reference_ring_useful``), what the
    runtime's rings and a ring plan's gathered form move; the causal layer runs N - 1; the
    validator recomputes them."""
    lengths = (411, 37, 1023, 91, 1, 511, 207)
    mask = parse_mask(layers="2x1,1x7,3x128,1x2000,1xfull")
    for strategy in ("contiguous_halo", "flashcp", "per_doc"):
        plan = solve(debug_request(mask=mask, comm_mode="p2p_ring", doc_lengths=lengths,
                                   context_length=None, strategy=strategy, cp_size=cp_size))
        validate_plan(plan)
        group = plan.groups[0]
        t = plan.metrics.tokens_per_rank
        assert plan.metrics.layers is not None
        total = 0
        for layer, g in zip(plan.metrics.layers, mask.groups, strict=True):
            useful = ww.reference_ring_useful(group.shards, g.window)
            steps = np.flatnonzero(useful.any(axis=0))
            run = cp_size - 1 if g.window is None else int(steps[-1]) if len(steps) else 0
            assert layer.comm_tokens == run * t, (strategy, g.window)
            total += g.layers * run * t
        assert plan.metrics.comm_tokens == total
        assert plan.metrics.comm_bytes == total * plan.model.kv_bytes_per_token


def test_a_window_no_doc_fills_gives_the_causal_figures_per_layer() -> None:
    mask = parse_mask(layers="2x1000000,1xfull")
    plan = solve(debug_request(strategy="per_doc", mask=mask))
    causal = solve(debug_request(strategy="per_doc"))
    assert plan.metrics.layers is not None
    wide, full = plan.metrics.layers
    assert (wide.max_workload, wide.comm_tokens) == (full.max_workload, full.comm_tokens)
    assert plan.metrics.max_workload == 3 * causal.metrics.max_workload
    assert plan.metrics.imbalance == pytest.approx(causal.metrics.imbalance, rel=1e-12)


def test_the_validator_recomputes_the_masked_figures() -> None:
    plan = solve(debug_request(mask=GEMMA))
    assert plan.metrics.layers is not None
    bad_layer = replace(plan.metrics.layers[0], comm_tokens=plan.metrics.layers[0].comm_tokens + 1)
    tampered = [
        replace(plan, metrics=replace(plan.metrics, imbalance=1.0)),
        replace(plan, metrics=replace(plan.metrics, layers=(bad_layer, plan.metrics.layers[1]))),
        replace(plan, mask=CAUSAL),  # the layers without the mask
        replace(plan, mask=parse_mask(window=4096)),
    ]
    for bad in tampered:
        with pytest.raises(PlanError):
            validate_plan(rehash(bad))
    data = json.loads(plan.to_json())
    data["mask"] = [{"window": 0, "count": 1}]
    with pytest.raises(ValueError, match="window"):
        Plan.from_dict(data)


def test_a_multi_group_plan_under_a_mask_balances_over_all_ranks() -> None:
    lengths = (3000, 500, 2000, 2500)
    layout = Layout([GroupLayout((0, 1), [[Shard(0, 0, 1500)], [Shard(0, 1500, 3000),
                                                                 Shard(1, 0, 500)]]),
                     GroupLayout((2, 3), [[Shard(2, 0, 2000)], [Shard(3, 0, 2500)]])], {})
    plan = build_plan(layout, strategy="x", cp_size=4, doc_lengths=lengths,
                      context_length=None, comm_mode="alltoallv",
                      model=debug_request().model, kernel=debug_request().kernel,
                      link="nvlink", mask=GEMMA)
    validate_plan(Plan.from_json(plan.to_json()))
    work = [w for g in plan.groups for w in g.rank_stats.workload]
    assert plan.metrics.imbalance == pytest.approx(cost.imbalance(work), rel=1e-12)
    assert plan.metrics.layers is not None
    assert plan.metrics.layers[0].comm_tokens == max(
        g.metrics.layers[0].comm_tokens for g in plan.groups if g.metrics.layers)
