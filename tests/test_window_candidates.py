"""flashcp's window-aware candidates (solvers/contiguous_halo.py): the closed-form
weighted prefix and its inverse against a token-by-token sum, the closed-form prices of
contiguous and chunked layouts against ``window_work`` on the built layouts, the
balanced contiguous cut within R and of least largest cut position, and the choice of
flashcp under a mask among them."""

import bisect
import itertools
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.mask import AttentionMask, LayerGroup, parse_layers_text
from planner_service.core.request import PlanRequest
from planner_service.solvers import contiguous_halo as ch
from planner_service.solvers import flashcp_masked
from planner_service.solvers.common import doc_offsets, global_range_shards
from planner_service.solvers.registry import solve

MASKS = ("5x1024,1xfull", "1x128,1xfull", "3x7,2x50,1xfull", "2x5,1x9", "1x1", "4x3,1x1,2xfull")

masks = st.lists(
    st.builds(LayerGroup, st.one_of(st.none(), st.integers(1, 600)), st.integers(1, 6)),
    min_size=1, max_size=4,
).map(lambda groups: AttentionMask(tuple(groups)))
lengths = st.lists(st.integers(1, 3000), min_size=1, max_size=10)


def reference_prefix(doc_lengths, mask):
    """P(c) for every c, position by position."""
    out = [0]
    for length in doc_lengths:
        for p in range(length):
            out.append(out[-1] + sum(g.layers * min(p + 1, g.window or p + 1)
                                     for g in mask.groups))
    return out


def priced(layout, mask):
    """(weighted imbalance, weighted critical path, fullest rank) from window_work."""
    (group,) = layout.groups
    arrays = cost.shard_arrays(group.shards)
    tokens = max(sum(s.end - s.start for s in rank) for rank in group.shards)
    f = ww.mask_figures_of(arrays, mask, comm_mode="alltoallv", tokens_per_rank=tokens)
    return f.imbalance, f.comm_tokens, tokens


@pytest.mark.parametrize("text", MASKS)
def test_the_weighted_prefix_and_its_inverse_equal_the_position_by_position_sums(text):
    rng = random.Random(text)
    mask = parse_layers_text(text)
    doc_lengths = [rng.randint(1, 3000) for _ in range(6)]
    wp = ch.WeightedPrefix(doc_lengths, mask)
    ref = reference_prefix(doc_lengths, mask)
    positions = list(range(len(ref)))
    assert [wp.at(c) for c in positions] == ref
    rng.shuffle(positions)
    assert wp.at_many(positions) == [ref[c] for c in positions]
    for value in [*ref, *(rng.randint(0, ref[-1] + 5) for _ in range(2000))]:
        assert wp.reach(value) == bisect.bisect_right(ref, value) - 1


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(masks, lengths, st.integers(1, 40), st.sampled_from((1.0, 1.01, 1.05, 1.3)))
def test_the_weighted_cut_is_within_r_and_its_price_is_window_works(mask, doc_lengths, n,
                                                                   target):
    wp = ch.WeightedPrefix(doc_lengths, mask)
    total = sum(doc_lengths)
    for cuts in (ch.range_bounds(total, n), ch.weighted_cuts(wp, n, target),
                 ch.weighted_cuts(wp, n, target, -(-total // n) + 3)):
        if not cuts:
            continue
        assert len(cuts) == n + 1 and cuts == sorted(cuts) and (cuts[0], cuts[-1]) == (0, total)
        imb, comm = ch.contiguous_figures(wp, cuts, mask)
        layout = ch.contiguous_layout(doc_lengths, cuts)
        assert (imb, comm) == pytest.approx(priced(layout, mask)[:2], rel=1e-12)
    cuts = ch.weighted_cuts(wp, n, target)
    if cuts:
        loads = np.diff(wp.at_many(cuts))
        assert loads.max() <= target * wp.total / n


@settings(max_examples=40, deadline=None)
@given(masks, st.lists(st.integers(1, 12), min_size=1, max_size=4), st.integers(1, 3))
def test_the_weighted_cut_has_the_least_largest_cut_of_any_balanced_contiguous_cut(
        mask, doc_lengths, n):
    """Exhaustive over every contiguous cut of small inputs: no balanced cut has a
    smaller largest doc position of a rank's first token (to within the bisection's
    1/2^8 of the unbounded cut's)."""
    wp = ch.WeightedPrefix(doc_lengths, mask)
    total, offsets = sum(doc_lengths), doc_offsets(doc_lengths)
    limit = 1.05 * wp.total / n

    def largest(cuts):
        return max((c - offsets[bisect.bisect_right(offsets, c) - 1]
                    for c, d in zip(cuts, cuts[1:], strict=False) if d > c and c < total),
                   default=0)

    best = None
    for inner in itertools.combinations_with_replacement(range(total + 1), n - 1):
        cuts = [0, *inner, total]
        if max(np.diff(wp.at_many(cuts))) <= limit:
            best = largest(cuts) if best is None else min(best, largest(cuts))
    found = ch.weighted_cuts(wp, n, 1.05)
    assert (best is None) == (not found)
    if found:
        assert largest(found) <= best + max(doc_lengths) / 256 + 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(masks, lengths, st.integers(1, 20), st.sampled_from((1, 2, 4, 8)), st.booleans())
def test_chunks_hold_equal_tokens_and_their_price_is_window_works(mask, doc_lengths, n, k,
                                                                 heap):
    total = sum(doc_lengths)
    if k * n > total:
        return
    wp = ch.WeightedPrefix(doc_lengths, mask)
    chunks = ch.chunk_ranks(wp, n, k, heap)
    assert sorted(chunks.held.ravel().tolist()) == list(range(k * n))
    layout = ch.chunked_layout(doc_lengths, chunks)
    imb, comm, most = ch.chunked_figures(wp, chunks, mask)
    want = priced(layout, mask)
    assert (imb, comm, most) == pytest.approx(want, rel=1e-12)
    assert most <= -(-total // (k * n)) * k
    assert chunks.loads == [sum(wp.at(int(chunks.bounds[j + 1])) - wp.at(int(chunks.bounds[j]))
                                for j in held) for held in chunks.held.tolist()]


@pytest.mark.parametrize("heap", [True, False])
def test_chunks_of_weighted_work_beyond_int64_are_exact(heap: bool) -> None:
    """Past 2^61 weighted pairs the prefix and the chunks' work stay Python ints, the
    same figures as ``at`` one by one."""
    mask = parse_layers_text("1x1,65535xfull")
    doc_lengths = [9_000_000, 5, 3]
    wp = ch.WeightedPrefix(doc_lengths, mask)
    assert wp.total >= 1 << 61
    cs = [0, 1, 4_500_000, 9_000_000, 9_000_004, 9_000_008]
    assert wp.at_array(cs).tolist() == wp.at_many(cs) == [wp.at(c) for c in cs]
    chunks = ch.chunk_ranks(wp, 4, 2, heap)
    assert sorted(chunks.held.ravel().tolist()) == list(range(8))
    assert chunks.loads == [sum(wp.at(int(chunks.bounds[j + 1])) - wp.at(int(chunks.bounds[j]))
                                for j in held) for held in chunks.held.tolist()]
    assert sum(chunks.loads) == wp.total


def test_range_shards_are_global_range_shards_range_by_range():
    rng = random.Random(3)
    for _ in range(300):
        doc_lengths = [rng.randint(1, rng.choice((5, 300, 5000)))
                       for _ in range(rng.randint(1, 10))]
        k, n = rng.choice((1, 2, 3)), rng.randint(1, 8)
        points = sorted(rng.randint(0, sum(doc_lengths)) for _ in range(2 * k * n))
        starts, ends = np.array(points[0::2]), np.array(points[1::2])
        offsets = doc_offsets(doc_lengths)
        assert ch.range_shards(doc_lengths, starts, ends, k) == [
            [s for i in range(r * k, (r + 1) * k)
             for s in global_range_shards(offsets, int(starts[i]), int(ends[i]))]
            for r in range(n)]


@pytest.mark.parametrize("text", ("5x1024,1xfull", "1x128,1xfull"))
def test_flashcp_takes_the_least_exchange_within_r_and_pads_at_most_r(text):
    mask = parse_layers_text(text)
    rng = random.Random(text)
    for _ in range(20):
        doc_lengths = tuple(rng.choice((rng.randint(1, 2000), rng.randint(1, 40000)))
                            for _ in range(rng.randint(1, 20)))
        n = rng.choice((2, 4, 8, 32))
        plan = solve(PlanRequest(doc_lengths=doc_lengths, cp_size=n, mask=mask))
        candidates = plan.info["mask_candidates"]
        within = [c for c in candidates if c["weighted_imbalance"] <= 1.05]
        chosen = next(c for c in candidates if c["candidate"] == plan.info["mask_candidate"])
        if within:
            assert chosen["weighted_comm_tokens"] == min(c["weighted_comm_tokens"]
                                                         for c in within)
            assert plan.metrics.imbalance <= 1.05
        assert chosen["weighted_comm_tokens"] == plan.metrics.comm_tokens
        assert chosen["max_tokens"] <= 1.05 * -(-sum(doc_lengths) // n)


def test_per_doc_is_the_last_resort_only_up_to_its_chunk_bound(monkeypatch):
    """One 21-token document on 8 ranks meets R under no candidate, so every fallback
    runs; past ``PER_DOC_CHUNKS`` (2 N chunks a document) per_doc is left out."""
    request = PlanRequest(doc_lengths=(21,), cp_size=8, mask=parse_layers_text("1x128,1xfull"))

    def names():
        return [c["candidate"] for c in solve(request).info["mask_candidates"]]

    assert names()[-3:] == ["flashcp R=1.025", "flashcp R=1.0125", "per_doc"]
    monkeypatch.setattr(flashcp_masked, "PER_DOC_CHUNKS", 2 * 8 - 1)
    assert names()[-2:] == ["flashcp R=1.025", "flashcp R=1.0125"]
