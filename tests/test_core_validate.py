"""The validator catches every kind of broken plan and says what is wrong."""

from dataclasses import replace

import pytest

from planner_service import PlanError, solve, validate_plan
from planner_service.core.plan import Shard, content_hash
from planner_service.core.request import debug_request


def rehash(plan):
    draft = replace(plan, plan_id="")
    return replace(plan, plan_id=content_hash(draft.body_dict()))


def with_shards(plan, shards, padding=None):
    group = plan.groups[0]
    group = replace(group, shards=tuple(tuple(r) for r in shards), padding=padding or group.padding)
    return rehash(replace(plan, groups=(group,)))


@pytest.fixture
def plan():
    return solve(
        debug_request(doc_lengths=(10, 6), cp_size=2, context_length=None, strategy="llama3")
    )


def test_accepts_solver_output(plan):
    validate_plan(plan)


def test_rejects_missing_tokens(plan):
    shards = [list(r) for r in plan.groups[0].shards]
    shards[0] = shards[0][:-1]
    with pytest.raises(PlanError, match="missing"):
        validate_plan(with_shards(plan, shards))


def test_rejects_token_placed_twice(plan):
    shards = [list(r) for r in plan.groups[0].shards]
    shards[1] = sorted([*shards[1], Shard(0, 0, 1)])
    with pytest.raises(PlanError, match="placed twice"):
        validate_plan(with_shards(plan, shards))


def test_rejects_shard_outside_doc(plan):
    shards = [[Shard(0, 0, 10)], [Shard(1, 0, 7)]]
    with pytest.raises(PlanError, match="outside doc 1 of length 6"):
        validate_plan(with_shards(plan, shards, padding=(0, 3)))


def test_rejects_unequal_tokens_after_padding(plan):
    shards = [[Shard(0, 0, 10)], [Shard(1, 0, 6)]]
    with pytest.raises(PlanError, match="tokens \\+ padding differ"):
        validate_plan(with_shards(plan, shards, padding=(0, 0)))


def test_rejects_metric_that_disagrees_with_shards(plan):
    bad = rehash(replace(plan, metrics=replace(plan.metrics, imbalance=1.0)))
    with pytest.raises(PlanError, match="metrics.imbalance"):
        validate_plan(bad)


def test_rejects_wrong_plan_id(plan):
    with pytest.raises(PlanError, match="plan_id"):
        validate_plan(replace(plan, plan_id="0" * 64))


def test_rejects_rank_outside_cp_size(plan):
    group = replace(plan.groups[0], ranks=(0, 5))
    with pytest.raises(PlanError, match="rank 5 outside"):
        validate_plan(rehash(replace(plan, groups=(group,))))


def test_metrics_false_takes_the_metrics_as_given_and_checks_the_rest(plan):
    """The service's self-check (metrics=False) trusts build_plan's metrics only."""
    validate_plan(plan, metrics=False)
    bad_metrics = rehash(replace(plan, metrics=replace(plan.metrics, imbalance=1.0)))
    validate_plan(bad_metrics, metrics=False)
    shards = [list(r) for r in plan.groups[0].shards]
    shards[0] = shards[0][:-1]
    with pytest.raises(PlanError, match="missing"):
        validate_plan(with_shards(plan, shards), metrics=False)
    with pytest.raises(PlanError, match="plan_id"):
        validate_plan(replace(plan, plan_id="0" * 64), metrics=False)


@pytest.mark.parametrize("strategy", ["llama3", "per_doc", "zigzag", "flashcp", "auto"])
@pytest.mark.parametrize("windowed", [False, True])
def test_admitted_solve_gives_the_library_plan(strategy, windowed):
    """The service's solve (admitted: no second strategy check, the metrics computed once)
    gives the bytes the library's fully checked solve gives, and the full validator
    accepts them."""
    from planner_service.core.mask import parse_layers

    request = debug_request(strategy=strategy)
    if windowed:
        request = replace(request, mask=parse_layers([{"window": 512, "count": 3},
                                                      {"window": None, "count": 1}]))
    admitted = solve(request, admitted=True)
    assert admitted.to_json() == solve(request).to_json()
    validate_plan(admitted)
