"""Tiles of a windowed varlen call (core/window_tiles.py) against the pair-by-pair count,
and causal segments' tiles of core/step_time/segment_calls.py for windows no position reaches."""

import random

import numpy as np
import pytest

from planner_service.core.step_time import segment_calls as sgw
from planner_service.core.window_tiles import reference_window_tiles, window_tiles_of


@pytest.mark.parametrize("halo", [True, False])
@pytest.mark.parametrize("window", [1, 2, 7, 16, 33, 128, None])
@pytest.mark.parametrize("tiles", [(4, 4), (8, 4), (4, 8), (16, 16)])
def test_tiles_equal_the_pair_by_pair_count(window, tiles, halo):
    rng = random.Random(hash((window, tiles)) & 0xFFFF)
    tile_q, tile_k = tiles
    starts = np.array([rng.randint(0, 150) for _ in range(25)], dtype=np.int64)
    lengths = np.array([rng.randint(1, 70) for _ in range(25)], dtype=np.int64)
    fast = window_tiles_of(starts, lengths, window, tile_q, tile_k, halo=halo)
    slow = [reference_window_tiles(int(s), int(n), window, tile_q, tile_k, halo=halo)
            for s, n in zip(starts, lengths, strict=True)]
    assert fast.tolist() == slow


def test_windows_no_position_reaches_give_the_causal_tiles():
    rng = np.random.default_rng(5)
    starts = rng.integers(0, 100_000, 500)
    lengths = rng.integers(1, 20_000, 500)
    causal = sgw.causal_tiles_of(starts, lengths, 128, 64)
    assert window_tiles_of(starts, lengths, None, 128, 64).tolist() == causal.tolist()
    reach = int((starts + lengths).max())
    assert window_tiles_of(starts, lengths, reach, 128, 64).tolist() == causal.tolist()
    assert window_tiles_of(starts, lengths, reach, 128, 64, halo=False).tolist() == causal.tolist()


def test_a_short_window_visits_a_band():
    # 4,096 queries from position 100,000, window 128, 128 x 128 tiles: keys from 99,873,
    # so query tile j reads key indices [128 j, 128 j + 254]: two key tiles each.
    tiles = window_tiles_of(np.array([100_000]), np.array([4096]), 128, 128, 128)
    assert tiles.tolist() == [64]
    assert sgw.causal_tiles_of(np.array([100_000]), np.array([4096]), 128, 128)[0] > 25_000


def test_empty_input():
    assert window_tiles_of(np.zeros(0, np.int64), np.zeros(0, np.int64), 8, 4, 4).tolist() == []
