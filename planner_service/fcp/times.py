"""Stage 2 without the dense table: T(G_i, d) evaluated only where the optimum can lie.

``dp.threshold_degrees`` reads the whole (K, N + 1) time table: K N entries, about a
second per table at K = 2,000 groups on N = 4,096 ranks and 2 GiB at 16,384 / 16,384.
``Times`` holds what defines the table (each group's tokens and attention units, and the
pool row of ``grouping.paper_groupings``: the LPT bound of the pooled short sequences on r
one-rank bins) and evaluates entries where asked (``at``), bit for bit the table's
(``cost_model.times_at``: the same operations on each element). ``window_degrees`` finds
the same optimum as ``threshold_degrees`` from a few entries per group:

- Group i needs at least ``d_min,i`` ranks (its memory minimum), so with spare =
  N - sum d_min no group's degree exceeds d_min,i + spare: only those spare + 1 degrees
  of a row count.
- The rows are read from d_min,i in chunks that double, and after each round the least
  makespan the entries read allow is a lower bound L of the optimum T*: a row that has
  not met T within the r_i degrees read needs at least d_min,i + r_i ranks at T, so with
  the running minima of the rows read (M entries), at most spare of them may exceed a
  reachable T: L = the (M - spare)-th smallest entry read (one ``np.partition``). L
  only rises as more is read. A row whose running minimum is at most L has read every
  degree it can need at any T >= L; the others read on. When none is left, every row
  needs at T >= L exactly what its entries say, so L is reachable: T* = L, and the
  degrees are the least meeting it (``dp.least_degrees``'s rule), read from the rows.

Both give the same makespan and degrees (tests compare them on tables of every shape).
Complexity: each row reads at most twice the degrees it needs at T* (plus one), so
about O(K + spare) entries in all (at most K (spare + 1)), in O(log N) rounds, each a
partition of the entries read: O((K + N) log N).
``fill_spare`` (``dp.fill_spare_ranks``'s rule) reads each group's next degrees in
chunks that double: O((K + spare) log N).
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

from planner_service.fcp.cost_model import FcpProfile, time_table, times_at
from planner_service.fcp.dp import Degrees, fill_spare_ranks, threshold_degrees

DENSE_LIMIT = 1 << 15
"""Entries K (N + 1) up to which the whole table is built and searched (``dp``): fewer
numpy calls than the rounds of ``window_degrees`` on small batches, the same answer."""


class Pool(NamedTuple):
    """The pool row: beta1 + max(the largest cost, the costs' sum / min(max(r, 1),
    members)) on r ranks, inf where r E is below the pooled tokens."""

    largest: float
    total: float
    members: int
    tokens: int


class Times:
    """T(G_i, d) of K groups (and an optional pool row, last) on up to N ranks."""

    def __init__(self, tokens: np.ndarray, units: np.ndarray, num_ranks: int,
                 memory_tokens: int, profile: FcpProfile, pool: Pool | None = None) -> None:
        self.tokens = np.asarray(tokens, dtype=np.float64)
        self.units = np.asarray(units, dtype=np.float64)
        self.n = num_ranks
        self.memory_tokens = memory_tokens
        self.profile = profile
        self.pool = pool
        self.k = len(self.tokens) + (pool is not None)
        self._dense: np.ndarray | None = None

    def at(self, rows: np.ndarray, degrees: np.ndarray) -> np.ndarray:
        """T at each (row, degree) pair (degrees 0 .. N; 0 is inf, as in the table)."""
        rows = np.asarray(rows, dtype=np.int64)
        d = np.asarray(degrees, dtype=np.float64)
        out = np.empty(len(rows))
        groups = rows < len(self.tokens)
        if groups.all():
            out = times_at(self.tokens[rows], self.units[rows], d, self.memory_tokens,
                           self.profile)
        else:
            out[groups] = times_at(self.tokens[rows[groups]], self.units[rows[groups]],
                                   d[groups], self.memory_tokens, self.profile)
            out[~groups] = self._pool_at(d[~groups])
        out[d < 1] = np.inf
        return out

    def _pool_at(self, r: np.ndarray) -> np.ndarray:
        assert self.pool is not None
        largest, total, members, tokens = self.pool
        used = np.minimum(np.maximum(r, 1.0), members)
        bound = self.profile.beta1 + np.maximum(largest, total / used)
        bound[r * self.memory_tokens < tokens] = np.inf
        return bound

    def dense(self) -> np.ndarray:
        """The (K, N + 1) table (``cost_model.time_table``, the pool row last), built once:
        O(K N)."""
        if self._dense is None:
            table = time_table(self.tokens, self.units, self.n, self.memory_tokens, self.profile)
            if self.pool is not None:
                table = np.vstack([table, self._pool_at(np.arange(self.n + 1, dtype=np.float64))])
            self._dense = table
        return self._dense

    @property
    def small(self) -> bool:
        """Whether the whole table is within ``DENSE_LIMIT`` entries."""
        return self.k * (self.n + 1) <= DENSE_LIMIT

    def column(self, degree: int) -> np.ndarray:
        """Every row's time at one degree."""
        return self.at(np.arange(self.k), np.full(self.k, degree))

    def min_degrees(self) -> np.ndarray:
        """Each row's memory minimum (its least finite degree, at least 1). O(K)."""
        tokens = self.tokens.astype(np.int64)  # whole token counts
        if self.pool is not None:
            tokens = np.append(tokens, self.pool.tokens)
        return np.maximum(-(-tokens // self.memory_tokens), 1)


def window_degrees(times: Times) -> Degrees:
    """``dp.threshold_degrees`` of ``times.dense()``, from the entries that count (module
    docstring); on a small table, ``threshold_degrees`` of it."""
    k, n = times.k, times.n
    if times.small:
        return threshold_degrees(times.dense())
    if k == 0:
        return Degrees((), 0.0)
    if k > n:
        return Degrees((), float("inf"))
    least = times.min_degrees()
    spare = n - int(least.sum())
    if spare < 0:
        return Degrees((), float("inf"))
    running = np.full(k, np.inf)  # each row's least time read so far
    read = np.zeros(k, dtype=np.int64)  # entries read per row
    width = np.ones(k, dtype=np.int64)  # the next chunk per row
    kept_rows, kept_values = [], []
    active = np.arange(k)
    while True:
        # The next chunk of every active row (widths double per row), as running minima.
        count = np.minimum(width[active], spare + 1 - read[active])
        rows = np.repeat(active, count)
        offset = np.arange(len(rows)) - np.repeat(np.cumsum(count) - count, count)
        values = times.at(rows, least[rows] + read[rows] + offset)
        starts = np.cumsum(count) - count
        # Running minimum along each row's chunk, from the row's minimum so far.
        values[starts] = np.minimum(values[starts], running[active])
        values = _segment_cummin(values, starts)
        kept_rows.append(rows)
        kept_values.append(values)
        running[active] = values[starts + count - 1]
        read[active] += count
        width[active] *= 2
        every = np.concatenate(kept_values)
        need = len(every) - spare  # entries at most T among those read, for T reachable
        bound = float(np.partition(every, need - 1)[need - 1]) if need > 0 else -np.inf
        active = np.flatnonzero((running > bound) & (read < spare + 1))
        if not len(active):
            break
    if not np.isfinite(bound):
        return Degrees((), float("inf"))
    rows, values = np.concatenate(kept_rows), every
    degrees = least + np.bincount(rows[values > bound], minlength=k)
    assert int(degrees.sum()) <= n, "every row meets the makespan within its window"
    return Degrees(tuple(degrees.tolist()), bound)


def _segment_cummin(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The running minimum of ``values`` within each segment beginning at ``starts``
    (ascending, the first 0). O(len log len) by doubling steps, in numpy."""
    out = values.copy()
    segment = np.zeros(len(values), dtype=np.int64)
    segment[starts[1:]] = 1
    segment = np.cumsum(segment)
    step = 1
    while step < len(out):
        same = segment[step:] == segment[:-step]
        shifted = np.where(same, out[:-step], np.inf)
        np.minimum(out[step:], shifted, out=out[step:])
        step *= 2
    return out


def fill_spare(times: Times, degrees: tuple[int, ...], num_ranks: int) -> tuple[int, ...]:
    """``dp.fill_spare_ranks`` on ``times`` (the same degrees): ranks left over go one at
    a time to the slowest group one more rank makes strictly faster; each group's next
    times read in chunks that double (on a small table, ``fill_spare_ranks`` of it)."""
    if times.small:
        return fill_spare_ranks(times.dense(), degrees, num_ranks)
    spare = num_ranks - sum(degrees)
    out = list(degrees)
    if spare <= 0 or not out:
        return tuple(out)
    rows = np.arange(len(out))
    now = times.at(rows, np.asarray(out)).tolist()
    ahead: dict[int, list[float]] = {}  # row -> its times at out[row] + 1, + 2, ...
    chunk = dict.fromkeys(range(len(out)), 1)

    def next_time(i: int) -> float:
        queue = ahead.get(i)
        if not queue:
            d = out[i]
            count = min(chunk[i], num_ranks - d)
            queue = times.at(np.full(count, i), d + 1 + np.arange(count)).tolist()[::-1]
            chunk[i] *= 2
            ahead[i] = queue
        return queue[-1]

    heap = [(-now[i], i) for i in range(len(out))]
    heapq.heapify(heap)
    while spare > 0 and heap:
        neg, i = heapq.heappop(heap)
        if out[i] + 1 > num_ranks:
            continue
        faster = next_time(i)
        if faster < -neg:
            ahead[i].pop()
            out[i] += 1
            spare -= 1
            heapq.heappush(heap, (-faster, i))
    return tuple(out)
