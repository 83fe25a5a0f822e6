"""The windowed all-to-all-v's transfers (core/halo_map.py) against the keys moved,
token by token, and the receive volumes of core/window_work.py."""

import random

import numpy as np
import pytest

from planner_service.core import cost
from planner_service.core import halo_map as hm
from planner_service.core import window_work as ww
from tests.test_core_window_work import random_plan


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("window", [1, 2, 7, 128, None])
def test_transfers_move_exactly_the_keys_attended(seed, window):
    rng = random.Random(300 + seed)
    plan = random_plan(rng, rng.randint(1, 6), rng.randint(1, 5), 40)
    arrays = cost.shard_arrays(plan)
    transfers = hm.halo_transfers_of(arrays, window)
    assert (transfers.hi > transfers.lo).all() and (transfers.sender != transfers.receiver).all()
    moved: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for receiver, sender, doc, lo, hi in zip(*transfers, strict=True):
        keys = moved.setdefault((int(sender), int(receiver)), set())
        new = {(int(doc), p) for p in range(int(lo), int(hi))}
        assert not keys & new  # no key twice
        keys |= new
    assert moved == hm.reference_halo_keys(plan, window)
    matrix = hm.transfer_matrix(transfers, len(plan))
    assert tuple(matrix.sum(axis=0).tolist()) == \
        ww.window_comm_volumes_of(arrays, window).alltoallv_recv


def test_a_contiguous_cut_moves_one_halo_per_cut():
    plan = [[(0, 1000 * i, 1000 * (i + 1))] for i in range(4)]
    transfers = hm.halo_transfers_of(cost.shard_arrays(plan), 64)
    assert list(zip(transfers.sender.tolist(), transfers.receiver.tolist(),
                    transfers.lo.tolist(), transfers.hi.tolist(), strict=True)) == [
        (0, 1, 937, 1000), (1, 2, 1937, 2000), (2, 3, 2937, 3000)]
    assert hm.transfer_matrix(transfers, 4).sum() == 3 * 63
    assert np.array_equal(hm.transfer_matrix(hm.halo_transfers_of(cost.shard_arrays(plan), 1), 4),
                          np.zeros((4, 4), dtype=np.int64))
