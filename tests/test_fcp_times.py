"""Stage 2 on the entries that count (fcp/times.py) against the whole table (fcp/dp.py):
the same makespan and degrees on any table, and the same entries bit for bit."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from planner_service.fcp.cost_model import PROFILES, time_table
from planner_service.fcp.dp import fill_spare_ranks, threshold_degrees
from planner_service.fcp.times import Pool, Times, fill_spare, window_degrees


class TableTimes:
    """A ``Times`` read from an explicit (K, N + 1) table (any values, inf below each
    row's first finite degree)."""

    small = False  # always the window search

    def __init__(self, table: np.ndarray) -> None:
        self.table = table
        self.k, self.n = table.shape[0], table.shape[1] - 1

    def at(self, rows: np.ndarray, degrees: np.ndarray) -> np.ndarray:
        return self.table[np.asarray(rows, dtype=np.int64), np.asarray(degrees, dtype=np.int64)]

    def min_degrees(self) -> np.ndarray:
        return np.isfinite(self.table).argmax(axis=1)


tables = st.integers(1, 6).flatmap(lambda k: st.integers(1, 9).flatmap(lambda n: st.tuples(
    st.lists(st.lists(st.floats(0.1, 100.0), min_size=n, max_size=n), min_size=k, max_size=k),
    st.lists(st.integers(1, n), min_size=k, max_size=k),
)))


@settings(max_examples=200, deadline=None)
@given(tables)
def test_window_degrees_equal_threshold_degrees_on_any_table(data):
    values, d_min = data
    table = np.array([[np.inf] + row for row in values])
    for i, d in enumerate(d_min):
        table[i, :d] = np.inf
    dense = threshold_degrees(table)
    found = window_degrees(TableTimes(table))  # type: ignore[arg-type]
    assert found.makespan_ms == dense.makespan_ms or (
        np.isinf(found.makespan_ms) and np.isinf(dense.makespan_ms))
    assert found.degrees == dense.degrees
    if found.degrees:
        n = table.shape[1] - 1
        assert (fill_spare(TableTimes(table), found.degrees, n)  # type: ignore[arg-type]
                == fill_spare_ranks(table, dense.degrees, n))


def _groups(rng: np.random.Generator, k: int, memory: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = rng.lognormal(8.0, 1.5, size=(k, 3)).astype(np.int64) + 1
    tokens = lengths.sum(axis=1).astype(np.float64)
    units = (lengths.astype(np.float64) ** 2).sum(axis=1)
    return tokens, units


def test_times_are_the_table_bit_for_bit_and_give_its_optimum(monkeypatch):
    import planner_service.fcp.times as times_module

    monkeypatch.setattr(times_module, "DENSE_LIMIT", 0)  # the window search on every size
    rng = np.random.default_rng(0)
    for profile in PROFILES.values():
        for k, n, memory in ((1, 1, 65536), (5, 8, 4096), (40, 64, 8192), (120, 500, 4096),
                             (60, 1500, 65536)):
            tokens, units = _groups(rng, k, memory)
            if int(np.ceil(tokens / memory).clip(1).sum()) > n:
                continue
            for pool in (None, Pool(3.0, 40.0, 7, 5000)):
                times = Times(tokens, units, n, memory, profile, pool)
                dense = times.dense()
                if pool is None:
                    assert np.array_equal(dense, time_table(tokens, units, n, memory, profile))
                rows, degrees = np.nonzero(np.ones_like(dense, dtype=bool))
                assert np.array_equal(times.at(rows, degrees), dense[rows, degrees])
                expected = threshold_degrees(dense)
                found = window_degrees(times)
                assert found == expected
                if found.degrees:
                    assert fill_spare(times, found.degrees, n) == fill_spare_ranks(
                        dense, found.degrees, n)
