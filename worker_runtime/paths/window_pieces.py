"""Piece calls under a sliding window, natively: each call of ``pieces.py`` (and each ring
step's call of ``segment_ring.py``) on its segments' real document positions.

A piece call pairs query segment b (one document's shard, positions ascending) with key
segment b (rows of the same document, positions ascending, possibly several pieces with
holes between them). Under a window W the query at position p sees the keys at positions
``(p - W, p]`` of its segment: the reference kernel's windowed mask on those positions
(``kernels.build_masked_meta`` with segment ids as documents). A full call of the
segments path or the segment ring pairs a shard with keys at a per-document offset, which
one flash call's ``window_size_left`` cannot express, so only kernels with positional
masks (``positional_meta``, the reference kernel) run these calls natively; the others
take the gathered form (``paths.windowed_path``).

A call none of whose queries has a key inside its window is dropped; queries of a kept
call that see none of its keys are its hollow rows (masked in the merge, as ``pieces.py``'s
hollow segments). A causal call ``A(j, j)`` is never dropped nor hollow (every query sees
itself). O(rows) numpy per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from worker_runtime.kernels import rows_in_window
from worker_runtime.layout import CommMap, RankLayout
from worker_runtime.paths.piece_calls import Part, SegmentState
from worker_runtime.paths.pieces import PieceCall
from worker_runtime.paths.segment_kernels import SegmentKernel


def native_window(kernel: SegmentKernel | None) -> bool:
    """Whether ``kernel`` runs piece calls under a window (it has ``positional_meta``)."""
    return kernel is not None and callable(getattr(kernel, "positional_meta", None))


def windowed_parts(kernel: SegmentKernel, calls: Sequence[PieceCall], q_pos: np.ndarray,
                   k_pos: np.ndarray, window: int, device: torch.device) -> tuple[Part, ...]:
    """The kept calls of ``calls`` with their windowed metadata and hollow rows.

    ``q_pos``: document position of every query-buffer row, ``k_pos`` of every key-buffer
    row (the calls' ``[q_lo, q_hi)`` and ``[k_lo, k_hi)`` index them)."""
    assert native_window(kernel), "a kernel with positional masks"
    parts = []
    for c in calls:
        lq: np.ndarray = np.diff(np.asarray(c.cu_q, np.int64))
        lk: np.ndarray = np.diff(np.asarray(c.cu_k, np.int64))
        segs = np.arange(len(lq), dtype=np.int64)
        q_seg, k_seg = np.repeat(segs, lq), np.repeat(segs, lk)
        qp = np.asarray(q_pos[c.q_lo : c.q_hi], np.int64)
        kp = np.asarray(k_pos[c.k_lo : c.k_hi], np.int64)
        sees = rows_in_window(q_seg, qp, k_seg, kp, window)
        if c.causal:
            assert len(sees) == len(qp), "every query of a causal call sees itself"
        if not len(sees):
            continue
        hollow = np.setdiff1d(np.arange(len(qp), dtype=np.int64), sees)
        meta = kernel.positional_meta(c.cu_q, c.cu_k, qp, kp, c.causal, device,  # type: ignore[attr-defined]
                                      window)
        parts.append((c, meta, torch.from_numpy(hollow).to(device) if len(hollow) else None))
    return tuple(parts)


def windowed_state(state: SegmentState, layout: RankLayout, comm: CommMap | None,
                   window: int, device: torch.device) -> SegmentState:
    """``state`` with its calls under ``window``: local calls on the local buffer's
    positions, remote calls on the remote buffer's (``comm.remote_pos`` in the plan's
    ``remote_order``); dropped calls leave the plan."""
    plan = state.plan
    local_pos = layout.positions[plan.local_rows]
    remote_pos = comm.remote_pos[plan.remote_order] if comm is not None else local_pos[:0]
    parts = windowed_parts(state.kernel, [c for c in plan.calls if not c.remote], local_pos,
                           local_pos, window, device)
    parts += windowed_parts(state.kernel, [c for c in plan.calls if c.remote], local_pos,
                            remote_pos, window, device)
    return state._replace(plan=plan._replace(calls=tuple(c for c, _, _ in parts)),
                          metas=tuple(m for _, m, _ in parts), empty=tuple(e for _, _, e in parts))
