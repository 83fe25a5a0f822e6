"""Per-layer step-time estimate of one rank: what the worker runtime executes, term by term.

The runtime (worker_runtime/) runs one attention layer (forward + backward) on one of five
paths (``core.paths.ExecutionPath``), set by the kernel's tiling, the comm mode and, for
flash-attn, its ``flash_path`` (:func:`execution_path`). Each path has one module here,
named after it, that says what the path does and what it costs:

- ``segments.py``: flash-attn's varlen calls per piece pair, the gather modes;
- ``gathered.py``: flash-attn on gathered keys, one blocking exchange each way;
- ``lean.py``: the PyTorch kernel on a gather mode, the exchange behind the local call;
- ``ring.py``: the PyTorch kernel on a ``p2p_ring`` plan, the K/V blocks passed round;
- ``segment_ring.py``: flash-attn's varlen calls on a ``p2p_ring`` plan.

Shared by them: ``terms.py`` (the terms and their prices, the protocol), ``blocks.py`` (the
PyTorch kernel's blocks: lean, ring), ``segment_calls.py`` (flash-attn's varlen calls:
segments, segment_ring), ``runs.py`` (a group's (rank, doc) runs and a ring's pairs),
``shifts.py`` (a ring's exchange: ring, segment_ring); ``drivers.py`` holds the drivers and
the table. ``windowed.py`` prices a sliding-window layer (the drivers' ``window``) on the
flash paths, in the gathered form the runtime runs them under a window; ``windowed_lean.py``
and ``windowed_ring.py`` on the PyTorch kernel's lean path and ring, their own windowed calls.

**Protocol.** Each path module exposes ``MODEL = PathModel(terms, group_terms, hides)``:
``terms(RankInput) -> Terms`` for one rank from its shards (the reference),
``group_terms(GroupInput) -> Terms`` for every rank of a group at once in numpy (equal to
it rank by rank), each giving the calls (:class:`KernelWork`), the copies (:class:`Rows`)
and the exchange (``terms.Exchange``), added up by ``terms.assemble``; ``hides`` names what
its overlap hides in FCP's closed form (fcp/cost_model.py). ``drivers.PATH_MODELS`` maps
every ``ExecutionPath`` to its model; :func:`rank_step`, :func:`group_steps` and
:func:`plan_rank_terms` look the path up there.

**Adding a path**: one enum member in core/paths.py (and its case in the rule), one module
here exposing ``MODEL`` with its entry in ``drivers.PATH_MODELS``, one runtime module in
worker_runtime/paths/, one test module (docs/paths.md).

Terms (forward + backward, milliseconds):

``kernel``  Sum over the path's calls: FLOPs at the profile's rates, plus
            ``call_overhead_us`` per call (fwd + bwd), ``per_seq_us`` per document segment
            (segments, segment_ring: per segment of every call; the other paths: per
            shard, once), ``per_tile_us`` per tile and ``per_row_block_us`` per query tile.
            Flash-attn tiles (``segment`` tiling): a started tile costs a full tile. Lean
            and ring: the PyTorch kernel's blocks of tile_q query rows x tile_k keys over
            doc-masked key sets (blocks.py), dense inside a block.
``copy``    Bytes written by the path's eager copies at ``copy_gbps``, plus
            ``op_overhead_us`` per op. The flash paths' accumulators are float32 (float64
            for float64 inputs).
``comm``    Exposed exchange. A collective over the N - 1 peers costs ``latency_us +
            (N - 1) per_peer_us``, a ring shift ``latency_us + per_peer_us``, plus bytes /
            bandwidth; R = tokens received per pass, T = rows per rank, b = K+V bytes per
            token, phi = the forward share of a call's time (:func:`forward_share`). What
            each path hides is in its module. No comm when the rank receives nothing.
``linear``  the layer's GEMMs on every local row, padding included.

Padding rows cost copies, transfers and linear time, not kernel time. On the lean and ring
paths every row is counted at ``model.dtype_bytes`` (the PyTorch kernel computes in the
input dtype for float32 and float64).
"""

from planner_service.core.paths import RING_PATHS, RUNTIME_FLASH_PATH
from planner_service.core.step_time.drivers import (
    PATH_MODELS,
    RankTerms,
    execution_path,
    group_steps,
    held_kv_mode,
    plan_rank_terms,
    rank_step,
    rank_terms,
)
from planner_service.core.step_time.gathered import (
    attention_tiles,
    attention_tiles_of,
    attention_tiles_per_shard,
    gathered_rows,
    kernel_work,
    key_rows,
)
from planner_service.core.step_time.lean import lean_rows, lean_window_rows
from planner_service.core.step_time.ring import merge_rows, ring_rows
from planner_service.core.step_time.segment_ring import segment_ring_rows
from planner_service.core.step_time.segments import (
    SEGMENT_MERGE,
    segment_backward_window_rows,
    segment_forward_window_rows,
    segment_merge_rows,
    segment_rows,
)
from planner_service.core.step_time.shifts import ring_shift_ms, ring_window_ms
from planner_service.core.step_time.terms import (
    BWD_FLOP_RATIO,
    COPY_OPS,
    MERGE_OPS,
    PART_OPS,
    RUNTIME_OVERLAP,
    SEND_ROWS,
    GroupInput,
    KernelWork,
    PathModel,
    RankInput,
    Rows,
    Step,
    StepArrays,
    StepEstimate,
    Terms,
    accumulator_bytes,
    copy_ms,
    forward_share,
    kernel_ms,
    linear_ms,
    transfer_ms,
)

__all__ = [
    "BWD_FLOP_RATIO", "COPY_OPS", "MERGE_OPS", "PART_OPS", "PATH_MODELS", "RING_PATHS",
    "RUNTIME_FLASH_PATH", "RUNTIME_OVERLAP", "SEGMENT_MERGE", "SEND_ROWS", "GroupInput",
    "KernelWork", "PathModel", "RankInput", "RankTerms", "Rows", "Step", "StepArrays",
    "StepEstimate", "Terms", "accumulator_bytes", "attention_tiles", "attention_tiles_of",
    "attention_tiles_per_shard", "copy_ms", "execution_path", "forward_share", "gathered_rows",
    "group_steps", "held_kv_mode", "kernel_ms", "kernel_work", "key_rows", "lean_rows",
    "lean_window_rows", "linear_ms", "merge_rows", "plan_rank_terms", "rank_step", "rank_terms",
    "ring_rows", "ring_shift_ms", "ring_window_ms", "segment_backward_window_rows",
    "segment_forward_window_rows", "segment_merge_rows", "segment_ring_rows", "segment_rows",
    "transfer_ms",
]
