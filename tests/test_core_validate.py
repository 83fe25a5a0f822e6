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


def _mutations(plan, rng):
    """The plan and broken copies of it: a shard dropped, doubled, shifted, grown past its
    doc, moved to another rank, two shards swapped, a doc index out of range, padding
    off, a rank out of range or repeated, a wrong docs list, a doc in two groups."""
    from planner_service.core.plan import Group

    group = plan.groups[0]
    shards = [list(r) for r in group.shards]
    out = [("as solved", plan)]

    def edited(name, rows=None, **changes):
        g = replace(group, **({"shards": tuple(tuple(r) for r in rows)} if rows is not None
                              else {}), **changes)
        out.append((name, replace(plan, groups=(g, *plan.groups[1:]))))

    full = [i for i, r in enumerate(shards) if r]
    i = full[rng.randrange(len(full))]
    j = rng.randrange(len(shards[i]))
    s = shards[i][j]
    rows = [list(r) for r in shards]
    del rows[i][j]
    edited("dropped", rows)
    rows = [list(r) for r in shards]
    rows[i].insert(j, s)
    edited("doubled", rows)
    for name, shard in (("shifted", Shard(s.doc, s.start + 1, s.end + 1)),
                        ("grown", Shard(s.doc, s.start, plan.doc_lengths[s.doc] + 1)),
                        ("empty", Shard(s.doc, s.start, s.start)),
                        ("doc out of range", Shard(len(plan.doc_lengths), 0, 1))):
        rows = [list(r) for r in shards]
        rows[i][j] = shard
        edited(name, rows)
    rows = [list(r) for r in shards]
    rows[(i + 1) % len(rows)] = sorted([*rows[(i + 1) % len(rows)], rows[i].pop(j)])
    edited("moved", rows)
    if len(shards[i]) > 1:
        rows = [list(r) for r in shards]
        rows[i][0], rows[i][-1] = rows[i][-1], rows[i][0]
        edited("swapped", rows)
    edited("padding", padding=(group.padding[0] + 1, *group.padding[1:]))
    edited("negative padding", padding=(-1, *group.padding[1:]))
    edited("rank out of range", ranks=(plan.cp_size, *group.ranks[1:]))
    if len(group.ranks) > 1:
        edited("rank twice", ranks=(group.ranks[1], *group.ranks[1:]))
    edited("docs", docs=group.docs[1:])
    half = len(shards) // 2
    if half:
        parts = (group.shards[:half], group.shards[half:])
        split = []
        for k, part in enumerate(parts):  # each group padded to its own fullest rank
            held = [sum(x.end - x.start for x in r) for r in part]
            split.append(Group(ranks=group.ranks[:half] if k == 0 else group.ranks[half:],
                               docs=tuple(sorted({x.doc for r in part for x in r})),
                               shards=part, padding=tuple(max(held) - h for h in held),
                               metrics=group.metrics, rank_stats=group.rank_stats))
        out.append(("two groups", replace(plan, groups=tuple(split))))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_numpy_structure_check_agrees_with_the_reference(seed):
    """``structure_holds`` is True exactly where ``structure_problems`` finds nothing, on
    solved plans and on broken copies of them (``_mutations``), several docs a rank."""
    import random

    from planner_service.core.validate import structure_holds, structure_problems

    rng = random.Random(seed)
    for strategy, n in (("flashcp", 3), ("per_doc", 4), ("zigzag", 2), ("llama3", 5)):
        lengths = tuple(rng.randint(1, 400) for _ in range(rng.randint(1, 30)))
        plan = solve(debug_request(doc_lengths=lengths, cp_size=n, context_length=None,
                                   strategy=strategy))
        for name, case in _mutations(plan, rng):
            want = not structure_problems(case)
            assert structure_holds(case) == want, (strategy, n, name)
            if name == "as solved":
                assert want


def test_a_large_broken_plan_is_named_by_the_reference():
    # Above FAST_SHARDS the numpy check runs first; a broken plan still gets the
    # reference's message.
    from planner_service.core.validate import FAST_SHARDS

    plan = solve(debug_request(doc_lengths=(3,) * (2 * FAST_SHARDS), cp_size=4,
                               context_length=None, strategy="per_doc"))
    validate_plan(plan)
    shards = [list(r) for r in plan.groups[0].shards]
    shards[1] = shards[1][1:]
    with pytest.raises(PlanError, match="missing"):
        validate_plan(with_shards(plan, shards))
