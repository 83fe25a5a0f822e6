"""Per-layer step-time estimate of one rank: what the worker runtime executes, term by term.

The runtime (worker_runtime/attention.py, segattention.py, overlap.py, ring.py, comm.py)
runs one attention layer (forward + backward) on one of five paths, set by the kernel, the
comm mode and, for flash-attn, its ``flash_path`` (:func:`execution_path`):

``segments``  flash-attn (a ``segment``-tiling profile; CUDA, fp16/bf16), the runtime's
              default flash path, the gather modes. The lean path's structure on varlen
              calls (core/segment_work.py): the K and V collectives (two, async) start;
              the rank's own keys are gathered into (group, document) order (none when
              that is their own order, e.g. every document with one shard here) and the
              ``A(j, i)`` calls run while the exchange is in flight, each merged into
              float32 output and log-sum-exp accumulators; then one copy of the distinct
              remote KV and the ``B(j, i)`` calls, merged the same way. Backward: the B
              calls' gradients, the dK/dV return (two collectives, async) in flight during
              the A calls' gradients.
``segment_ring``  flash-attn on the segments flash path, ``p2p_ring``: the ring below on
              varlen calls (core/segment_ring_work.py). Step 0 is the segments path's local
              calls ``A(j, i)`` (own keys, gathered into (group, document) order unless in
              place) merged into the float32 accumulators while shift 0 is in flight; step
              s runs one full call per (query group, class of its documents with one shard
              count) that sees a key of the block, reading the block in place (zero-query
              segments fill the rows between key segments), merged by log-sum-exp.
              Backward as ``ring``: the blocks circulate again with a T-row dK/dV
              accumulator each; nothing remote is kept between the passes.
``gathered``  flash-attn with ``flash_path="gathered"`` (opt-out, or when flash-attn's
              private varlen API fails the runtime's probe). Stack the local K and V, one
              blocking KV collective over the N - 1 peers, gather every shard's keys
              ``[0, e)`` into contiguous K and V, one varlen kernel call on the real
              queries, padding rows appended; backward mirrors it (one blocking
              all-to-all returns dK/dV). A ``p2p_ring`` plan runs as the full all-gather.
              Nothing overlaps; ``overlap`` has no effect.
``lean``      the PyTorch kernel (a ``packed``-tiling profile), gather modes. The K and V
              collectives (two, async) start, the local call (every real query against the
              rank's own keys) runs while they are in flight, then one copy of the distinct
              remote KV, the remote call (the queries that see a remote key) and a
              log-sum-exp merge. Backward: the remote call's gradients first, the dK/dV
              return (two collectives, async) in flight during the local call's gradients.
``ring``      the PyTorch kernel, ``p2p_ring``. N - 1 point-to-point shifts of the whole
              local K/V block (T rows, padding included): shift 0 in flight during the local
              call, shift s during step s's call and merge (the block of slot ``i - s``);
              one call per step whose queries see a key of the block. Backward circulates
              the blocks again with a dK/dV accumulator per block; a step waits for the
              accumulator the previous step sent only after its own gradient call, so each
              accumulator transfer is in flight during the next step's call (the block
              shifts travel beside them and are taken as hidden; the link is taken to carry
              both at once); the last one is waited for after the loop.

Terms (forward + backward, milliseconds):

``kernel``  Sum over the path's calls: FLOPs at the profile's rates, plus
            ``call_overhead_us`` per call (fwd + bwd), ``per_seq_us`` per document segment
            (segments, segment_ring: per segment of every call; the other paths: per
            shard, once),
            ``per_tile_us`` per tile and ``per_row_block_us`` per query tile. Flash-attn
            tiles (``segment`` tiling; a started tile costs a full tile, FlashCP Fig. 3,
            WLB-LLM section 5): gathered, each shard of s queries at doc position p runs
            ceil(s / tile_q) query tiles, query tile j reading
            ceil((p + min((j + 1) tile_q, s)) / tile_k) key tiles; segments, per document
            segment of a call, a causal square of s rows the same with p = 0, a full
            rectangle of q x k rows ceil(q / tile_q) ceil(k / tile_k) tiles (a hollow
            segment: its query tiles, no key tile; a zero-query segment: none);
            segment_ring, the local calls as on segments plus every step's calls (full
            rectangles, hollow and zero-query segments as above). Lean and ring: the
            PyTorch kernel's blocks of tile_q query rows x tile_k keys over doc-masked key
            sets (core/masked_work.py), dense inside a block.
``copy``    Bytes written by the path's eager copies (:func:`path_rows`,
            :func:`segment_rows`, :func:`segment_ring_rows`) at ``copy_gbps``, plus
            ``op_overhead_us`` per op. The flash paths' accumulators are float32 (float64
            for float64 inputs).
``comm``    Exposed exchange. A collective over the N - 1 peers costs ``latency_us +
            (N - 1) per_peer_us``, a ring shift ``latency_us + per_peer_us``, plus bytes /
            bandwidth; R = tokens received per pass, T = rows per rank, b = K+V bytes per
            token, phi = the forward share of a call's time (:func:`forward_share`):

            - gathered: 2 X1 with X1 = one collective of R b bytes;
            - lean and segments, overlap off: 2 X with X = two collectives (K, V) of R b
              bytes in all; on: max(0, X - H_f) + max(0, X - H_b) with, lean,
              H_f = phi K_loc and H_b = (1 - phi) K_loc + C_win, K_loc the local call,
              C_win the copies between backward's start and wait (the remote queries' dQ
              add, the dK/dV concatenation); segments, H_f = phi K_A + the copies before
              the forward wait (:func:`segment_forward_window_rows`) and H_b =
              (1 - phi) K_A + the copies before the backward wait
              (:func:`segment_backward_window_rows`), K_A the A calls;
            - ring and segment_ring, t = one shift of T b bytes; overlap off:
              3 (N - 1) t; on: max(0, t - phi K_loc) + sum over steps s = 1..N-2 of
              max(0, t - W_s) + max(0, t - (1 - phi) K_loc) + sum over steps s = 2..N-1
              of max(0, t - B_s) + t, with K_loc the local call (segment_ring: the local
              calls), K_s the step's call(s), W_s = phi K_s + the step's merge copies
              (:func:`merge_rows`; segment_ring :func:`segment_merge_rows`) and
              B_s = (1 - phi) K_s (both 0 for a step without a call).

            No comm when the rank receives nothing (R = 0).
``linear``  the layer's GEMMs on every local row, padding included.

Padding rows cost copies, transfers and linear time, not kernel time. On the lean and ring
paths every row is counted at ``model.dtype_bytes`` (the PyTorch kernel computes in the
input dtype for float32 and float64). :func:`rank_step` is the reference, rank by rank;
:func:`group_steps` computes a whole group in numpy and equals it (tests compare them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from planner_service.core import masked_work as mw
from planner_service.core import paths
from planner_service.core import segment_ring_work as srw
from planner_service.core import segment_work as sgw
from planner_service.core.cost import ShardArrays, comm_volumes, per_rank_sums, recv_tokens_by_mode
from planner_service.core.model import ModelSpec
from planner_service.core.paths import RING_PATHS, RUNTIME_FLASH_PATH
from planner_service.core.plan import Plan, Shard
from planner_service.core.profiles import KernelProfile, LinkProfile, get_kernel_profile

BWD_FLOP_RATIO = 2.5
"""Backward attention does 2.5x the forward FLOPs (5 vs 2 matmuls; FlashAttention-2 paper)."""

RUNTIME_OVERLAP = True
"""The runtime's default (``ContextParallelAttention(overlap=True)``; a test checks it)."""

def execution_path(kernel: KernelProfile, comm_mode: str, flash_path: str = RUNTIME_FLASH_PATH) -> str:
    """The runtime path for a kernel profile and comm mode: ``paths.execution_path`` on the
    profile's tiling. ValueError for an unknown ``flash_path``."""
    return paths.execution_path(kernel.tiling, comm_mode, flash_path)


def held_kv_mode(kernel: str, comm_mode: str) -> str:
    """The exchange whose KV a rank holds (``cost.kv_tokens_peak``'s mode) when ``kernel``
    (a profile name) runs ``comm_mode`` on the runtime's default flash path: ``p2p_ring``
    where the runtime runs a ring (RING_PATHS), ``full`` where it runs a ring plan as the
    full all-gather (flash-attn's gathered path), else ``comm_mode`` itself."""
    if comm_mode == "p2p_ring" and execution_path(get_kernel_profile(kernel), comm_mode) not in RING_PATHS:
        return "full"
    return comm_mode


def attention_tiles(shards: Sequence[Shard], tile_q: int, tile_k: int) -> int:
    """Number of (tile_q x tile_k) tiles the causal varlen kernel computes for ``shards``."""
    return int(attention_tiles_per_shard(shards, tile_q, tile_k).sum())


def attention_tiles_per_shard(shards: Sequence[Shard], tile_q: int, tile_k: int) -> np.ndarray:
    """Tiles per shard (vectorised over shards and query tiles; O(tiles) time)."""
    if not shards:
        return np.zeros(0, dtype=np.int64)
    # Lists of ints convert to arrays far faster than the shard tuples themselves.
    starts = np.array([s.start for s in shards], dtype=np.int64)
    lengths = np.array([s.end - s.start for s in shards], dtype=np.int64)
    return attention_tiles_of(starts, lengths, tile_q, tile_k)


def attention_tiles_of(starts: np.ndarray, lengths: np.ndarray, tile_q: int, tile_k: int) -> np.ndarray:
    """``attention_tiles_per_shard`` from int64 arrays of shard starts and lengths."""
    return sgw.causal_tiles_of(starts, lengths, tile_q, tile_k)


class KernelWork(NamedTuple):
    """What one rank's kernel calls compute, summed over the calls (ints; int64 arrays with
    one entry per rank in :func:`group_steps`)."""

    pairs: Any
    """Query-key pairs computed (masked ones inside a computed tile or block included)."""
    tiles: Any
    """Tiles (segment tiling) or key blocks (the PyTorch kernel) visited."""
    segments: Any
    """Document segments (``per_seq_us`` each): the rank's shards, once (gathered, lean,
    ring), or each call's document segments, summed over the calls (segments)."""
    row_blocks: Any
    """Query tiles or query blocks."""
    calls: Any = 1
    """Kernel calls (forward + backward each)."""


def kernel_work(shards: Sequence[Shard], kernel: KernelProfile, *, tiles: int | None = None) -> KernelWork:
    """The gathered path's one call under ``kernel``'s ``segment`` tiling (module docstring).

    ``tiles`` may be passed when already counted (:func:`attention_tiles` of ``shards``).
    """
    if tiles is None:
        tiles = attention_tiles(shards, kernel.tile_q, kernel.tile_k)
    rows = sum(-(-(s.end - s.start) // kernel.tile_q) for s in shards)
    return KernelWork(tiles * kernel.tile_q * kernel.tile_k, tiles, len(shards), rows)


def kernel_ms(work: KernelWork, model: ModelSpec, kernel: KernelProfile) -> Any:
    """Forward+backward kernel time in milliseconds for ``work`` (fields may be arrays)."""
    fwd_flops = 4.0 * model.head_dim * model.num_heads * work.pairs
    compute_s = fwd_flops / (kernel.fwd_tflops * 1e12) + (
        BWD_FLOP_RATIO * fwd_flops / (kernel.bwd_tflops * 1e12)
    )
    overhead_us = (
        work.calls * kernel.call_overhead_us
        + work.segments * kernel.per_seq_us
        + work.tiles * kernel.per_tile_us
        + work.row_blocks * kernel.per_row_block_us
    )
    return compute_s * 1e3 + overhead_us * 1e-3


def forward_share(kernel: KernelProfile) -> float:
    """The forward pass's share of a call's time: the FLOP-time share
    ``(1 / fwd) / (1 / fwd + 2.5 / bwd)``, applied to the whole call (overheads included)."""
    fwd = 1.0 / kernel.fwd_tflops
    return fwd / (fwd + BWD_FLOP_RATIO / kernel.bwd_tflops)


def key_rows(shards: Sequence[Shard]) -> int:
    """Rows of the gathered K (and V) the flash kernel reads: keys ``[0, e)`` per shard."""
    return sum(s.end for s in shards)


# -- copies -------------------------------------------------------------------------------

COPY_OPS = 16
"""Eager tensor ops around the kernel on the gathered path, forward + backward (attention.py,
comm.py): forward stack, send index_select, buffer fill, receive concat, source concat, two
key gathers, padding concat; backward two gather scatter-adds with their zero buffers,
local clone, receive buffer, gradient index_add, stack split."""
MERGE_OPS = 13
"""Ops of one log-sum-exp merge with its query select (overlap.merge_parts)."""
PART_OPS = 20
"""Ops a second part (lean remote part, ring step) adds, forward + backward: query select
and merge (13); backward selects of dO, Q, LSE, delta (4), dQ add (1), and the dK/dV
write (lean: index_copy into the return buffer; ring: the accumulator add) (2)."""
SEND_ROWS = {"full": (0, 0, 2, 4), "compact_allgather": (2, 4, 2, 4), "alltoallv": (1, 2, 1, 2)}
"""Lean path per gather mode: (send-buffer rows, ops, returned-gradient rows, ops), rows in
units of the per-peer buffer B = R / (N - 1) (all-gathers) or of R (all-to-all-v).
Compact: zeroed buffer + index_select (2B), sum of the returned blocks + index_add (2B);
full sends its K and V in place; all-to-all-v: index_select of the sent rows, index_add
of the returned (the sent rows taken as R)."""


class Rows(NamedTuple):
    """Rows written by eager copies: K+V rows (``kv_bytes_per_token`` each), query-shaped
    rows (heads x head_dim), log-sum-exp rows (heads), the op count, and the same three
    row kinds in the accumulator dtype (:func:`accumulator_bytes`; the segments path)."""

    kv: Any
    q: Any
    lse: Any
    ops: Any
    acc_kv: Any = 0
    acc_q: Any = 0
    acc_lse: Any = 0

    def bytes(self, model: ModelSpec) -> Any:
        heads, dim, kv_heads = model.num_heads, model.head_dim, model.num_kv_heads
        acc = accumulator_bytes(model)
        return (self.kv * model.kv_bytes_per_token + self.q * heads * dim * model.dtype_bytes
                + self.lse * heads * model.dtype_bytes + self.acc_kv * 2 * kv_heads * dim * acc
                + self.acc_q * heads * dim * acc + self.acc_lse * heads * acc)

    def __add__(self, other: Rows) -> Rows:  # type: ignore[override]
        return Rows(*(a + b for a, b in zip(self, other, strict=True)))


def accumulator_bytes(model: ModelSpec) -> int:
    """Element size of the segments path's accumulators: float32, float64 for float64."""
    return 8 if model.dtype_bytes == 8 else 4


def path_rows(path: str, comm_mode: str, *, tokens_per_rank: Any, real: Any, recv: Any,
              key_tokens: Any = 0, remote_keys: Any = 0, queries: Any = 0, parts: Any = 0,
              num_ranks: int) -> Rows:
    """Rows the path's copies write, forward + backward (values may be arrays).

    T rows per rank (padding included), r real, R received per pass; ``key_tokens`` the
    gathered keys (gathered path), ``remote_keys`` F the distinct remote KV (lean),
    ``queries`` Q the second parts' query rows and ``parts`` the calls after the local one.

    - gathered: K+V 4T + 5R + 2 key_tokens (forward stack, send and receive ~2R, source
      concat T + R, key gathers; backward zeroed source gradient T + R, scatter-add, clone,
      returned add ~R, split); queries T + r; COPY_OPS ops.
    - lean: K+V send + returned (SEND_ROWS) + 2F (remote copy, dK/dV index_copy) + R
      (zeroed return buffer) + 2T - r (dK, dV padding concat); queries 9Q + 4T - r (query
      select, merge 5Q, output concat 2T - r, delta r, dO/Q selects 2Q, dQ add Q, dQ
      concat 2T - r); LSE 9Q + r; 14 ops + send/return ops + PART_OPS with a remote part.
    - ring: K+V 2T - r (dK, dV concat) + 2T (first accumulator zeros, final add; N > 1) + T
      per step with queries (accumulator add); queries 4T - r + 9Q; LSE r + 9Q; 10 ops
      (+ 4 for N > 1) + PART_OPS per step with queries.
    """
    t, r = tokens_per_rank, real
    if path == "gathered":
        return Rows(4 * t + 5 * recv + 2 * key_tokens, t + r, 0 * t, COPY_OPS + 0 * t)
    base_q, base_lse = 4 * t - r + 9 * queries, r + 9 * queries
    if path == "lean":
        moves = recv > 0
        send, send_ops, ret, ret_ops = SEND_ROWS[comm_mode]
        unit = recv if comm_mode == "alltoallv" else recv // max(num_ranks - 1, 1)
        kv = moves * ((send + ret) * unit) + 2 * remote_keys + recv + 2 * t - r
        return Rows(kv, base_q, base_lse, 14 + moves * (send_ops + ret_ops) + PART_OPS * parts)
    ring = num_ranks > 1
    return Rows(2 * t - r + ring * 2 * t + parts * t, base_q, base_lse,
                10 + 4 * ring + PART_OPS * parts)


def copy_ms(num_bytes: Any, kernel: KernelProfile, ops: Any = COPY_OPS) -> Any:
    """Copy time: bytes / copy bandwidth + ``ops`` eager-op overheads."""
    return num_bytes / (kernel.copy_gbps * 1e9) * 1e3 + ops * kernel.op_overhead_us * 1e-3


def lean_window_rows(tokens_per_rank: Any, real: Any, queries: Any) -> Rows:
    """Lean backward: copies between starting the dK/dV return and waiting for it (the
    remote queries' dQ add, the dK/dV padding concatenation)."""
    return Rows(2 * tokens_per_rank - real, queries, 0 * queries, 4 + (queries > 0))


def merge_rows(queries: Any) -> Rows:
    """One ring step's query select and log-sum-exp merge (forward)."""
    return Rows(0 * queries, 6 * queries, 7 * queries, MERGE_OPS + 0 * queries)


SEGMENT_MERGE = (4, 6, 10)
"""One merge of a call's part into the accumulators on the segments path
(segattention._merge), per query row: accumulator-dtype query rows (the part's cast,
the rescale ``mul_``, the weighted part, the ``add_``), log-sum-exp rows (``logaddexp``,
two differences, two exponentials, the copy back) and ops."""


def segment_forward_window_rows(work: sgw.SegmentWork, real: Any) -> Rows:
    """Segments path, forward: the copies between starting the exchange and waiting for it.
    The local buffer's q, k, v gathers (r rows; none in place), the zeroed output and
    log-sum-exp accumulators, each query group's first part copied in (r rows in all, two
    ops per group), and the merges of the other local calls (SEGMENT_MERGE)."""
    r, gathers = real, 1 - work.in_place
    rows, lse_rows, ops = SEGMENT_MERGE
    merges = work.local.calls - work.pieces
    return Rows(gathers * r, gathers * r, 0 * r, 3 * gathers + 2 + 2 * work.pieces + ops * merges,
                0 * r, 2 * r + rows * work.merge_rows, 2 * r + lse_rows * work.merge_rows)


def segment_backward_window_rows(work: sgw.SegmentWork, tokens_per_rank: Any, real: Any) -> Rows:
    """Segments path, backward: the copies between starting the dK/dV return and waiting
    for it. The zeroed local dK/dV accumulators (r rows), per local call its log-sum-exp
    slice made contiguous (not when it is the whole accumulator) and the dQ, dK, dV adds,
    then dQ, dK, dV back into ``[T]`` tensors (zero fill, cast of r rows, and an index copy
    of r rows unless in place)."""
    t, r, gathers, a = tokens_per_rank, real, 1 - work.in_place, work.local
    return Rows(t + r + gathers * r, t + r + gathers * r, 0 * r,
                2 + 4 * a.calls - work.whole_local + 6 + 3 * gathers,
                r + a.keys, a.queries, a.queries - work.whole_local * r)


def segment_rows(comm_mode: str, *, tokens_per_rank: Any, real: Any, recv: Any,
                 work: sgw.SegmentWork, num_ranks: int) -> Rows:
    """Rows the segments path's copies write, forward + backward (values may be arrays):
    the exchange buffers as on the lean path (SEND_ROWS; ``p2p_ring`` runs as ``full``),
    the two windows (:func:`segment_forward_window_rows`,
    :func:`segment_backward_window_rows`) and, outside them:

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
    moves = recv > 0
    send, send_ops, ret, ret_ops = SEND_ROWS["full" if comm_mode == "p2p_ring" else comm_mode]
    unit = recv if comm_mode == "alltoallv" else recv // max(num_ranks - 1, 1)
    hollow, hollow_rows = work.hollow_calls, work.hollow_rows
    exchange = Rows(moves * (send + ret) * unit, 0 * r, 0 * r, moves * (send_ops + ret_ops))
    forward = segment_merge_rows(b.calls, b.queries, hollow, hollow_rows) + Rows(
        f, t + r + gathers * r, 0 * r, 2 + 2 + gathers)
    backward = Rows(recv + 2 * f, 2 * gathers * r + hollow_rows, 0 * r,
                    2 * gathers + 3 + 4 * b.calls - work.whole_remote + hollow + 6,
                    f + b.keys, r + b.queries, b.queries - work.whole_remote * r)
    return (exchange + segment_forward_window_rows(work, r) + forward
            + segment_backward_window_rows(work, t, r) + backward)


def segment_merge_rows(calls: Any, queries: Any, hollow_calls: Any, hollow_rows: Any) -> Rows:
    """The log-sum-exp merges of ``calls`` calls with ``queries`` query rows in all into the
    segments path's accumulators (SEGMENT_MERGE per query row and per call); a call with a
    hollow segment masks both parts first (its ``hollow_rows`` query rows once more in each
    accumulator kind, two ops)."""
    rows, lse_rows, ops = SEGMENT_MERGE
    return Rows(0 * queries, 0 * queries, 0 * queries, ops * calls + 2 * hollow_calls,
                0 * queries, rows * queries + hollow_rows, lse_rows * queries + hollow_rows)


def segment_ring_rows(*, tokens_per_rank: Any, real: Any, work: sgw.SegmentWork,
                      ring: srw.RingStepCalls, num_ranks: int) -> Rows:
    """Rows the segment ring's copies write, forward + backward (values may be arrays):
    ``work`` the rank's segments-path counts (its local calls, the steps 0), ``ring`` its
    steps' calls summed (``ring.steps`` of them with a call). The two windows of the
    segments path (:func:`segment_forward_window_rows`,
    :func:`segment_backward_window_rows`: the local buffer's gathers unless in place, the
    accumulators and each group's first part, the local merges; the local dK/dV, the
    local calls' log-sum-exp slices and adds, dQ/dK/dV back into ``[T]``), and:

    - forward: the steps' merges (:func:`segment_merge_rows`), the output back into
      ``[T]`` (zero fill, cast of r rows, an index copy of r rows unless in place); the
      blocks are read in place;
    - backward: dO and the output gathered (r rows each, unless in place), the zeroed dQ
      accumulator (r rows), per step call its log-sum-exp slice (not when it is the whole
      accumulator), the dQ add (and the masked dQ of a call with a hollow segment) and the
      dK/dV adds of its key rows into the step's part; the T-row dK/dV accumulators as the
      ring's (:func:`path_rows`): zeros for the first and the final add into the own
      dK/dV (2T, N > 1), the add of each step's part (T per step with a call).
    """
    t, r, gathers, c = tokens_per_rank, real, 1 - work.in_place, ring.calls
    ring_on = num_ranks > 1
    forward = segment_merge_rows(c.calls, c.queries, ring.hollow_calls, ring.masked_rows) + Rows(
        0 * r, t + r + gathers * r, 0 * r, 2 + gathers)
    backward = Rows(ring_on * 2 * t + ring.steps * t, 2 * gathers * r + ring.masked_rows, 0 * r,
                    2 * gathers + 1 + 4 * c.calls - ring.whole + ring.hollow_calls
                    + 4 * ring_on + 2 * ring.steps,
                    c.keys, r + c.queries, c.queries - ring.whole * r)
    return (segment_forward_window_rows(work, r) + forward
            + segment_backward_window_rows(work, t, r) + backward)


# -- communication and linear layers ------------------------------------------------------


def transfer_ms(num_bytes: Any, link: LinkProfile, peers: int = 1, collectives: int = 1) -> Any:
    """``collectives`` collectives with ``peers`` other ranks moving ``num_bytes`` in all:
    latency + per-peer step cost each, + bytes / bandwidth."""
    return (collectives * (link.latency_us + peers * link.per_peer_us)) * 1e-3 + num_bytes / (
        link.bandwidth_gbps * 1e9) * 1e3


def linear_ms(tokens: int, model: ModelSpec, kernel: KernelProfile) -> float:
    """Forward+backward time of one layer's linear layers for ``tokens`` (padding included)."""
    return tokens * model.linear_flops_per_token / (kernel.linear_tflops * 1e12) * 1e3


def ring_shift_ms(tokens_per_rank: int, model: ModelSpec, link: LinkProfile) -> float:
    """One ring shift: the whole local K and V block to the next slot."""
    return transfer_ms(tokens_per_rank * model.kv_bytes_per_token, link, 1)


def ring_window_ms(work: KernelWork, merge: Rows, model: ModelSpec, kernel: KernelProfile) -> Any:
    """W_s: a ring step's forward work while the next shift is in flight (its calls' forward
    share and its merge copies ``merge``: :func:`merge_rows` on the ring path,
    :func:`segment_merge_rows` on segment_ring)."""
    return forward_share(kernel) * kernel_ms(work, model, kernel) + copy_ms(
        merge.bytes(model), kernel, merge.ops)


# -- the estimate --------------------------------------------------------------------------


class StepEstimate(NamedTuple):
    """Per-layer forward+backward estimate of one rank, by term."""

    kernel_ms: float
    copy_ms: float
    comm_ms: float
    """Exposed communication: what the path's overlap does not hide."""
    linear_ms: float

    @property
    def attn_ms(self) -> float:
        """The attention layer without its exchange: kernel + copies."""
        return self.kernel_ms + self.copy_ms

    @property
    def layer_ms(self) -> float:
        """The attention layer as the runtime runs it: kernel + copies + exposed exchange."""
        return self.kernel_ms + self.copy_ms + self.comm_ms

    @property
    def total_ms(self) -> float:
        return self.kernel_ms + self.copy_ms + self.comm_ms + self.linear_ms


class StepArrays(NamedTuple):
    """:class:`StepEstimate` of every rank of a group, as float64 arrays in rank order."""

    kernel_ms: np.ndarray
    copy_ms: np.ndarray
    comm_ms: np.ndarray
    linear_ms: np.ndarray

    @property
    def attn_ms(self) -> np.ndarray:
        return self.kernel_ms + self.copy_ms

    @property
    def layer_ms(self) -> np.ndarray:
        return self.kernel_ms + self.copy_ms + self.comm_ms

    @property
    def total_ms(self) -> np.ndarray:
        return self.kernel_ms + self.copy_ms + self.comm_ms + self.linear_ms


class Terms(NamedTuple):
    """A rank's (or every rank's) inputs to the estimate and the terms (scalars or arrays)."""

    work: KernelWork
    """Summed over the calls."""
    rows: Rows
    copy_bytes: Any
    comm_bytes: Any
    """Bytes moved over both passes (a ring's backward moves its blocks and accumulators)."""
    passes: Any
    """Collectives or shifts paid (0 when the rank receives nothing)."""
    peer_steps: Any
    """Per-peer steps of those: collectives x (N - 1), or one per shift."""
    transfer_ms: Any
    """Every transfer in full (what overlap off exposes)."""
    kernel_ms: Any
    copy_ms: Any
    comm_ms: Any
    linear_ms: float


def path_terms(path: str, comm_mode: str, *, tokens_per_rank: int, num_ranks: int, real: Any,
               recv: Any, local: KernelWork, extra: KernelWork, queries: Any, remote_keys: Any,
               key_tokens: Any, ring_hidden: Any, ring_mid_calls: Any, model: ModelSpec,
               kernel: KernelProfile, link: LinkProfile, overlap: bool,
               ring_bwd_hidden: Any = 0.0, ring_late_calls: Any = 0,
               segments: sgw.SegmentWork | None = None,
               segment_ring: srw.RingStepCalls | None = None) -> Terms:
    """The terms from a rank's counts (module docstring); per-rank values may be arrays,
    so :func:`rank_step` and :func:`group_steps` share every formula.

    ``local``: the gathered path's call, the local call or the segments path's local calls
    (segments, segment_ring); ``extra``: the lean remote call, the ring's steps, the segments
    path's remote calls or the segment ring's steps' calls, summed (``calls`` of them);
    ``queries``: their query rows (lean, ring). ``segments``: the segments path's counts
    (its copies and windows; segment_ring: those of its local calls). ``segment_ring``: the
    segment ring's steps' calls, summed over the steps (its copies).
    ``ring_hidden``: sum over ring steps 1..N-2 with a call of max(0, t - W_s), in step order;
    ``ring_mid_calls``: how many such steps. ``ring_bwd_hidden``: sum over ring steps
    2..N-1 with a call of max(0, t - B_s), B_s the step's backward kernel share;
    ``ring_late_calls``: how many such steps.
    """
    t_rows, n = tokens_per_rank, num_ranks
    kvb = model.kv_bytes_per_token
    work = KernelWork(local.pairs + extra.pairs, local.tiles + extra.tiles,
                      local.segments + extra.segments, local.row_blocks + extra.row_blocks,
                      local.calls + extra.calls)
    kern = kernel_ms(work, model, kernel)
    if path == "segments":
        assert segments is not None, "the segments path needs its counts"
        rows = segment_rows(comm_mode, tokens_per_rank=t_rows, real=real, recv=recv,
                            work=segments, num_ranks=n)
    elif path == "segment_ring":
        assert segments is not None and segment_ring is not None, "segment_ring needs its counts"
        rows = segment_ring_rows(tokens_per_rank=t_rows, real=real, work=segments,
                                 ring=segment_ring, num_ranks=n)
    else:
        rows = path_rows(path, comm_mode, tokens_per_rank=t_rows, real=real, recv=recv,
                         key_tokens=key_tokens, remote_keys=remote_keys, queries=queries,
                         parts=extra.calls, num_ranks=n)
    nbytes = rows.bytes(model)
    copies = copy_ms(nbytes, kernel, rows.ops) if t_rows else 0.0 * nbytes
    moves = recv > 0
    phi = forward_share(kernel)
    if path in RING_PATHS:
        shift = ring_shift_ms(t_rows, model, link)
        passes = moves * (3 * (n - 1))
        comm_bytes = moves * (3 * recv * kvb)
        transfer = moves * ((3 * (n - 1)) * shift)
        if overlap:
            k_loc = kernel_ms(local, model, kernel)
            empty = max(n - 2, 0) - ring_mid_calls
            late_empty = max(n - 2, 0) - ring_late_calls
            exposed = (np.maximum(0.0, shift - phi * k_loc) + ring_hidden + empty * shift) + (
                np.maximum(0.0, shift - (1 - phi) * k_loc) + ring_bwd_hidden
                + late_empty * shift + shift)
            comm = moves * exposed
        else:
            comm = transfer
        peer_steps = passes
    else:
        split = path != "gathered"  # K and V as two collectives each way
        passes = moves * (4 if split else 2)
        peer_steps = passes * (n - 1)
        comm_bytes = moves * (2 * recv * kvb)
        one = transfer_ms(recv * kvb, link, n - 1, 2 if split else 1)
        transfer = moves * (2 * one)
        if split and overlap:
            k_loc = kernel_ms(local, model, kernel)
            if path == "lean":
                hide_f = phi * k_loc
                win = lean_window_rows(t_rows, real, queries)
            else:
                assert segments is not None
                fw = segment_forward_window_rows(segments, real)
                hide_f = phi * k_loc + copy_ms(fw.bytes(model), kernel, fw.ops)
                win = segment_backward_window_rows(segments, t_rows, real)
            hide_b = (1 - phi) * k_loc + copy_ms(win.bytes(model), kernel, win.ops)
            comm = moves * (np.maximum(0.0, one - hide_f) + np.maximum(0.0, one - hide_b))
        else:
            comm = transfer
    return Terms(work, rows, nbytes, comm_bytes, passes, peer_steps, transfer, kern, copies,
                 comm, linear_ms(t_rows, model, kernel))


def _blocks_work(b: mw.Blocks, calls: int, segments: int = 0) -> KernelWork:
    return KernelWork(b.pairs, b.tiles, segments, b.row_blocks, calls)


def _calls_work(c: sgw.Calls) -> KernelWork:
    return KernelWork(c.pairs, c.tiles, c.segments, c.row_blocks, c.calls)


def rank_terms(
    shards: Sequence[Shard],
    *,
    recv_tokens: int,
    tokens_per_rank: int,
    num_ranks: int,
    comm_mode: str,
    model: ModelSpec,
    kernel: KernelProfile,
    link: LinkProfile,
    tiles: int | None = None,
    overlap: bool = RUNTIME_OVERLAP,
    ring_blocks: Sequence[Sequence[Shard]] | None = None,
    flash_path: str = RUNTIME_FLASH_PATH,
) -> Terms:
    """:func:`rank_step`'s terms with their inputs (what a fit regresses on)."""
    path = execution_path(kernel, comm_mode, flash_path)
    real = sum(s.end - s.start for s in shards)
    zero = KernelWork(0, 0, 0, 0, 0)
    common: dict[str, Any] = dict(tokens_per_rank=tokens_per_rank, num_ranks=num_ranks, real=real,
                                  recv=recv_tokens, model=model, kernel=kernel, link=link,
                                  overlap=overlap)
    if path == "gathered":
        work = kernel_work(shards, kernel, tiles=tiles)
        return path_terms(path, comm_mode, local=work, extra=zero, queries=0, remote_keys=0,
                          key_tokens=key_rows(shards), ring_hidden=0.0, ring_mid_calls=0,
                          **common)
    bq, bk = kernel.tile_q, kernel.tile_k
    if path == "segments":
        sw = sgw.segment_work(shards, bq, bk)
        return path_terms(path, comm_mode, local=_calls_work(sw.local),
                          extra=_calls_work(sw.remote), queries=0, remote_keys=sw.remote_keys,
                          key_tokens=0, ring_hidden=0.0, ring_mid_calls=0, segments=sw, **common)
    if path == "lean":
        lw = mw.lean_work(shards, bq, bk)
        local = _blocks_work(lw.local, 1, len(shards))
        parts = int(lw.remote.queries > 0)
        return path_terms(path, comm_mode, local=local, extra=_blocks_work(lw.remote, parts),
                          queries=lw.remote.queries, remote_keys=lw.remote_keys, key_tokens=0,
                          ring_hidden=0.0, ring_mid_calls=0, **common)
    if num_ranks > 1 and (ring_blocks is None or len(ring_blocks) != num_ranks - 1):
        raise ValueError(f"ring_blocks must list the {num_ranks - 1} blocks a ring rank attends "
                         "(the shards of slots i - 1, ..., i - N + 1)")
    blocks = list(ring_blocks or ())
    if num_ranks > 1:
        held = [(r, sh.doc) for r, rank in enumerate((shards, *blocks))
                for sh in rank if sh.end > sh.start]
        mw.check_ring_size(mw.ring_pairs(np.array([r for r, _ in held], dtype=np.int64),
                                         np.array([d for _, d in held], dtype=np.int64)))
    shift = ring_shift_ms(tokens_per_rank, model, link)
    if path == "segment_ring":
        sw = sgw.segment_work(shards, bq, bk)
        ring = srw.segment_ring_work(shards, blocks, bq, bk)
        per_step = [(_calls_work(st.calls), segment_merge_rows(
            st.calls.calls, st.calls.queries, st.hollow_calls, st.masked_rows)) if st.steps else None
            for st in ring]
        total = srw.summed(ring)
        return path_terms(path, comm_mode, local=_calls_work(sw.local),
                          extra=_calls_work(total.calls), queries=0, remote_keys=0, key_tokens=0,
                          segments=sw, segment_ring=total,
                          **_ring_hiding(per_step, num_ranks, shift, model, kernel), **common)
    local_blocks = mw.masked_blocks(*mw.shard_rows(shards), *mw.shard_rows(shards), bq, bk)
    local = _blocks_work(local_blocks, 1, len(shards))
    steps = [mw.ring_step_work(shards, block, bq, bk) for block in blocks]
    called = [b for b in steps if b.queries]
    extra = KernelWork(sum(b.pairs for b in called), sum(b.tiles for b in called), 0,
                       sum(b.row_blocks for b in called), len(called))
    per_step = [(_blocks_work(b, 1), merge_rows(b.queries)) if b.queries else None for b in steps]
    return path_terms(path, comm_mode, local=local, extra=extra,
                      queries=sum(b.queries for b in called), remote_keys=0, key_tokens=0,
                      **_ring_hiding(per_step, num_ranks, shift, model, kernel), **common)


def _ring_hiding(parts: Sequence[tuple[KernelWork, Rows] | None], num_ranks: int, shift: float,
                 model: ModelSpec, kernel: KernelProfile) -> dict[str, Any]:
    """:func:`path_terms`' ring arguments from each step's (calls, merge copies), None for
    a step without a call, steps 1..N-1 in order."""
    hidden = bwd_hidden = 0.0
    mid = late = 0
    phi = forward_share(kernel)
    for s, part in enumerate(parts, start=1):
        if part is None:
            continue
        work, merge = part
        if s <= num_ranks - 2:
            hidden += max(0.0, shift - ring_window_ms(work, merge, model, kernel))
            mid += 1
        if s >= 2:
            bwd_hidden += max(0.0, shift - (1 - phi) * kernel_ms(work, model, kernel))
            late += 1
    return dict(ring_hidden=hidden, ring_mid_calls=mid, ring_bwd_hidden=bwd_hidden,
                ring_late_calls=late)


def _group_ring_hiding(rank: np.ndarray, step: np.ndarray, work: KernelWork, merge: Rows,
                       num_ranks: int, shift: float, model: ModelSpec,
                       kernel: KernelProfile) -> dict[str, Any]:
    """:func:`_ring_hiding` of every rank from one entry per (rank, step) with a call,
    sorted by (rank, step): fields of ``work`` and ``merge`` are arrays over the entries
    (or scalars)."""
    def take(x: Any, keep: np.ndarray) -> Any:
        return type(x)(*(f[keep] if isinstance(f, np.ndarray) else f for f in x))

    n = num_ranks
    mid = step <= n - 2
    w = ring_window_ms(take(work, mid), take(merge, mid), model, kernel)
    late = step >= 2
    b_s = (1 - forward_share(kernel)) * kernel_ms(take(work, late), model, kernel)
    return dict(ring_hidden=np.bincount(rank[mid], weights=np.maximum(0.0, shift - w), minlength=n),
                ring_mid_calls=np.bincount(rank[mid], minlength=n),
                ring_bwd_hidden=np.bincount(rank[late], weights=np.maximum(0.0, shift - b_s),
                                            minlength=n),
                ring_late_calls=np.bincount(rank[late], minlength=n))


def rank_step(
    shards: Sequence[Shard],
    *,
    recv_tokens: int,
    tokens_per_rank: int,
    num_ranks: int,
    comm_mode: str,
    model: ModelSpec,
    kernel: KernelProfile,
    link: LinkProfile,
    tiles: int | None = None,
    overlap: bool = RUNTIME_OVERLAP,
    ring_blocks: Sequence[Sequence[Shard]] | None = None,
    flash_path: str = RUNTIME_FLASH_PATH,
) -> StepEstimate:
    """Estimate one rank's per-layer time (module docstring). O(shards + tiles) on the
    gathered path, O(M^2 D + tiles) on the segments path (M the most shards of one of the
    rank's D documents), O(M^2 D + N (shards + block shards) M) on segment_ring, O(rows +
    blocks) on the others (the reference :func:`group_steps` equals).

    ``recv_tokens``: what the rank receives per pass in ``comm_mode`` (``p2p_ring``: the
    (N - 1) x tokens_per_rank the ring's forward moves). ``tiles``: the shards' segment tiles
    when already counted (gathered path only). ``overlap``: the runtime's switch (no effect
    on the gathered path). ``ring_blocks``: on the ring paths (RING_PATHS) with N > 1, the
    shards of the blocks the rank attends at steps 1..N-1 (slots i - 1, i - 2, ... mod N).
    ``flash_path``: how a ``segment``-tiling kernel runs (FLASH_PATHS). Shards in (doc, start) order,
    disjoint, as plans hold them (the segments path takes them in local-row order).
    """
    t = rank_terms(shards, recv_tokens=recv_tokens, tokens_per_rank=tokens_per_rank,
                   num_ranks=num_ranks, comm_mode=comm_mode, model=model, kernel=kernel,
                   link=link, tiles=tiles, overlap=overlap, ring_blocks=ring_blocks,
                   flash_path=flash_path)
    return StepEstimate(float(t.kernel_ms), float(t.copy_ms), float(t.comm_ms), float(t.linear_ms))


def group_steps(
    arrays: ShardArrays,
    *,
    recv_tokens: np.ndarray,
    tokens_per_rank: int,
    num_ranks: int,
    comm_mode: str,
    model: ModelSpec,
    kernel: KernelProfile,
    link: LinkProfile,
    tiles: np.ndarray | None = None,
    overlap: bool = RUNTIME_OVERLAP,
    flash_path: str = RUNTIME_FLASH_PATH,
) -> StepArrays:
    """:func:`rank_step` of every rank of a group at once (equal to it rank by rank; shard i
    of ``arrays`` on rank ``arrays.rank[i]``, slot order = rank order, each rank's shards
    in its local-row order), in numpy: gathered path O(shards + tiles), segments
    O(s log s + c) for c candidate remote calls (M (M + 1) / 2 per rank, M the most shards
    of one doc on it), lean O(s log s + blocks), ring O(s log s + t + blocks) for t
    (shard, other holder of its doc) pairs, segment_ring the segments path's local calls
    and O(t log t) (core/segment_ring_work.py). No loop over ranks. ``tiles``: per-rank segment
    tiles of the gathered path when already counted (unused on the other paths)."""
    n = num_ranks
    recv = np.asarray(recv_tokens, dtype=np.int64)
    lengths = arrays.end - arrays.start
    real = per_rank_sums(lengths, arrays.bounds)
    segments = np.diff(arrays.bounds)
    path = execution_path(kernel, comm_mode, flash_path)
    common: dict[str, Any] = dict(tokens_per_rank=tokens_per_rank, num_ranks=n, real=real,
                                  recv=recv, model=model, kernel=kernel, link=link,
                                  overlap=overlap)
    zero = np.zeros(n, dtype=np.int64)
    none = KernelWork(zero, zero, zero, zero, zero)
    if path == "gathered":
        if tiles is None:
            tiles = per_rank_sums(
                attention_tiles_of(arrays.start, lengths, kernel.tile_q, kernel.tile_k), arrays.bounds)
        tiles = np.asarray(tiles, dtype=np.int64)
        rows = per_rank_sums(-(-lengths // kernel.tile_q), arrays.bounds)
        work = KernelWork(tiles * kernel.tile_q * kernel.tile_k, tiles, segments, rows, 1 + zero)
        t = path_terms(path, comm_mode, local=work, extra=none, queries=zero, remote_keys=zero,
                       key_tokens=per_rank_sums(arrays.end, arrays.bounds), ring_hidden=0.0,
                       ring_mid_calls=0, **common)
        return _arrays(t, n)
    bq, bk = kernel.tile_q, kernel.tile_k
    if path == "segments":
        sw = sgw.group_segment_work(arrays.rank, arrays.doc, arrays.start, arrays.end, n, bq, bk)
        t = path_terms(path, comm_mode, local=_calls_work(sw.local), extra=_calls_work(sw.remote),
                       queries=zero, remote_keys=sw.remote_keys, key_tokens=zero, ring_hidden=0.0,
                       ring_mid_calls=0, segments=sw, **common)
        return _arrays(t, n)
    s = mw.sort_shards(arrays.rank, arrays.doc, arrays.start, arrays.end, n)
    if path == "lean":
        lw = mw.group_lean_work(s, bq, bk)
        local = KernelWork(lw.local.pairs, lw.local.tiles, segments, lw.local.row_blocks, 1 + zero)
        parts = (lw.remote.queries > 0).astype(np.int64)
        extra = KernelWork(lw.remote.pairs, lw.remote.tiles, zero, lw.remote.row_blocks, parts)
        t = path_terms(path, comm_mode, local=local, extra=extra, queries=lw.remote.queries,
                       remote_keys=lw.remote_keys, key_tokens=zero, ring_hidden=0.0,
                       ring_mid_calls=0, **common)
        return _arrays(t, n)
    shift = ring_shift_ms(tokens_per_rank, model, link)
    if path == "segment_ring":
        sw = sgw.group_segment_work(arrays.rank, arrays.doc, arrays.start, arrays.end, n, bq, bk)
        gr = srw.group_segment_ring_work(s, bq, bk)
        st = gr.work

        def by_rank(x: np.ndarray) -> np.ndarray:
            return np.bincount(gr.rank, weights=x, minlength=n).astype(np.int64)

        total = srw.RingStepCalls(sgw.Calls(*(by_rank(x) for x in st.calls)),
                                  *(by_rank(x) for x in st[1:]))
        merge = segment_merge_rows(st.calls.calls, st.calls.queries, st.hollow_calls, st.masked_rows)
        t = path_terms(path, comm_mode, local=_calls_work(sw.local), extra=_calls_work(total.calls),
                       queries=zero, remote_keys=zero, key_tokens=zero, segments=sw,
                       segment_ring=total,
                       **_group_ring_hiding(gr.rank, gr.step, _calls_work(st.calls), merge, n,
                                            shift, model, kernel), **common)
        return _arrays(t, n)
    lb = mw.blocks_of_calls(s.rank, s.length, s.rank_row[s.run_first[s.run]], s.rank_row, True,
                            n, bq, bk)
    local = KernelWork(lb.pairs, lb.tiles, segments, lb.row_blocks, 1 + zero)
    rw = mw.group_ring_work(s, bq, bk)
    b = rw.blocks

    def per_rank(x: np.ndarray) -> np.ndarray:
        return np.bincount(rw.rank, weights=x, minlength=n).astype(np.int64)

    extra = KernelWork(per_rank(b.pairs), per_rank(b.tiles), zero, per_rank(b.row_blocks),
                       np.bincount(rw.rank, minlength=n).astype(np.int64))
    step_work = KernelWork(b.pairs, b.tiles, 0, b.row_blocks, 1)
    t = path_terms(path, comm_mode, local=local, extra=extra, queries=per_rank(b.queries),
                   remote_keys=zero, key_tokens=zero,
                   **_group_ring_hiding(rw.rank, rw.step, step_work, merge_rows(b.queries), n,
                                        shift, model, kernel), **common)
    return _arrays(t, n)


def _arrays(t: Terms, n: int) -> StepArrays:
    def f(x: Any) -> np.ndarray:
        return np.broadcast_to(np.asarray(x, dtype=np.float64), (n,)).copy()

    return StepArrays(f(t.kernel_ms), f(t.copy_ms), f(t.comm_ms), f(t.linear_ms))


class RankTerms(NamedTuple):
    """One rank's inputs to the estimate (what a fit regresses on) and the estimate."""

    group: int
    rank: int
    path: str
    work: KernelWork
    fwd_flops: float
    copy_bytes: int
    copy_ops: int
    comm_bytes: int
    """Bytes moved over both passes."""
    passes: int
    """Collectives or ring shifts paid (0 when the rank receives nothing)."""
    peer_steps: int
    """Per-peer steps of those."""
    transfer_ms: float
    """Every transfer in full under the link profile (the exposed part is ``estimate.comm_ms``)."""
    estimate: StepEstimate


def plan_rank_terms(
    plan: Plan, kernel: KernelProfile, link: LinkProfile, *, comm_mode: str | None = None,
    model: ModelSpec | None = None, overlap: bool = RUNTIME_OVERLAP,
    flash_path: str = RUNTIME_FLASH_PATH,
) -> list[RankTerms]:
    """Per grouped rank of ``plan``, the terms of :func:`rank_step` under any profiles
    (``plan.metrics`` holds them under the plan's named profiles). ``comm_mode`` defaults
    to the plan's; ``flash_path`` is the runtime's by default. O(shards + tiles) per rank
    (ring: per rank and step)."""
    mode = comm_mode or plan.comm_mode
    model = model or plan.model
    out = []
    for gi, group in enumerate(plan.groups):
        n = len(group.ranks)
        tokens_per_rank = max(
            sum(s.end - s.start for s in shards) + pad
            for shards, pad in zip(group.shards, group.padding, strict=True)
        )
        recv = recv_tokens_by_mode(mode, comm_volumes(group.shards), tokens_per_rank)
        for slot, (rank, shards, r) in enumerate(zip(group.ranks, group.shards, recv, strict=True)):
            blocks = [group.shards[(slot - s) % n] for s in range(1, n)]
            t = rank_terms(shards, recv_tokens=r, tokens_per_rank=tokens_per_rank, num_ranks=n,
                           comm_mode=mode, model=model, kernel=kernel, link=link,
                           overlap=overlap, ring_blocks=blocks, flash_path=flash_path)
            est = StepEstimate(float(t.kernel_ms), float(t.copy_ms), float(t.comm_ms),
                               float(t.linear_ms))
            out.append(RankTerms(
                gi, rank, execution_path(kernel, mode, flash_path), t.work,
                4.0 * model.head_dim * model.num_heads * t.work.pairs, int(t.copy_bytes),
                int(t.rows.ops), int(t.comm_bytes), int(t.passes), int(t.peer_steps),
                float(t.transfer_ms), est,
            ))
    return out
