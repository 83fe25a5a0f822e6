"""Worker runtime: executes planner plans with torch.distributed (docs/runtime.md).

``ContextParallelAttention(plan, rank, group)`` gives the local token layout (indices,
doc ids, positions), ``dispatch``/``undispatch`` and a differentiable ``attention(q, k,
v)`` whose KV exchange is ``full``, ``compact_allgather``, ``alltoallv`` (overlapped with
the local-key attention, one copy of the distinct remote KV kept) or a ``p2p_ring``. The
runtime never solves: plans come from ``planner_service``.
"""

import importlib.util

if importlib.util.find_spec("torch") is None:
    raise ImportError("worker_runtime needs torch: pip install 'cp-planner[worker]'")

from worker_runtime.attention import RUN_MODES, ContextParallelAttention, resolve_comm_mode
from worker_runtime.comm import CommCounter
from worker_runtime.groups import GroupCache, clear_group_caches, group_cache
from worker_runtime.kernels import build_meta, flash_attn_available, varlen_attention
from worker_runtime.layout import (
    GATHER_MODES,
    CommMap,
    RankLayout,
    build_comm_map,
    build_layout,
    expand_ranges,
    planned_kv_tokens_peak,
    planned_recv_tokens,
)
from worker_runtime.reference import document_mask, reference_attention
from worker_runtime.safety import CollectiveCheckError, broadcast_plan

__all__ = [
    "GATHER_MODES",
    "RUN_MODES",
    "CollectiveCheckError",
    "CommCounter",
    "CommMap",
    "ContextParallelAttention",
    "GroupCache",
    "RankLayout",
    "broadcast_plan",
    "build_comm_map",
    "build_layout",
    "build_meta",
    "clear_group_caches",
    "document_mask",
    "expand_ranges",
    "flash_attn_available",
    "group_cache",
    "planned_kv_tokens_peak",
    "planned_recv_tokens",
    "reference_attention",
    "resolve_comm_mode",
    "varlen_attention",
]
