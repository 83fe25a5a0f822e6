"""Move tensors between the global packed order and a rank's local layout.

``dispatch`` picks this rank's rows (shards in plan order, then padding rows filled with
``pad_value``); ``undispatch`` puts local rows back at their global positions. Both are
plain indexing, so they are differentiable and need no communication; ``gather_global``
assembles a whole group's rows with one all-gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from worker_runtime.layout import RankLayout, expand_ranges


def _total(layout: RankLayout) -> int:
    return int(layout.doc_offsets[-1])


def dispatch(layout: RankLayout, x: torch.Tensor, pad_value: float | int = 0) -> torch.Tensor:
    """Local rows ``[num_tokens, ...]`` of a global ``[total_tokens, ...]`` tensor.

    Raises ValueError if ``x.shape[0]`` is not the plan's total token count.
    """
    if x.shape[0] != _total(layout):
        raise ValueError(f"x must have the plan's {_total(layout)} tokens in dim 0, got {x.shape[0]}")
    idx = torch.from_numpy(layout.global_index[: layout.num_real]).to(x.device)
    pad = x.new_full((layout.num_tokens - layout.num_real, *x.shape[1:]), pad_value)
    return torch.cat((x.index_select(0, idx), pad))


def undispatch(layout: RankLayout, y: torch.Tensor) -> torch.Tensor:
    """Global ``[total_tokens, ...]`` tensor holding this rank's rows, zeros elsewhere.

    Summing it over all ranks gives the whole global tensor. Raises ValueError if
    ``y.shape[0]`` is not the rank's local token count.
    """
    if y.shape[0] != layout.num_tokens:
        raise ValueError(f"y must have this rank's {layout.num_tokens} tokens in dim 0, got {y.shape[0]}")
    idx = torch.from_numpy(layout.global_index[: layout.num_real]).to(y.device)
    out = y.new_zeros((_total(layout), *y.shape[1:]))
    return out.index_copy(0, idx, y[: layout.num_real])


def group_global_index(layout: RankLayout, order: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rows, global positions) of every real token of the group in an all-gather of the
    group's local buffers (blocks in ``order``: slot -> rank in the process group)."""
    a = layout.arrays
    if a is None:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    coll = np.argsort(np.argsort(a.ranks)) if order is None else np.asarray(order)
    length = a.end - a.start
    rows = expand_ranges(coll[a.slot] * a.tokens_per_rank + a.local_start, length)
    return rows, expand_ranges(layout.doc_offsets[a.doc] + a.start, length)


def gather_global(
    layout: RankLayout, y: torch.Tensor, group: Any, order: Sequence[int] | None = None
) -> torch.Tensor:
    """Global tensor with the rows of every rank of this rank's group (other groups' docs
    zero). Collective over ``group``; not differentiable."""
    if y.shape[0] != layout.num_tokens:
        raise ValueError(f"y must have this rank's {layout.num_tokens} tokens in dim 0, got {y.shape[0]}")
    out = y.new_zeros((_total(layout), *y.shape[1:]))
    if layout.arrays is None:
        return out
    if group is None or layout.num_ranks == 1:
        parts = y
    else:
        chunks = [torch.empty_like(y) for _ in range(layout.num_ranks)]
        dist.all_gather(chunks, y.contiguous(), group=group)
        parts = torch.cat(chunks)
    rows, where = group_global_index(layout, order)
    out[torch.from_numpy(where).to(y.device)] = parts[torch.from_numpy(rows).to(y.device)]
    return out
