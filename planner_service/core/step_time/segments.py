"""The ``segments`` path: flash-attn's varlen calls per piece pair, the exchange behind the local ones.

flash-attn (a ``segment``-tiling profile; CUDA, fp16/bf16), the runtime's default flash
path, on a gather mode (worker_runtime/segattention.py, segments.py). The K and V
collectives (two, async) start; the rank's own keys are gathered into (group, document)
order (none when that is their own order, e.g. every document with one shard here) and the
``A(j, i)`` calls run while the exchange is in flight, each merged into float32 output and
log-sum-exp accumulators; then one copy of the distinct remote KV and the ``B(j, i)``
calls, merged the same way. Backward: the B calls' gradients, the dK/dV return (two
collectives, async) in flight during the A calls' gradients.

Cost: **calls** the A and B calls (segment_calls.py: ``per_seq_us`` per document segment
of every call; per segment of s rows a causal square with p = 0, a full rectangle of
q x k rows ceil(q / tile_q) ceil(k / tile_k) tiles, a hollow segment its query tiles);
**copies** :func:`segment_rows` (accumulators float32, float64 for float64 inputs);
**transfers** two collectives (K, V) of R b bytes in all each way, X; with overlap,
exposed ``max(0, X - H_f) + max(0, X - H_b)``, H_f = phi K_A + the copies before the
forward wait (:func:`segment_forward_window_rows`), H_b = (1 - phi) K_A + the copies
before the backward wait (:func:`segment_backward_window_rows`), K_A the A calls.
O(M^2 D + tiles) per rank (M the most shards of one of its D documents); the group form
O(s log s + c) for c candidate remote calls.
"""

from __future__ import annotations

from typing import Any

from planner_service.core.step_time.segment_calls import (
    Calls,
    SegmentWork,
    group_segment_work,
    segment_work,
)
from planner_service.core.step_time.terms import (
    GroupInput,
    KernelWork,
    PathModel,
    RankInput,
    Rows,
    Step,
    Terms,
    add_work,
    assemble,
    collectives,
    exchange_rows,
    window_hides,
)

SEGMENT_MERGE = (4, 6, 10)
"""One merge of a call's part into the accumulators on the flash paths
(segattention._merge), per query row: accumulator-dtype query rows (the part's cast,
the rescale ``mul_``, the weighted part, the ``add_``), log-sum-exp rows (``logaddexp``,
two differences, two exponentials, the copy back) and ops."""


def calls_work(c: Calls) -> KernelWork:
    """The kernel work of summed varlen calls."""
    return KernelWork(c.pairs, c.tiles, c.segments, c.row_blocks, c.calls)


def segment_merge_rows(calls: Any, queries: Any, hollow_calls: Any, hollow_rows: Any) -> Rows:
    """The log-sum-exp merges of ``calls`` calls with ``queries`` query rows in all into the
    accumulators (SEGMENT_MERGE per query row and per call); a call with a hollow segment
    masks both parts first (its ``hollow_rows`` query rows once more in each accumulator
    kind, two ops)."""
    rows, lse_rows, ops = SEGMENT_MERGE
    return Rows(0 * queries, 0 * queries, 0 * queries, ops * calls + 2 * hollow_calls,
                0 * queries, rows * queries + hollow_rows, lse_rows * queries + hollow_rows)


def segment_forward_window_rows(work: SegmentWork, real: Any) -> Rows:
    """Forward: the copies between starting the exchange and waiting for it. The local
    buffer's q, k, v gathers (r rows; none in place), the zeroed output and log-sum-exp
    accumulators, each query group's first part copied in (r rows in all, two ops per
    group), and the merges of the other local calls (SEGMENT_MERGE)."""
    r, gathers = real, 1 - work.in_place
    rows, lse_rows, ops = SEGMENT_MERGE
    merges = work.local.calls - work.pieces
    return Rows(gathers * r, gathers * r, 0 * r, 3 * gathers + 2 + 2 * work.pieces + ops * merges,
                0 * r, 2 * r + rows * work.merge_rows, 2 * r + lse_rows * work.merge_rows)


def segment_backward_window_rows(work: SegmentWork, tokens_per_rank: Any, real: Any) -> Rows:
    """Backward: the copies between starting the dK/dV return and waiting for it. The
    zeroed local dK/dV accumulators (r rows), per local call its log-sum-exp slice made
    contiguous (not when it is the whole accumulator) and the dQ, dK, dV adds, then dQ, dK,
    dV back into ``[T]`` tensors (zero fill, cast of r rows, and an index copy of r rows
    unless in place)."""
    t, r, gathers, a = tokens_per_rank, real, 1 - work.in_place, work.local
    return Rows(t + r + gathers * r, t + r + gathers * r, 0 * r,
                2 + 4 * a.calls - work.whole_local + 6 + 3 * gathers,
                r + a.keys, a.queries, a.queries - work.whole_local * r)


def segment_rows(comm_mode: str, *, tokens_per_rank: Any, real: Any, recv: Any,
                 work: SegmentWork, num_ranks: int) -> Rows:
    """Rows the copies write, forward + backward (values may be arrays): the exchange
    buffers as on the lean path (SEND_ROWS; ``p2p_ring`` runs as ``full``), the two
    windows (:func:`segment_forward_window_rows`, :func:`segment_backward_window_rows`)
    and, outside them:

    - forward: the remote calls' merges (SEGMENT_MERGE; a call with hollow rows masks
      both parts: its query rows once more in each accumulator kind, two ops), the remote
      buffer (``index_select`` of K and V, F rows), the output back into ``[T]`` (zero
      fill, cast of r rows, an index copy of r rows unless in place);
    - backward: dO and the output gathered (r rows each, unless in place), the zeroed dQ
      (r rows) and remote dK/dV (F rows) accumulators, per remote call the contiguous
      log-sum-exp slice and the dQ, dK, dV adds (and the masked dQ of a hollow call),
      the zeroed return buffer (R rows), the remote dK/dV cast and ``index_copy`` into it
      (F rows each).
    """
    t, r, f, b = tokens_per_rank, real, work.remote_keys, work.remote
    gathers = 1 - work.in_place
    hollow, hollow_rows = work.hollow_calls, work.hollow_rows
    send, send_ops = exchange_rows(comm_mode, recv, num_ranks)
    exchange = Rows(send, 0 * r, 0 * r, send_ops)
    forward = segment_merge_rows(b.calls, b.queries, hollow, hollow_rows) + Rows(
        f, t + r + gathers * r, 0 * r, 2 + 2 + gathers)
    backward = Rows(recv + 2 * f, 2 * gathers * r + hollow_rows, 0 * r,
                    2 * gathers + 3 + 4 * b.calls - work.whole_remote + hollow + 6,
                    f + b.keys, r + b.queries, b.queries - work.whole_remote * r)
    return (exchange + segment_forward_window_rows(work, r) + forward
            + segment_backward_window_rows(work, t, r) + backward)


def _terms(step: Step, work: SegmentWork, real: Any, recv: Any) -> Terms:
    t = step.tokens_per_rank
    local = calls_work(work.local)
    copies = segment_rows(step.comm_mode, tokens_per_rank=t, real=real, recv=recv, work=work,
                          num_ranks=step.num_ranks)
    hides = window_hides(step, local, segment_forward_window_rows(work, real),
                         segment_backward_window_rows(work, t, real)) if step.overlap else None
    return assemble(step, add_work(local, calls_work(work.remote)), copies,
                    collectives(step, recv, 2, hides))


def terms(inp: RankInput) -> Terms:
    """One rank's terms from its calls as the runtime builds them (module docstring)."""
    k = inp.step.kernel
    return _terms(inp.step, segment_work(inp.shards, k.tile_q, k.tile_k), inp.real, inp.recv)


def group_terms(inp: GroupInput) -> Terms:
    """Every rank's terms (segment_calls.group_segment_work)."""
    a, k = inp.arrays, inp.step.kernel
    work = group_segment_work(a.rank, a.doc, a.start, a.end, inp.step.num_ranks, k.tile_q,
                              k.tile_k)
    return _terms(inp.step, work, inp.real, inp.recv)


MODEL = PathModel(terms, group_terms, hides="local")
