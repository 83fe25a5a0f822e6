"""The one log-sum-exp merge every path uses to combine attention parts.

Two parts of one query's attention, ``(o1, l1)`` and ``(o2, l2)`` (outputs normalised over
their own keys, natural-log log-sum-exps), merge exactly into
``lse = logaddexp(l1, l2)``, ``out = e^(l1 - lse) o1 + e^(l2 - lse) o2``. The lean path and
the ring merge a part into a subset of rows (``merge_rows_``), the segments path and the
segment ring merge a call into a contiguous slice of rows (``merge_``, on views).
"""

from __future__ import annotations

import math

import torch


def merge_(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lo: torch.Tensor,
           empty: torch.Tensor | None = None) -> None:
    """Merge a part (``o`` shaped as ``out``, ``lo`` as ``lse``: ``out [n, ..., D]``,
    ``lse [n, ...]``) into ``out``, ``lse`` in place (views allowed). ``empty``: rows of the
    part that saw no key (their undefined results are dropped). O(n H D)."""
    lo, o = lo.to(lse.dtype), o.to(out.dtype)
    if empty is not None:
        lo, o = lo.index_fill(0, empty, -math.inf), o.index_fill(0, empty, 0.0)
    new = torch.logaddexp(lse, lo)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(o * torch.exp(lo - new).unsqueeze(-1))
    lse.copy_(new)


def merge_rows_(out: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, o: torch.Tensor,
                lo: torch.Tensor) -> None:
    """Merge a part of ``rows`` (``o``, ``lo``: one entry per row) into ``out``, ``lse`` in place."""
    part_out, part_lse = out.index_select(0, rows), lse.index_select(0, rows)
    merge_(part_out, part_lse, o, lo)
    out.index_copy_(0, rows, part_out)
    lse.index_copy_(0, rows, part_lse)
