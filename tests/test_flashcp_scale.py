"""flashcp at any scale: degenerate and adversarial inputs, the objective of the request's
exchange, the fast passes against their slow references, and a cold start without the
slow strategies' libraries."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.scale import mixed_lengths
from planner_service.core.cost import alltoallv_receives, doc_workload
from planner_service.core.request import PlanRequest, debug_request
from planner_service.core.validate import validate_plan
from planner_service.data import make_source, pack_sequences
from planner_service.solvers.flashcp import algorithm1, nested, paper, place
from planner_service.solvers.flashcp.ranks import Ranks, whole_shards, zigzag
from planner_service.solvers.registry import get_strategy, solve

ADVERSARIAL = [
    pytest.param([131072], 1, id="one-doc-N1"),
    pytest.param([131072], 17, id="one-doc-N17"),
    pytest.param([131072], 64, id="one-doc-N64"),
    pytest.param([131072], 1024, id="one-doc-N1024"),
    pytest.param([32768] * 4, 1024, id="four-docs-N1024"),
    pytest.param([1] * 300, 1024, id="300-one-token-N1024"),
    pytest.param([7] * 100, 999, id="100x7-N999"),
    pytest.param([1] * 3000, 8, id="3000-one-token-N8"),
    pytest.param([1] * 3000, 1024, id="3000-one-token-N1024"),
    pytest.param([3, 1, 2], 1024, id="more-ranks-than-tokens"),
    pytest.param([131072, 1, 1, 1], 33, id="one-doc-and-crumbs-N33"),
]


@pytest.mark.parametrize("mode", ["alltoallv", "compact_allgather", "full"])
@pytest.mark.parametrize(("doc_lengths", "n"), ADVERSARIAL)
def test_adversarial_inputs_solve_and_validate(doc_lengths, n, mode):
    request = PlanRequest(doc_lengths=tuple(doc_lengths), cp_size=n, context_length=None,
                          comm_mode=mode)
    plan = solve(request)  # validates
    assert plan.metrics.tokens_per_rank == -(-sum(doc_lengths) // n)


@pytest.mark.parametrize("n", [64, 1024])
def test_packed_sequences_at_many_ranks_validate(n):
    for seq in pack_sequences(make_source("pile"), context_length=131072, num_sequences=2, seed=4):
        validate_plan(solve(PlanRequest(doc_lengths=tuple(seq), cp_size=n, context_length=131072)))


FIGURE = {"alltoallv": "alltoallv_tokens", "compact_allgather": "compact_allgather_tokens"}


def requests():
    yield debug_request()
    yield debug_request(doc_lengths=(4099, 37, 1023, 8191, 1, 511))
    for dataset, n in (("code", 8), ("wlbllm", 4), ("pile", 8)):
        for seq in pack_sequences(make_source(dataset), context_length=32768, num_sequences=4,
                                  seed=5):
            yield PlanRequest(doc_lengths=tuple(seq), cp_size=n, context_length=32768)


@pytest.mark.parametrize(("mode", "other"), [("alltoallv", "compact_allgather"),
                                             ("compact_allgather", "alltoallv")])
def test_flashcp_minimises_the_figure_of_the_requested_exchange(mode, other):
    """The same request under two modes: each plan's figure for its own mode is no worse
    than the other plan's figure for that mode, both within R."""
    differ = 0
    for request in requests():
        ours = solve(replace(request, comm_mode=mode))
        theirs = solve(replace(request, comm_mode=other))
        assert ours.metrics.imbalance <= request.imbalance_target
        assert getattr(ours.metrics, FIGURE[mode]) <= getattr(theirs.metrics, FIGURE[mode])
        differ += ours.to_json() != theirs.to_json()
    assert differ  # the mode changes some plans


def test_compact_allgather_never_sends_more_than_algorithm1_at_the_same_r():
    for request in requests():
        ours = solve(replace(request, comm_mode="compact_allgather"))
        published = solve(replace(request, strategy="flashcp_paper"))
        if published.metrics.imbalance <= request.imbalance_target:
            assert ours.metrics.compact_allgather_tokens <= published.metrics.compact_allgather_tokens


def test_flashcp_paper_is_algorithm1_under_compact_allgather():
    request = debug_request(strategy="flashcp_paper")
    plan = solve(request)
    assert get_strategy("flashcp_paper").comm_mode == "compact_allgather"
    assert plan.metrics.comm_mode == "compact_allgather"
    _, ranks, per_doc = algorithm1(request.doc_lengths, request.cp_size, request.imbalance_target)
    assert plan.info["per_doc_docs"] == per_doc
    assert sorted(map(tuple, plan.groups[0].shards[0])) == sorted(map(tuple, ranks.shards[0]))


# --- Slow references: the fast passes must choose exactly as the plain scans do. ---


def reference_place(doc_lengths, order, n, allowed, fill_aware, total_work):
    """``place.place`` by plain scans over every rank per doc (no heaps, no numpy)."""
    rest_tokens = sum(doc_lengths)
    rest_work = total_work
    cap = -(-rest_tokens // n)
    ranks = Ranks(n, cap)
    tokens, work = ranks.tokens, ranks.work
    spill = []
    for doc in order:
        length = doc_lengths[doc]
        doc_work = doc_workload(length)
        rest_tokens -= length
        rest_work -= doc_work
        density = rest_work / rest_tokens if rest_tokens else 0.0
        best, best_lag = -1, float("-inf")
        for r in range(n):
            if tokens[r] <= cap - length:
                lag = tokens[r] * density - work[r]
                if lag > best_lag:
                    best, best_lag = r, lag
        if best >= 0 and work[best] + doc_work <= allowed:
            ranks.add(best, doc, 0, length)
            continue
        if min(work) + doc_work <= allowed or length < 2:
            spill.append((doc, length))
            continue
        by_lag = sorted(range(n), key=lambda r: (work[r] - tokens[r] * density, r))
        fill = density if fill_aware else 0.0
        chosen = None
        widest = min(n, length)
        for m in range(2, widest + 1):
            fit = [r for r in by_lag if cap - tokens[r] >= -(-length // m)][:m]
            if len(fit) == m and (m == widest or max(
                place.ends(ranks, r, length / m, doc_work / m, fill) for r in fit
            ) <= allowed):
                chosen = fit
                break
        if chosen is None:
            spill.append((doc, length))
            continue
        needs = alltoallv_receives(ranks.shards)
        chosen.sort(key=needs.__getitem__)
        zigzag(ranks, chosen, doc, length)
    return ranks, spill


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    doc_lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=30),
    n=st.integers(2, 8),
    target=st.sampled_from([1.0, 1.05, 1.3]),
    fill_aware=st.booleans(),
    heavy_first=st.booleans(),
)
def test_place_equals_the_plain_scan(doc_lengths, n, target, fill_aware, heavy_first):
    order = sorted(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
    if heavy_first:  # an order whose density rises somewhere
        order = order[len(order) // 2:] + order[:len(order) // 2]
    total = sum(map(doc_workload, doc_lengths))
    allowed = target * total / n
    fast, fast_spill = place.place(doc_lengths, order, n, allowed, fill_aware, total)
    slow, slow_spill = reference_place(doc_lengths, order, n, allowed, fill_aware, total)
    assert fast.shards == slow.shards and fast_spill == slow_spill


def reference_whole_doc(ranks, docs):
    """Algorithm 1's LPT with a full scan per doc: the least loaded rank with room."""
    spill = []
    for doc, length in docs:
        fits = [r for r in range(len(ranks.work)) if ranks.capacity - ranks.tokens[r] >= length]
        if fits:
            ranks.add(min(fits, key=lambda r: (ranks.work[r], r)), doc, 0, length)
        else:
            spill.append((doc, length))
    reference_split_spill(ranks, spill, tail_largest=False)


def reference_split_spill(ranks, spill, *, tail_largest):
    for doc, length in spill:
        room = [ranks.capacity - t for t in ranks.tokens]
        chosen, covered = [], 0
        for rank in sorted(range(len(room)), key=lambda r: (-room[r], r)):
            if covered >= length or room[rank] <= 0:
                break
            chosen.append(rank)
            covered += room[rank]
        if tail_largest:
            pieces, left = [], length
            for rank in chosen:
                pieces.append((rank, min(room[rank], left)))
                left -= pieces[-1][1]
            pieces.reverse()
        else:
            chosen.sort(key=lambda r: (-ranks.work[r], r))
            pieces, left = [], length
            for i, rank in enumerate(chosen):
                pieces.append((rank, left if i == len(chosen) - 1 else min(left, room[rank])))
                left -= pieces[-1][1]
        start = 0
        for rank, take in pieces:
            if take > 0:
                ranks.add(rank, doc, start, start + take)
            start += take


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    doc_lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=40),
    n=st.integers(1, 12),
    zigzagged=st.integers(0, 3),
    tail_largest=st.booleans(),
)
def test_whole_doc_and_split_spill_equal_the_plain_scans(doc_lengths, n, zigzagged, tail_largest):
    order = sorted(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
    cap = -(-sum(doc_lengths) // n)
    layouts = []
    for whole, split in ((paper.whole_doc, paper.split_spill),
                         (reference_whole_doc, reference_split_spill)):
        ranks = Ranks(n, cap)
        for doc in order[:zigzagged]:
            zigzag(ranks, list(range(n)), doc, doc_lengths[doc])
        docs = [(d, doc_lengths[d]) for d in order[zigzagged:]]
        if tail_largest:
            split(ranks, docs, tail_largest=True)
        else:
            whole(ranks, docs)
        layouts.append(ranks.shards)
    assert layouts[0] == layouts[1]


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.data())
def test_nested_chunks_stay_valid_with_many_roles(data):
    """Up to 64 roles (a search the node budget cuts short): whatever comes back covers
    the doc once within every role's limits."""
    length = data.draw(st.integers(64, 5000))
    m = data.draw(st.integers(9, 64))
    roles = [nested.Role(data.draw(st.integers(0, length)), data.draw(st.integers(0, 10**7)),
                         data.draw(st.integers(0, 200))) for _ in range(m)]
    bound = data.draw(st.integers(0, 2 * length))
    chunks = nested.nested_chunks(length, roles, bound, 0.0)
    if chunks is None:
        return
    held = [{p for a, b in pair for p in range(a, b)} for pair in chunks]
    assert sorted(p for positions in held for p in positions) == list(range(length))
    for role, positions in zip(roles, held, strict=False):
        assert len(positions) <= role.room
        assert sum(p + 1 for p in positions) <= role.budget + 1e-6
        assert role.need + (max(positions) + 1 - len(positions) if positions else 0) <= bound


COLD = """
import sys
import planner_service.core.plan, planner_service.core.validate
assert not [m for m in sys.modules if m.startswith("planner_service.solvers")], "solvers loaded"
from planner_service import PlanRequest, solve
for strategy in ("flashcp", "flashcp_paper", "llama3", "per_doc", "ring", "zigzag"):
    solve(PlanRequest(doc_lengths=(4099, 37, 1023, 8191, 1, 511), cp_size=4, strategy=strategy))
slow = sorted({m.split(".")[0] for m in sys.modules} & {"ortools", "pandas", "torch"})
assert not slow, slow
"""


def test_cold_start_loads_neither_or_tools_nor_pandas():
    subprocess.run([sys.executable, "-c", COLD], check=True)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=6), st.integers(1, 40))
def test_per_doc_zigzag_equals_zigzag_doc_shards(doc_lengths, n):
    from planner_service.solvers.common import zigzag_doc_shards
    from planner_service.solvers.flashcp.paper import per_doc_zigzag

    cap = -(-sum(doc_lengths) // n)
    fast, slow = Ranks(n, cap), Ranks(n, cap)
    for doc, length in enumerate(doc_lengths):
        per_doc_zigzag(fast, doc, length)
        for rank, shard in zigzag_doc_shards(doc, length, n, np.array(slow.tokens)):
            slow.add(rank, shard.doc, shard.start, shard.end)
        assert (fast.shards, fast.tokens, fast.work) == (slow.shards, slow.tokens, slow.work)


def zigzag_reference(ranks, chosen, doc, length):
    """``ranks.zigzag`` chunk by chunk: 2m chunks, the L mod 2m extra tokens one each to
    chunks 0, 1, ..., m - 1, then 2m - 1, 2m - 2, ...; chunk i and 2m - 1 - i on the i-th
    rank, added by ``Ranks.add``."""
    m = len(chosen)
    base, extra = divmod(length, 2 * m)
    sizes = [base] * (2 * m)
    for k in range(extra):
        sizes[k if k < m else 2 * m - 1 - (k - m)] += 1
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    for i, rank in enumerate(chosen):
        for chunk in (i, 2 * m - 1 - i):
            if sizes[chunk]:
                ranks.add(rank, doc, starts[chunk], starts[chunk + 1])


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12), st.data())
def test_zigzag_equals_the_chunk_by_chunk_reference(n, data):
    fast, slow = Ranks(n, 10**6), Ranks(n, 10**6)
    for doc in range(data.draw(st.integers(1, 4))):
        chosen = data.draw(st.permutations(range(n)))[: data.draw(st.integers(1, n))]
        length = data.draw(st.integers(1, 60))
        zigzag(fast, chosen, doc, length)
        zigzag_reference(slow, chosen, doc, length)
        assert (fast.shards, fast.tokens, fast.work) == (slow.shards, slow.tokens, slow.work)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=6),
                min_size=1, max_size=5))
def test_zigzagged_equals_the_shard_by_shard_reference(per_rank):
    from planner_service.core.plan import Shard
    from planner_service.solvers.flashcp.ranks import zigzagged, zigzagged_reference

    ranks = Ranks(len(per_rank), 100)
    ranks.shards = [[Shard(doc, start, start + 1) for doc, start in rank] for rank in per_rank]
    assert zigzagged(ranks) == zigzagged_reference(ranks)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=6),
                min_size=1, max_size=5))
def test_measure_equals_the_receive_and_zigzagged_references(per_rank):
    from planner_service.core.cost import alltoallv_receives_reference
    from planner_service.core.plan import Shard
    from planner_service.solvers.flashcp.ranks import measure, zigzagged_reference

    ranks = Ranks(len(per_rank), 100)
    ranks.shards = [[Shard(doc, start, start + 1 + doc) for doc, start in rank] for rank in per_rank]
    assert measure(ranks) == (max(alltoallv_receives_reference(ranks.shards)),
                              zigzagged_reference(ranks))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.data())
def test_mirrored_arrays_equal_a_fresh_conversion(n, data):
    work = data.draw(st.lists(st.integers(0, 2**61), min_size=n, max_size=n))
    tokens = data.draw(st.lists(st.integers(0, 2**31), min_size=n, max_size=n))
    mirror = None
    for _ in range(data.draw(st.integers(1, 6))):
        touched = data.draw(st.lists(st.integers(0, n - 1), max_size=n))
        for r in touched:
            work[r] = data.draw(st.integers(0, 2**61))
            tokens[r] = data.draw(st.integers(0, 2**31))
        mirror = place.mirrored(mirror, work, tokens, touched)
        assert mirror[0].tolist() == [float(w) for w in work]
        assert mirror[1].tolist() == [float(t) for t in tokens]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    runs=st.lists(st.tuples(st.integers(1, 400), st.integers(1, 300)), min_size=1, max_size=5),
    n=st.integers(2, 8),
    target=st.sampled_from([1.0, 1.02, 1.05, 1.3]),
    fill_aware=st.booleans(),
    shuffle=st.sampled_from(["longest", "heavy_first", "runs_as_given"]),
)
def test_place_with_long_runs_of_equal_docs_equals_the_plain_scan(runs, n, target, fill_aware,
                                                                  shuffle):
    """Runs of at least ``runs.RUN_MIN`` equal docs go by ``few.place_run``: the same
    layout as the plain scan, doc by doc."""
    doc_lengths = [length for length, count in runs for _ in range(count)]
    order = sorted(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
    if shuffle == "heavy_first":  # the density rises somewhere
        order = order[len(order) // 3:] + order[:len(order) // 3]
    elif shuffle == "runs_as_given":
        order = list(range(len(doc_lengths)))
    total = sum(map(doc_workload, doc_lengths))
    allowed = target * total / n
    fast, fast_spill = place.place(doc_lengths, order, n, allowed, fill_aware, total)
    slow, slow_spill = reference_place(doc_lengths, order, n, allowed, fill_aware, total)
    assert fast.shards == slow.shards and fast_spill == slow_spill
    assert (fast.tokens, fast.work) == (slow.tokens, slow.work)


def whole_doc_case(seed: int) -> tuple[list[int], int, int]:
    """(doc lengths, ranks, docs zigzagged first) with long runs of equal docs: mixed
    lengths, thousands of 1-token docs, ties from empty ranks, more ranks than tokens."""
    rng = random.Random(seed)
    n = (1, 3, 8, 100, 1024)[seed % 5]
    kind = seed % 4
    if kind == 0:  # runs of a few lengths, some longer docs first
        lengths = [rng.randint(100, 4000) for _ in range(rng.randint(0, 30))]
        for length in rng.sample(range(1, 60), 4):
            lengths += [length] * rng.randint(1, 1500)
    elif kind == 1:  # thousands of 1-token docs
        lengths = [1] * rng.randint(1, 4000) + [rng.randint(1, 50) for _ in range(20)]
    elif kind == 2:  # more ranks than tokens, or one doc
        lengths = [1] * rng.randint(1, max(1, n // 2)) if seed % 2 else [rng.randint(1, 500)]
    else:  # one long run on empty ranks (every rank ties)
        lengths = [rng.randint(1, 9)] * rng.randint(128, 3000)
    return lengths, n, rng.randint(0, 2) if kind == 0 else 0


@pytest.mark.parametrize("seed", range(20))
def test_whole_doc_runs_in_blocks_equal_the_plain_scan(seed, monkeypatch):
    """Runs of equal docs placed in one block (``paper.lpt_run``; every run, with
    ``WHOLE_RUN`` = 1, on the odd seeds) give the same layout as LPT doc by doc."""
    if seed % 2:
        monkeypatch.setattr(paper, "WHOLE_RUN", 1)
    doc_lengths, n, zigzagged = whole_doc_case(seed)
    order = sorted(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
    cap = -(-sum(doc_lengths) // n)
    layouts = []
    for whole in (paper.whole_doc, reference_whole_doc):
        # The shared whole shards (``ranks.whole_shards``) on every other even seed.
        ranks = Ranks(n, cap, whole_shards(doc_lengths) if whole is paper.whole_doc
                      and seed % 4 == 0 else None)
        for doc in order[:zigzagged]:
            zigzag(ranks, list(range(n)), doc, doc_lengths[doc])
        whole(ranks, [(d, doc_lengths[d]) for d in order[zigzagged:]])
        layouts.append((ranks.shards, ranks.tokens, ranks.work))
    assert layouts[0] == layouts[1]


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    doc_lengths=st.lists(st.integers(1, 300), min_size=1, max_size=60),
    n=st.integers(1, 12),
    spilled=st.integers(1, 60),
    tail_largest=st.booleans(),
)
def test_split_spill_of_docs_that_fit_equals_the_plain_scan(doc_lengths, n, spilled, tail_largest):
    """``paper.split_spill`` of docs some rank holds whole (one piece there) and of docs
    that must be split, after LPT has placed the others, in both piece orders."""
    order = sorted(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
    cap = -(-sum(doc_lengths) // n) + 5
    layouts = []
    for whole, split in ((paper.whole_doc, paper.split_spill),
                         (reference_whole_doc, reference_split_spill)):
        ranks = Ranks(n, cap)
        whole(ranks, [(d, doc_lengths[d]) for d in order[spilled:]])
        split(ranks, [(d, doc_lengths[d]) for d in order[:spilled]], tail_largest=tail_largest)
        layouts.append((ranks.shards, ranks.tokens, ranks.work))
    assert layouts[0] == layouts[1]


@pytest.mark.parametrize("source", ["wlbllm", "code"])
def test_place_with_shared_whole_shards_equals_place_without(source):
    """``place.place`` gives the same layout whether the docs' whole shards are shared
    (``ranks.whole_shards``) or made as each doc is placed."""
    doc_lengths = mixed_lengths(source, 3000, 60_000)
    n = 256
    order = sorted(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
    total = sum(map(doc_workload, doc_lengths))
    for fill_aware in (False, True):
        made, made_spill = place.place(doc_lengths, order, n, 1.05 * total / n, fill_aware, total)
        shared, shared_spill = place.place(doc_lengths, order, n, 1.05 * total / n, fill_aware,
                                           total, whole=whole_shards(doc_lengths))
        assert (made.shards, made.tokens, made.work, made_spill) == (
            shared.shards, shared.tokens, shared.work, shared_spill)
