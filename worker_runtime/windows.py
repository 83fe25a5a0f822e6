"""Sliding-window layers on every path: ``ContextParallelAttention.attention(..., window=W)``.

A layer of window W lets the query at document position p attend keys
``[max(0, p - W + 1), p]`` (transformers' ``sliding_window_overlay``: ``kv_idx > q_idx -
sliding_window``; flash-attn's ``window_size = (W - 1, 0)``). One plan serves every layer
(token placement is shared); what differs per window is kept here, built on the first call
of each window and cached by W on the runtime's per-device state:

- the exchange (``window_map.py``): ``alltoallv`` moves only the halo, the keys
  ``[max(0, s - W + 1), s)`` before each own shard ``[s, e)`` held by a peer
  (``planner_service.core.halo_map``'s transfers); ``compact_allgather`` each shard's
  suffix that a later run of its doc on another rank reaches; ``full`` the causal comm
  map (every local buffer moves whatever the window);
- the lean path (torch kernel, gather modes): its two parts on windowed masks, the remote
  part's queries being those with a remote key in their window;
- the ring (torch kernel, ``p2p_ring``): windowed masks per step; the ring stops after
  the group's last useful step (``window_map.ring_steps``: no later transfer or kernel),
  a rank runs no kernel on a step whose block holds no key inside its windows, and
  backward sends the last dK/dV accumulator straight to its owner;
- the segments path and segment ring on a kernel with positional masks (the reference
  kernel): natively (``paths/window_pieces.py``), the segments path on this exchange
  with its gaps cut to their halos, the segment ring stopping after the last useful step;
- the gathered form (a segment kernel's or flash-attn's one causal windowed varlen call):
  the gathered path, and the segments path and segment ring on flash kernels (their full
  calls on remote gaps have per-document alignments one flash call cannot window; the
  gathered call can). On the halo maps and a ``p2p_ring`` plan's ring blocks (the
  senders of the ring's steps 1 .. ``steps_run`` in one all-to-all, the ring's bytes) each
  shard reads its window span ``[max(0, s - W + 1), e)`` (``window_map.window_gather``);
  on ``full`` its keys ``[0, e)`` from the causal map.

Which path runs a windowed call is ``worker_runtime.paths.windowed_path``: the table's
``RuntimePath.windowed`` (the lean path and the ring themselves, the others the gathered
form), the segments path and segment ring themselves on a kernel with positional masks. ``window=None`` never reaches the window code: the causal paths run unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from worker_runtime.comm import Exchanger
from worker_runtime.window_map import build_ring_window_map, build_window_comm_map

if TYPE_CHECKING:
    from worker_runtime.paths.base import PathContext

HALO_MODES = ("alltoallv", "compact_allgather")
"""The gather modes whose windowed exchange is a halo map (``full`` keeps the causal map)."""


def window_exchanger(ctx: PathContext) -> Exchanger:
    """The exchange of ``ctx``'s window layer: the halo map of ``alltoallv`` or
    ``compact_allgather`` (``window_map.py``), a ``p2p_ring`` plan's ring blocks of steps
    1 .. ``steps_run`` (``window_map.build_ring_window_map``), the causal one for ``full``;
    built once per window on the device (shared by the lean path and the gathered form)."""
    if ctx.gather_mode not in HALO_MODES and not ctx.ring:
        assert ctx.exchanger is not None
        return ctx.exchanger

    window = ctx.window
    assert window is not None, "a window layer's exchange"

    def build() -> Exchanger:
        if ctx.ring:
            comm = build_ring_window_map(ctx.layout, window, ctx.order)
        else:
            comm = build_window_comm_map(ctx.layout, ctx.gather_mode, window, ctx.order)
        position = dist.get_rank(ctx.group) if ctx.group is not None else 0
        return Exchanger.create(comm, ctx.group, position, ctx.counter, ctx.device)

    key = ("ring exchange" if ctx.ring else "exchange", window)
    return ctx.cached(key, build)  # type: ignore[no-any-return]
