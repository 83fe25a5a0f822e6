"""The vectorised plan building and metrics against their slow references: shard by
shard canonicalisation, the per-shard cost functions, ``rank_step`` per rank and the
generic canonical JSON, compared exactly on random small inputs."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planner_service.core import cost
from planner_service.core.build import canonical_group, canonical_shards
from planner_service.core.metrics import group_metrics
from planner_service.core.model import ModelSpec
from planner_service.core.plan import Metrics, Plan, RankStats, Shard, canonical_json
from planner_service.core.profiles import get_kernel_profile, get_link_profile
from planner_service.core.request import PlanRequest
from planner_service.core.step_time import attention_tiles, held_kv_mode, rank_step
from planner_service.solvers.registry import solve

MODES = ("alltoallv", "compact_allgather", "full", "p2p_ring")


def reference_group_metrics(shards_per_rank, padding, *, comm_mode, model, kernel, link):
    """``group_metrics`` shard by shard and rank by rank (the definitions in core/cost.py
    and core/step_time/)."""
    n = len(shards_per_rank)
    tokens = [sum(s.end - s.start for s in rank) for rank in shards_per_rank]
    tokens_per_rank = max(t + p for t, p in zip(tokens, padding, strict=True))
    workloads = cost.rank_workloads(shards_per_rank)
    volumes = cost.comm_volumes(shards_per_rank)
    full = cost.full_exchange_tokens(n, tokens_per_rank)
    recv = cost.recv_tokens_by_mode(comm_mode, volumes, tokens_per_rank)
    kp, lp = get_kernel_profile(kernel), get_link_profile(link)
    steps = [rank_step(shards, recv_tokens=r, tokens_per_rank=tokens_per_rank, num_ranks=n,
                       comm_mode=comm_mode, model=model, kernel=kp, link=lp,
                       tiles=attention_tiles(shards, kp.tile_q, kp.tile_k),
                       ring_blocks=[shards_per_rank[(i - s) % n] for s in range(1, n)])
             for i, (shards, r) in enumerate(zip(shards_per_rank, recv, strict=True))]
    slowest = max(range(n), key=lambda i: (steps[i].total_ms, -i))
    comm_tokens = max(recv)
    doc_ranks: dict[int, set[int]] = {}
    for rank, shards in enumerate(shards_per_rank):
        for s in shards:
            doc_ranks.setdefault(s.doc, set()).add(rank)
    metrics = Metrics(
        imbalance=cost.imbalance(workloads), max_workload=max(workloads),
        mean_workload=sum(workloads) / n, comm_mode=comm_mode, comm_tokens=comm_tokens,
        full_comm_tokens=full, compact_allgather_tokens=volumes.compact_allgather_tokens,
        alltoallv_tokens=volumes.alltoallv_tokens, comm_saving=cost.saving(comm_tokens, full),
        comm_saving_allgather=cost.saving(volumes.compact_allgather_tokens, full),
        comm_saving_alltoallv=cost.saving(volumes.alltoallv_tokens, full),
        comm_bytes=comm_tokens * model.kv_bytes_per_token,
        full_comm_bytes=full * model.kv_bytes_per_token,
        est_step_ms=steps[slowest].total_ms, est_attn_ms=steps[slowest].attn_ms,
        est_comm_ms=steps[slowest].comm_ms, est_linear_ms=steps[slowest].linear_ms,
        tokens_per_rank=tokens_per_rank, padding_tokens=sum(padding),
        num_shards=sum(len(rank) for rank in shards_per_rank),
        num_split_docs=sum(1 for ranks in doc_ranks.values() if len(ranks) > 1),
    )
    stats = RankStats(tokens=tuple(tokens), workload=tuple(workloads),
                      alltoallv_recv=volumes.alltoallv_recv,
                      allgather_send=volumes.allgather_send,
                      kv_tokens_peak=cost.kv_tokens_peak(held_kv_mode(kernel, comm_mode),
                                                         volumes, tokens, tokens_per_rank))
    return metrics, stats


@st.composite
def groups(draw, empty=True):
    """Random shards on 1..6 ranks over 1..4 docs of up to 40 tokens: overlapping,
    touching, repeated and (if ``empty``) empty shards, in any order."""
    n = draw(st.integers(1, 6))
    docs = draw(st.integers(1, 4))
    out = []
    for _ in range(n):
        rank = []
        for _ in range(draw(st.integers(0, 5))):
            doc = draw(st.integers(0, docs - 1))
            a = draw(st.integers(0, 40))
            b = draw(st.integers(a if empty else a + 1, 41))
            rank.append(Shard(doc, a, b))
        out.append(rank)
    return out


@settings(max_examples=300, deadline=None)
@given(groups())
def test_canonical_group_equals_canonical_shards_rank_by_rank(shards):
    got, arrays = canonical_group(shards)
    want = tuple(canonical_shards(rank) for rank in shards)
    assert got == want
    assert all(type(s) is Shard for rank in got for s in rank)
    assert arrays is not None
    assert [tuple(s) for rank in got for s in rank] == list(
        zip(arrays.doc.tolist(), arrays.start.tolist(), arrays.end.tolist(), strict=True))
    assert arrays.rank.tolist() == [i for i, rank in enumerate(got) for _ in rank]


@settings(max_examples=300, deadline=None)
@given(groups(), st.sampled_from(MODES), st.sampled_from(["nvlink", "infiniband"]))
def test_group_metrics_equal_the_reference(shards, mode, link):
    # The reference's comm_volumes needs every doc held to reach past position 0 somewhere
    # (a doc held only as empty shards at 0 has no holder there).
    reach: dict[int, int] = {}
    for s in (s for rank in shards for s in rank):
        reach[s.doc] = max(reach.get(s.doc, 0), s.end)
    assume(all(reach.values()))
    tokens = [sum(s.end - s.start for s in rank) for rank in shards]
    padding = [max(tokens) - t for t in tokens]
    model = ModelSpec()
    args = dict(comm_mode=mode, model=model, kernel="h100-fa3", link=link)
    assert group_metrics(shards, padding, **args) == reference_group_metrics(shards, padding, **args)


def test_group_metrics_fall_back_beyond_int64_safe_positions():
    shards = [[Shard(0, 0, 1 << 31)], [Shard(0, 1 << 31, (1 << 31) + 5)]]
    assert cost.shard_arrays(shards) is None
    args = dict(comm_mode="alltoallv", model=ModelSpec(), kernel="h100-fa3", link="nvlink")
    assert group_metrics(shards, [5, 0], **args) == reference_group_metrics(shards, [5, 0], **args)


def test_plans_at_many_ranks_match_the_reference_metrics_and_hash():
    for doc_lengths, n, mode in (((131072,), 64, "alltoallv"), ((3, 2, 1), 16, "p2p_ring"),
                                 ((4099, 37, 1023, 8191, 1, 511), 8, "compact_allgather"),
                                 ((7,) * 100, 99, "full")):
        plan = solve(PlanRequest(doc_lengths=doc_lengths, cp_size=n, context_length=None,
                                 comm_mode=mode))
        group = plan.groups[0]
        want = reference_group_metrics(group.shards, group.padding, comm_mode=mode,
                                       model=plan.model, kernel=plan.kernel, link=plan.link)
        assert (group.metrics, group.rank_stats) == want
        body = plan.body_dict()
        assert plan.plan_id == hashlib.sha256(canonical_json(body).encode()).hexdigest()
        assert np.unique([s.doc for rank in group.shards for s in rank]).tolist() == list(group.docs)


def test_plan_json_equals_the_generic_canonical_json():
    for doc_lengths, n, mode in (((5, 3, 9, 1), 3, "alltoallv"), ((131072,), 17, "full"),
                                 ((7,) * 40, 50, "compact_allgather")):
        for strategy in ("flashcp", "llama3", "per_doc"):
            plan = solve(PlanRequest(doc_lengths=doc_lengths, cp_size=n, context_length=None,
                                     comm_mode=mode, strategy=strategy))
            assert plan.body_json() == canonical_json(plan.body_dict())
            assert plan.to_json() == canonical_json(plan.to_dict())
            assert plan.groups[0].to_json() == canonical_json(plan.groups[0].to_dict())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 50), st.integers(0, 2**31 - 1)), max_size=40))
def test_held_docs_equal_np_unique(docs):
    from planner_service.core.cost import held_docs

    doc = np.array(docs, dtype=np.int64)
    got = held_docs(doc)
    assert got.tolist() == np.unique(doc).tolist() and got.dtype == np.int64


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.tuples(st.one_of(st.integers(0, 12), st.integers(0, 2**62)),
                                   st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1)),
                         max_size=6), min_size=1, max_size=5))
def test_numpy_json_of_shards_and_docs_equals_canonical_json(per_rank):
    from planner_service.core.plan import int_list_json, shards_json

    flat = [s for rank in per_rank for s in rank]
    doc, start, end = (np.array([s[i] for s in flat], dtype=np.int64) for i in range(3))
    bounds = np.cumsum([0] + [len(rank) for rank in per_rank])
    want = canonical_json([[{"doc": d, "start": a, "end": b} for d, a, b in rank]
                           for rank in per_rank])
    assert shards_json(doc, start, end, bounds) == want
    assert int_list_json(doc) == canonical_json([s[0] for s in flat])


def test_plan_hash_from_made_json_equals_the_plain_hash():
    from planner_service.core.plan import plan_hash

    for doc_lengths, n in (((5, 3, 9, 1), 3), ((7,) * 300, 8), ((131072,), 17)):
        plan = solve(PlanRequest(doc_lengths=doc_lengths, cp_size=n, context_length=None))
        plain = Plan.from_json(plan.to_json())  # no made JSON: every group written anew
        assert plain.made is None and plain == plan
        assert plan.plan_id == hashlib.sha256(plain.body_json().encode()).hexdigest()
        assert plan_hash(plan) == plan_hash(plain) == plan.plan_id


def test_a_plans_made_json_is_its_json_and_only_for_its_own_groups():
    # 600 shards: build_plan makes the shards' JSON in numpy (JSON_IN_NUMPY) and keeps it
    # for to_json; a plan with other groups (dataclasses.replace) writes them anew.
    plan = solve(PlanRequest(doc_lengths=(7,) * 600, cp_size=4, context_length=None))
    assert plan.made is not None and plan.made.groups is plan.groups
    text = plan.to_json()
    assert text == canonical_json(plan.to_dict()) == Plan.from_json(text).to_json()
    group = plan.groups[0]
    fewer = replace(group, shards=(group.shards[0][:1], *group.shards[1:]))
    other = replace(plan, groups=(fewer,))
    assert other.made is plan.made and other.to_json() == canonical_json(other.to_dict())
    assert other.to_json() != plan.to_json()
