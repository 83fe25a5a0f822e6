"""Tiles a flash-attn varlen call computes for a windowed segment, for the step-time model.

A segment of ``length`` queries at doc positions ``[s, e)`` (``e = s + length``) runs
against the keys ``[lo, e)`` with ``lo = max(0, s - W + 1)``: its halo and itself (the
gathered path once the halo alone is gathered; causal: ``lo = 0``). flash-attn aligns the
causal diagonal bottom right (query row i sees key index ``i + s - lo`` and below) and,
with ``window_size_left = W - 1``, key indices down to ``i + s - lo - (W - 1)``; it
visits, per query tile of rows ``[q0, q1)`` (doc positions), the key tiles (aligned at
``lo``) from the one holding the first row's first key to the one holding the last row's
last key (FlashAttention-2/3 ``n_block_min`` / ``n_block_max`` for local attention):

    first = max(lo, q0 - W + 1) - lo,  last = q1 - 1 - lo,
    tiles = floor(last / tile_k) - floor(first / tile_k) + 1.

Causal (W None, or W > every position): ``first = 0`` and the count is
``ceil(q1 / tile_k)``, ``step_time.segment_calls.causal_tiles_of``. A started tile costs a whole
tile, as on the segments path. ``halo=False``: the keys are ``[0, e)`` (the gathered call on
the ``full`` map, a ring plan's bytes), aligned at 0: ``lo = 0``, ``first = max(0, q0 - W + 1)``.

:func:`window_tiles_of` is the numpy form (O(query tiles)); :func:`reference_window_tiles`
tests every (query tile, key tile) for a pair inside the band, pair by pair; compared in
tests/test_core_window_tiles.py.
"""

from __future__ import annotations

import numpy as np


def window_tiles_of(starts: np.ndarray, lengths: np.ndarray, window: int | None, tile_q: int,
                    tile_k: int, *, halo: bool = True) -> np.ndarray:
    """Per segment (int64 arrays of starts and lengths), the tiles of its windowed call
    (module docstring). O(query tiles)."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if not len(starts):
        return np.zeros(0, dtype=np.int64)
    q_tiles = -(-lengths // tile_q)
    seg = np.repeat(np.arange(len(starts)), q_tiles)
    first_tile = np.cumsum(q_tiles) - q_tiles
    j = np.arange(int(q_tiles.sum()), dtype=np.int64) - np.repeat(first_tile, q_tiles)
    s = starts[seg]
    q0 = s + j * tile_q
    q1 = s + np.minimum((j + 1) * tile_q, lengths[seg])
    if window is None:
        lo = np.zeros_like(s)
        first = np.zeros_like(s)
    else:
        lo = np.maximum(0, s - window + 1) if halo else np.zeros_like(s)
        first = np.maximum(lo, q0 - window + 1) - lo
    tiles = (q1 - 1 - lo) // tile_k - first // tile_k + 1
    out = np.zeros(len(starts), dtype=np.int64)
    np.add.at(out, seg, tiles)
    return out


def reference_window_tiles(start: int, length: int, window: int | None, tile_q: int,
                           tile_k: int, *, halo: bool = True) -> int:
    """The tiles of one segment, by testing each (query tile, key tile) pair by pair for a
    query p and key k with ``k <= p`` and ``p - k < W`` (``halo``: as ``window_tiles_of``)."""
    lo = 0 if window is None or not halo else max(0, start - window + 1)
    end = start + length
    count = 0
    for q0 in range(start, end, tile_q):
        for k0 in range(lo, end, tile_k):
            count += any(k <= p and (window is None or p - k < window)
                         for p in range(q0, min(q0 + tile_q, end))
                         for k in range(k0, min(k0 + tile_k, end)))
    return count
