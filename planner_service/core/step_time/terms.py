"""The terms every execution path is priced on, and the protocol a path's model follows.

A path's model (:class:`PathModel`) counts what its runtime path does on a rank, or on
every rank of a group at once: the kernel calls (:class:`KernelWork`, priced by
:func:`kernel_ms`), the rows its eager copies write (:class:`Rows`, priced by
:func:`copy_ms`) and its exchange (:class:`Exchange`: the transfers of :func:`transfer_ms`
and the part the path's overlap leaves exposed). :func:`assemble` adds them up into
:class:`Terms` the same way for every path, from ints (one rank) or int64 arrays (a
group), so the per-rank reference and the group form share every formula.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from planner_service.core.cost import ShardArrays
from planner_service.core.model import ModelSpec
from planner_service.core.plan import Shard
from planner_service.core.profiles import KernelProfile, LinkProfile

BWD_FLOP_RATIO = 2.5
"""Backward attention does 2.5x the forward FLOPs (5 vs 2 matmuls; FlashAttention-2 paper)."""

RUNTIME_OVERLAP = True
"""The runtime's default (``ContextParallelAttention(overlap=True)``; a test checks it)."""


class KernelWork(NamedTuple):
    """What one rank's kernel calls compute, summed over the calls (ints; int64 arrays with
    one entry per rank in the group form)."""

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


def accumulator_bytes(model: ModelSpec) -> int:
    """Element size of the flash paths' accumulators: float32, float64 for float64."""
    return 8 if model.dtype_bytes == 8 else 4


class Rows(NamedTuple):
    """Rows written by eager copies: K+V rows (``kv_bytes_per_token`` each), query-shaped
    rows (heads x head_dim), log-sum-exp rows (heads), the op count, and the same three
    row kinds in the accumulator dtype (:func:`accumulator_bytes`; the flash paths)."""

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


MERGE_OPS = 13
"""Ops of one log-sum-exp merge with its query select (overlap.merge_parts)."""
PART_OPS = 20
"""Ops a second part (lean remote part, ring step) adds, forward + backward: query select
and merge (13); backward selects of dO, Q, LSE, delta (4), dQ add (1), and the dK/dV
write (lean: index_copy into the return buffer; ring: the accumulator add) (2)."""
SEND_ROWS = {"full": (0, 0, 2, 4), "compact_allgather": (2, 4, 2, 4), "alltoallv": (1, 2, 1, 2)}
"""The split exchange's buffers per gather mode (lean and segments paths): (send-buffer
rows, ops, returned-gradient rows, ops), rows in units of the per-peer buffer
B = R / (N - 1) (all-gathers) or of R (all-to-all-v). Compact: zeroed buffer +
index_select (2B), sum of the returned blocks + index_add (2B); full sends its K and V in
place; all-to-all-v: index_select of the sent rows, index_add of the returned (the sent
rows taken as R)."""


def exchange_rows(comm_mode: str, recv: Any, num_ranks: int) -> tuple[Any, Any]:
    """(K+V rows, ops) of the split exchange's send and return buffers (SEND_ROWS) for a
    rank receiving ``recv`` tokens per pass; ``p2p_ring`` runs as ``full``. Zero when the
    rank receives nothing."""
    moves = recv > 0
    send, send_ops, ret, ret_ops = SEND_ROWS["full" if comm_mode == "p2p_ring" else comm_mode]
    unit = recv if comm_mode == "alltoallv" else recv // max(num_ranks - 1, 1)
    return moves * ((send + ret) * unit), moves * (send_ops + ret_ops)


COPY_OPS = 16
"""Eager tensor ops around the kernel on the gathered path, forward + backward (attention.py,
comm.py): forward stack, send index_select, buffer fill, receive concat, source concat, two
key gathers, padding concat; backward two gather scatter-adds with their zero buffers,
local clone, receive buffer, gradient index_add, stack split."""


def copy_ms(num_bytes: Any, kernel: KernelProfile, ops: Any = COPY_OPS) -> Any:
    """Copy time: bytes / copy bandwidth + ``ops`` eager-op overheads."""
    return num_bytes / (kernel.copy_gbps * 1e9) * 1e3 + ops * kernel.op_overhead_us * 1e-3


def transfer_ms(num_bytes: Any, link: LinkProfile, peers: int = 1, collectives: int = 1) -> Any:
    """``collectives`` collectives with ``peers`` other ranks moving ``num_bytes`` in all:
    latency + per-peer step cost each, + bytes / bandwidth."""
    return (collectives * (link.latency_us + peers * link.per_peer_us)) * 1e-3 + num_bytes / (
        link.bandwidth_gbps * 1e9) * 1e3


def linear_ms(tokens: int, model: ModelSpec, kernel: KernelProfile) -> float:
    """Forward+backward time of one layer's linear layers for ``tokens`` (padding included)."""
    return tokens * model.linear_flops_per_token / (kernel.linear_tflops * 1e12) * 1e3


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


class Exchange(NamedTuple):
    """A rank's (or every rank's) exchange over both passes."""

    comm_bytes: Any
    """Bytes moved over both passes (a ring's backward moves its blocks and accumulators)."""
    passes: Any
    """Collectives or shifts paid (0 when the rank receives nothing)."""
    peer_steps: Any
    """Per-peer steps of those: collectives x (N - 1), or one per shift."""
    transfer_ms: Any
    """Every transfer in full (what overlap off exposes)."""
    comm_ms: Any
    """The exposed part."""


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


# -- the protocol ---------------------------------------------------------------------------


class Step(NamedTuple):
    """What every path's terms take besides the shards: the group's shape, the exchange,
    the profiles and the runtime's overlap switch."""

    tokens_per_rank: int
    """T: rows per rank, padding included."""
    num_ranks: int
    comm_mode: str
    model: ModelSpec
    kernel: KernelProfile
    link: LinkProfile
    overlap: bool


class RankInput(NamedTuple):
    """One rank's inputs (the per-rank reference)."""

    step: Step
    shards: Sequence[Shard]
    """In (doc, start) order, disjoint, as plans hold them (local-row order)."""
    recv: int
    """Tokens received per pass in the plan's exchange."""
    real: int
    """The rank's real rows."""
    tiles: int | None
    """The shards' segment tiles when already counted (the gathered path)."""
    ring_blocks: Sequence[Sequence[Shard]] | None
    """The shards of the blocks of slots i - 1, ..., i - N + 1 (the ring paths)."""


class GroupInput(NamedTuple):
    """Every rank of a group at once (shard i of ``arrays`` on rank ``arrays.rank[i]``,
    slot order = rank order, each rank's shards in its local-row order)."""

    step: Step
    arrays: ShardArrays
    recv: np.ndarray
    """Tokens each rank receives per pass (int64)."""
    real: np.ndarray
    """Real rows per rank (int64)."""
    tiles: np.ndarray | None
    """Per-rank segment tiles when already counted (the gathered path)."""


class PathModel(NamedTuple):
    """The model of one execution path: the same counts per rank and for a whole group."""

    terms: Callable[[RankInput], Terms]
    """One rank's terms, from its shards (the reference)."""
    group_terms: Callable[[GroupInput], Terms]
    """Every rank's terms at once (int64 and float64 arrays, one entry per rank), equal to
    ``terms`` rank by rank."""
    hides: str
    """What the path's overlap hides of the exchange, in FCP's closed form
    (``fcp.cost_model.OVERLAPS``): ``none`` (blocking), ``local`` (behind the calls on
    the rank's own keys) or ``ring`` (behind the ring's steps)."""


def add_work(a: KernelWork, b: KernelWork) -> KernelWork:
    """Two sets of calls summed (fields may be arrays)."""
    return KernelWork(a.pairs + b.pairs, a.tiles + b.tiles, a.segments + b.segments,
                      a.row_blocks + b.row_blocks, a.calls + b.calls)


def assemble(step: Step, work: KernelWork, rows: Rows, exchange: Exchange) -> Terms:
    """The terms from a rank's calls, copies and exchange (values may be arrays): kernel at
    the profile's rates, copies at its copy rate (none with no rows per rank), the linear
    layers on every row, padding included."""
    model, kernel = step.model, step.kernel
    nbytes = rows.bytes(model)
    copies = copy_ms(nbytes, kernel, rows.ops) if step.tokens_per_rank else 0.0 * nbytes
    return Terms(work, rows, nbytes, exchange.comm_bytes, exchange.passes, exchange.peer_steps,
                 exchange.transfer_ms, kernel_ms(work, model, kernel), copies, exchange.comm_ms,
                 linear_ms(step.tokens_per_rank, model, kernel))


def collectives(step: Step, recv: Any, per_pass: int, hides: tuple[Any, Any] | None) -> Exchange:
    """The gather modes' exchange: per pass (forward K/V, backward dK/dV) ``per_pass``
    collectives over the N - 1 peers moving R b bytes in all (b = K+V bytes per token).
    ``hides``: (H_f, H_b), the work in flight during each pass (the path's overlap), or
    None for a blocking exchange; exposed ``max(0, X - H_f) + max(0, X - H_b)`` for
    X = one pass. Nothing when the rank receives nothing."""
    n, kvb = step.num_ranks, step.model.kv_bytes_per_token
    moves = recv > 0
    passes = moves * (2 * per_pass)
    one = transfer_ms(recv * kvb, step.link, n - 1, per_pass)
    transfer = moves * (2 * one)
    if hides is None:
        comm = transfer
    else:
        hide_f, hide_b = hides
        comm = moves * (np.maximum(0.0, one - hide_f) + np.maximum(0.0, one - hide_b))
    return Exchange(moves * (2 * recv * kvb), passes, passes * (n - 1), transfer, comm)


def window_hides(step: Step, local: KernelWork, forward: Rows | None, backward: Rows) -> tuple[Any, Any]:
    """(H_f, H_b) of a split exchange: the local calls' forward share (phi K_loc) plus the
    copies ``forward`` before the forward wait (None: no copy counted there), and their
    backward share plus the copies ``backward`` before the backward wait."""
    model, kernel = step.model, step.kernel
    k_loc = kernel_ms(local, model, kernel)
    phi = forward_share(kernel)
    hide_f = phi * k_loc
    if forward is not None:
        hide_f = hide_f + copy_ms(forward.bytes(model), kernel, forward.ops)
    return hide_f, (1 - phi) * k_loc + copy_ms(backward.bytes(model), kernel, backward.ops)
