"""Cost formulas against hand-computed cases (docs/plan.md, Cost accounting)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner_service.core import cost
from planner_service.core.model import ModelSpec
from planner_service.core.plan import Shard
from planner_service.core.profiles import KERNEL_PROFILES, LINK_PROFILES
from planner_service.core.step_time import attention_tiles, rank_step, transfer_ms


def brute_workload(start: int, end: int) -> int:
    # Query at doc position i attends keys 0..i: i + 1 pairs.
    return sum(i + 1 for i in range(start, end))


@pytest.mark.parametrize("start,length", [(0, 1), (0, 10), (5, 3), (7, 4), (100, 101), (0, 4096)])
def test_shard_workload_matches_paper_formula_and_brute_force(start, length):
    paper = (2 * start + length + 1) * length / 2  # FlashCP: W = (2p + s + 1) * s / 2
    assert cost.shard_workload(start, length) == paper == brute_workload(start, start + length)


def test_whole_doc_workload_is_l_l_plus_1_over_2():
    assert cost.doc_workload(4) == 10
    assert cost.doc_workload(131072) == 131072 * 131073 // 2
    # Splitting a doc never changes its total workload.
    assert cost.shard_workload(0, 3) + cost.shard_workload(3, 5) == cost.doc_workload(8)


def test_imbalance_is_max_over_mean():
    assert cost.imbalance([10, 10, 10]) == 1.0
    assert cost.imbalance([30, 10, 20]) == pytest.approx(1.5)
    assert cost.imbalance([0, 0]) == 1.0


def test_comm_volumes_hand_computed():
    # Doc 0 (len 10): rank 0 holds [0,4), rank 1 holds [4,7), rank 2 holds [7,10).
    # Doc 1 (len 5) whole on rank 0: never moves.
    ranks = [
        [Shard(0, 0, 4), Shard(1, 0, 5)],
        [Shard(0, 4, 7)],
        [Shard(0, 7, 10)],
    ]
    v = cost.comm_volumes(ranks)
    # all-to-all-v: rank 1 needs [0,4) -> 4; rank 2 needs [0,7) -> 7; rank 0 needs nothing.
    assert v.alltoallv_recv == (0, 4, 7)
    assert v.alltoallv_tokens == 7
    # all-gather buffers: rank 0 sends [0,4) (others need up to 7), rank 1 sends [4,7)
    # (rank 2 needs up to 7), rank 2 sends nothing (the last shard).
    assert v.allgather_send == (4, 3, 0)
    assert v.compact_allgather_tokens == 2 * 4
    assert cost.full_exchange_tokens(3, 9) == 18
    assert cost.recv_tokens_by_mode("full", v, 9) == (18, 18, 18)
    assert cost.recv_tokens_by_mode("compact_allgather", v, 9) == (8, 8, 8)
    assert cost.saving(7, 18) == pytest.approx(11 / 18)


def test_comm_volumes_zigzag_two_shards_on_one_rank():
    # Zigzag of a 8-token doc on 2 ranks: rank 0 [0,2)+[6,8), rank 1 [2,6).
    v = cost.comm_volumes([[Shard(0, 0, 2), Shard(0, 6, 8)], [Shard(0, 2, 6)]])
    assert v.alltoallv_recv == (4, 2)  # rank 0 lacks [2,6); rank 1 lacks [0,2)
    assert v.allgather_send == (2, 4)  # rank 0: [0,2) needed by rank 1 (up to 6); rank 1: [2,6)


@st.composite
def random_layouts(draw):
    """Docs of 1-12 tokens cut at random points, pieces dealt to 1-5 ranks at random."""
    n = draw(st.integers(1, 5))
    ranks: list[list[Shard]] = [[] for _ in range(n)]
    for doc, length in enumerate(draw(st.lists(st.integers(1, 12), min_size=1, max_size=5))):
        cuts = sorted(draw(st.sets(st.integers(1, length - 1), max_size=length - 1)) if length > 1 else set())
        bounds = [0, *cuts, length]
        for a, b in zip(bounds, bounds[1:], strict=False):
            ranks[draw(st.integers(0, n - 1))].append(Shard(doc, a, b))
    return ranks


def token_level_volumes(ranks):
    """The definitions token by token: a rank needs every key position below the end of
    its last shard of a doc; it receives the ones it does not hold; it sends a held
    position if some other rank needs it."""
    held = [{(s.doc, i) for s in rank for i in range(s.start, s.end)} for rank in ranks]
    need = [{(s.doc, i) for s in rank for i in range(s.end)} for rank in ranks]
    recv = tuple(len(need[r] - held[r]) for r in range(len(ranks)))
    send = tuple(
        sum(1 for t in held[r] if any(t in need[o] for o in range(len(ranks)) if o != r))
        for r in range(len(ranks))
    )
    return recv, send


@settings(max_examples=300, deadline=None)
@given(random_layouts())
def test_comm_volumes_equal_the_token_level_definition(ranks):
    v = cost.comm_volumes(ranks)
    assert (v.alltoallv_recv, v.allgather_send) == token_level_volumes(ranks)


def test_kv_bytes_per_token_and_linear_flops():
    m = ModelSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    assert m.kv_bytes_per_token == 2 * 8 * 128 * 2
    # Llama-3-8B layer: 218,103,808 params -> 6x per token.
    assert m.linear_flops_per_token == 6 * (4096 * (4096 + 2048) + 4096 * 4096 + 3 * 4096 * 14336)


def test_attention_tiles_hand_computed():
    # 256 queries at the start of a doc, 128x128 tiles: query tile 0 reads 1 key tile,
    # query tile 1 reads 2 -> 3 tiles.
    assert attention_tiles([Shard(0, 0, 256)], 128, 128) == 3
    # 1 query at position 1000: one query tile reading ceil(1001/128) = 8 key tiles.
    assert attention_tiles([Shard(0, 1000, 1001)], 128, 128) == 8
    # A 1-token shard costs a full tile: tile quantisation.
    assert attention_tiles([Shard(0, 0, 1)], 128, 128) == 1
    # With 1x1 tiles the count is the exact workload.
    assert attention_tiles([Shard(0, 5, 9)], 1, 1) == cost.shard_workload(5, 4)


def test_short_shards_run_slower_per_pair():
    m, k, link = ModelSpec(), KERNEL_PROFILES["h100-fa3"], LINK_PROFILES["nvlink"]
    one_long = [Shard(0, 0, 8192)]
    many_short = [Shard(d, 0, 64) for d in range(128)]  # same tokens, far fewer pairs

    def attn_ms(shards):
        return rank_step(
            shards,
            recv_tokens=0,
            tokens_per_rank=8192,
            num_ranks=1,
            comm_mode="full",
            model=m,
            kernel=k,
            link=link,
        ).attn_ms

    long_t, short_t = attn_ms(one_long), attn_ms(many_short)
    pairs_long = cost.doc_workload(8192)
    pairs_short = 128 * cost.doc_workload(64)
    assert short_t / pairs_short > 5 * long_t / pairs_long


def test_transfer_is_latency_plus_bytes_over_bandwidth():
    link = LINK_PROFILES["infiniband"]
    assert transfer_ms(0, link) == pytest.approx(link.latency_us / 1e3)
    assert transfer_ms(45_000_000, link) == pytest.approx(link.latency_us / 1e3 + 1.0)


@settings(max_examples=300, deadline=None)
@given(random_layouts())
def test_alltoallv_receives_equal_the_reference_and_comm_volumes(ranks):
    fast = cost.alltoallv_receives(ranks)
    assert fast == cost.alltoallv_receives_reference(ranks)
    assert tuple(fast) == cost.comm_volumes(ranks).alltoallv_recv
    for shards in ranks:
        docs = [s.doc for s in shards]
        repeated = {doc for doc in docs if docs.count(doc) > 1}
        assert sorted(cost.rank_receive(shards)[1]) == sorted(repeated)


@pytest.mark.parametrize("size", [0, 1, 5, 39, cost.LEX_CHECK_MIN - 1, cost.LEX_CHECK_MIN, 700])
@pytest.mark.parametrize("seed", range(3))
def test_lex_order_is_lexsort(size: int, seed: int) -> None:
    """``lex_order`` returns ``np.lexsort``'s permutation, sorted input (the skipped
    sort) or not, with ties, below and above the size where it checks the order."""
    rng = np.random.default_rng(seed)
    for num_keys in (1, 2, 3):
        keys = [rng.integers(0, 4, size) for _ in range(num_keys)]
        assert np.array_equal(cost.lex_order(keys), np.lexsort(keys))
        ordered = [k[np.lexsort(keys)] for k in keys]
        assert np.array_equal(cost.lex_order(ordered), np.arange(size))
        if size > 1:  # one entry out of order
            ordered[-1] = ordered[-1].copy()
            ordered[-1][0] = 5
            assert np.array_equal(cost.lex_order(ordered), np.lexsort(ordered))


@pytest.mark.parametrize("size", [0, 1, 2, 50, 2000])
@pytest.mark.parametrize("seed", range(4))
def test_stable_lexsort_is_lexsort(size: int, seed: int) -> None:
    """``stable_lexsort`` returns ``np.lexsort``'s permutation: keys that fit one int64 side
    by side (negative ones too, with ties, in sorted runs as canonical shards come) and
    keys too wide for it (the fallback)."""
    rng = np.random.default_rng(seed)
    for num_keys in (1, 2, 3, 4):
        for high in (3, 1 << 20, 1 << 40):
            keys = [rng.integers(-high, high, size) for _ in range(num_keys)]
            assert np.array_equal(cost.stable_lexsort(keys), np.lexsort(keys))
            runs = [np.concatenate([np.sort(part) for part in np.array_split(k, 4)]) for k in keys]
            assert np.array_equal(cost.stable_lexsort(runs), np.lexsort(runs))
