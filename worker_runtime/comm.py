"""The KV exchange: forward gather of the KV other ranks hold, backward return of dK/dV.

Three modes (layout.GATHER_MODES), all described by one ``CommMap``:

- ``full`` and ``compact_allgather``: one ``all_gather`` of an equal-size buffer (the whole
  local KV, or the compact buffer padded to the group's largest).
- ``alltoallv``: one ``all_to_all_single`` with per-peer split sizes.

Backward is an ``all_to_all_single`` in every mode: the gradient of each received block
goes back to its owner, who adds it into its local dK/dV (``index_add``). That moves
exactly as many bytes as the forward pass, which is what the plan's figures assume.

Every collective counts this rank's bytes (forward: received; backward: sent back); rows are ``[2, G, D]`` (K and
V stacked), so bytes = tokens x 2 x kv_heads x head_dim x element size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from worker_runtime.layout import CommMap


@dataclass(slots=True)
class CommCounter:
    """KV traffic of this rank (mutable running totals).

    Forward counts the K/V rows this rank receives; backward the dK/dV rows it sends
    back for them, so both equal the plan's per-rank figure for the mode.
    """

    forward_bytes: int = 0
    backward_bytes: int = 0
    forward_tokens: int = 0
    backward_tokens: int = 0
    forward_calls: int = 0
    backward_calls: int = 0
    backward_recv_bytes: int = 0
    """dK/dV bytes this rank gets back from its peers (what it sent them in forward)."""
    history: list[tuple[str, int]] = field(default_factory=list)
    """(direction, bytes) of every KV collective (every ring step), in order."""
    kv_tokens_peak: int = 0
    """Most KV tokens held at once for one attention call (own real tokens plus remote
    rows kept or in flight); equals the plan's ``rank_stats.kv_tokens_peak``."""
    exposed_forward_s: float = 0.0
    exposed_backward_s: float = 0.0
    """Seconds the attention waited for an exchange to land (the non-overlapped part). On
    CUDA the wait is a stream dependency, timed by events: call ``settle()`` after a
    device synchronisation to add those times."""
    cuda_waits: list[tuple[str, Any, Any]] = field(default_factory=list)
    """(direction, event before, event after) of CUDA waits not yet settled."""

    def add(self, direction: str, tokens: int, nbytes: int) -> None:
        if direction == "forward":
            self.forward_tokens += tokens
            self.forward_bytes += nbytes
            self.forward_calls += 1
        else:
            self.backward_tokens += tokens
            self.backward_bytes += nbytes
            self.backward_calls += 1
        self.history.append((direction, nbytes))

    def hold(self, tokens: int) -> None:
        """Note that ``tokens`` KV rows are held at once (keeps the maximum)."""
        self.kv_tokens_peak = max(self.kv_tokens_peak, tokens)

    def waited(self, direction: str, seconds: float) -> None:
        if direction == "forward":
            self.exposed_forward_s += seconds
        else:
            self.exposed_backward_s += seconds

    def settle(self) -> None:
        """Add the CUDA waits' event times to the exposed seconds (call after a sync)."""
        for direction, before, after in self.cuda_waits:
            self.waited(direction, before.elapsed_time(after) / 1e3)
        self.cuda_waits.clear()

    def reset(self) -> None:
        for name in ("forward_bytes", "backward_bytes", "forward_tokens", "backward_tokens",
                     "forward_calls", "backward_calls", "backward_recv_bytes", "kv_tokens_peak"):
            setattr(self, name, 0)
        self.exposed_forward_s = self.exposed_backward_s = 0.0
        self.history.clear()
        self.cuda_waits.clear()


class Pending:
    """Async collectives in flight; ``wait()`` blocks until they land, books the blocked
    time on the counter and returns ``finish()``'s value."""

    def __init__(self, works: list[Any], finish: Any, counter: CommCounter, direction: str,
                 cuda: bool = False) -> None:
        self.works, self.finish, self.counter, self.direction = works, finish, counter, direction
        self.cuda = cuda

    def wait(self) -> Any:
        if self.cuda:
            before = torch.cuda.Event(enable_timing=True)
            after = torch.cuda.Event(enable_timing=True)
            before.record()
            for work in self.works:
                work.wait()
            after.record()
            self.counter.cuda_waits.append((self.direction, before, after))
            return self.finish()
        start = time.perf_counter()
        for work in self.works:
            work.wait()
        self.counter.waited(self.direction, time.perf_counter() - start)
        return self.finish()


@dataclass(frozen=True, slots=True, eq=False)
class Exchanger:
    """A comm map bound to a process group and a device (index tensors built once)."""

    comm: CommMap
    group: Any
    """The group's torch.distributed process group (None when nothing moves)."""
    position: int
    """This rank's rank inside ``group`` (the order of all-gather blocks)."""
    counter: CommCounter
    send_index: torch.Tensor

    @classmethod
    def create(cls, comm: CommMap, group: Any, position: int, counter: CommCounter,
               device: torch.device) -> Exchanger:
        def tensor(x: Any) -> torch.Tensor:
            return torch.from_numpy(x).to(device=device, dtype=torch.int64)

        return cls(comm, group, position, counter, tensor(comm.send_index))

    def forward(self, kv_local: torch.Tensor) -> torch.Tensor:
        """Receive buffer ``[recv_rows, *row]`` of the KV this rank needs from its peers."""
        c = self.comm
        row = kv_local.shape[1:]
        if c.collective == "none":
            return kv_local.new_zeros((0, *row))
        send = kv_local.index_select(0, self.send_index)
        if c.collective == "all_gather":
            buf = kv_local.new_zeros((c.buffer_rows, *row))
            buf[: len(send)] = send
            recv = _all_gather_except_self(buf, self.group, self.position)
        else:
            recv = kv_local.new_empty((c.recv_rows, *row))
            dist.all_to_all_single(recv, send.contiguous(), list(c.recv_splits),
                                   list(c.send_splits), group=self.group)
        self.counter.add("forward", c.recv_rows, recv.numel() * recv.element_size())
        return recv

    def start_forward(self, k: torch.Tensor, v: torch.Tensor) -> Pending:
        """Start receiving the K and V rows this rank needs (async, K and V apart so each
        lands contiguous); ``wait()`` gives ``(k_buf, v_buf)``. The all-gather modes
        deliver the whole group's buffers, this rank's own block included
        (``gathered_row`` maps receive-buffer rows into them); all-to-all-v the receive
        buffer itself. Copies: the send buffer (the collective needs one contiguous buffer;
        ``full`` sends the local K and V as they are) and the receive buffer."""
        c = self.comm
        row = k.shape[1:]
        if c.collective == "none":
            empty = (k.new_zeros((0, *row)), v.new_zeros((0, *row)))
            return Pending([], lambda: empty, self.counter, "forward")
        works, bufs = [], []
        for x in (k, v):
            if c.collective == "all_gather":
                if c.mode == "full":
                    send = x.contiguous()
                else:
                    send = x.new_zeros((c.buffer_rows, *row))
                    torch.index_select(x, 0, self.send_index, out=send[: len(self.send_index)])
                whole = x.new_empty((len(c.recv_splits) * c.buffer_rows, *row))
                if dist.get_backend(self.group) == "gloo":
                    parts = list(whole.split(c.buffer_rows))
                    works.append(dist.all_gather(parts, send, group=self.group, async_op=True))
                else:
                    works.append(dist.all_gather_into_tensor(whole, send, group=self.group,
                                                             async_op=True))
                bufs.append(whole)
            else:
                recv = x.new_empty((c.recv_rows, *row))
                works.append(dist.all_to_all_single(
                    recv, x.index_select(0, self.send_index), list(c.recv_splits),
                    list(c.send_splits), group=self.group, async_op=True))
                bufs.append(recv)
        self.counter.add("forward", c.recv_rows, 2 * c.recv_rows * row.numel() * k.element_size())
        return Pending(works, lambda: tuple(bufs), self.counter, "forward", k.is_cuda)

    def gathered_row(self, recv_row: Any) -> Any:
        """Receive-buffer rows (peers only, as ``CommMap``) -> rows of ``start_forward``'s
        buffers (the all-gather modes keep this rank's own block in place)."""
        c = self.comm
        if c.collective != "all_gather":
            return recv_row
        return recv_row + c.buffer_rows * (recv_row // c.buffer_rows >= self.position)

    def start_backward(self, dk_recv: torch.Tensor, dv_recv: torch.Tensor) -> Pending:
        """Send the receive buffer's dK/dV back to their owners (async); ``wait()`` gives
        ``(dk, dv)`` for the rows of ``send_index``, summed over peers."""
        c = self.comm
        if c.collective == "none":
            return Pending([], lambda: None, self.counter, "backward")
        back_splits = c.send_splits if c.collective == "all_to_all" else c.recv_splits
        works, outs = [], []
        for d in (dk_recv, dv_recv):
            out = d.new_empty((sum(back_splits), *d.shape[1:]))
            works.append(dist.all_to_all_single(out, d.contiguous(), list(back_splits),
                                                list(c.recv_splits), group=self.group,
                                                async_op=True))
            outs.append(out)
        nbytes = dk_recv.numel() * dk_recv.element_size()
        self.counter.add("backward", len(dk_recv), 2 * nbytes)
        self.counter.backward_recv_bytes += 2 * outs[0].numel() * outs[0].element_size()
        return Pending(works, lambda: tuple(returned_gradients(c, o) for o in outs),
                       self.counter, "backward", dk_recv.is_cuda)

    def backward(self, d_recv: torch.Tensor, d_local: torch.Tensor) -> None:
        """Send ``d_recv``'s rows back to their owners; add what comes back into ``d_local``."""
        c = self.comm
        if c.collective == "none":
            return
        row = d_local.shape[1:]
        # What each peer returns mirrors what this rank sent it in the forward pass.
        back_splits = c.send_splits if c.collective == "all_to_all" else c.recv_splits
        out = d_local.new_empty((sum(back_splits), *row))
        dist.all_to_all_single(out, d_recv.contiguous(), list(back_splits), list(c.recv_splits),
                               group=self.group)
        # Counted: the dK/dV this rank sends back, the mirror of the KV it received.
        self.counter.add("backward", len(d_recv), d_recv.numel() * d_recv.element_size())
        self.counter.backward_recv_bytes += out.numel() * out.element_size()
        d_local.index_add_(0, self.send_index, returned_gradients(c, out))


def returned_gradients(comm: CommMap, out: torch.Tensor) -> torch.Tensor:
    """Per row of ``send_index``, the sum of the gradients the peers returned for it.

    all_to_all: peers return exactly the rows they got, in send order. all_gather: every
    peer returns a whole ``buffer_rows`` block; its first ``len(send_index)`` rows are
    this rank's buffer (the rest padding), so the blocks are summed.
    """
    if comm.collective == "all_to_all":
        return out
    blocks = out.view(-1, comm.buffer_rows, *out.shape[1:])
    return blocks[:, : len(comm.send_index)].sum(dim=0)


def _all_gather_except_self(buf: torch.Tensor, group: Any, position: int) -> torch.Tensor:
    """Peers' buffers concatenated in group-rank order, this rank's own left out."""
    n = dist.get_world_size(group)
    if dist.get_backend(group) == "gloo":
        parts = [torch.empty_like(buf) for _ in range(n)]
        dist.all_gather(parts, buf.contiguous(), group=group)
        return torch.cat(parts[:position] + parts[position + 1 :])
    whole = buf.new_empty((n * len(buf), *buf.shape[1:]))
    dist.all_gather_into_tensor(whole, buf.contiguous(), group=group)
    rows = len(buf)
    return torch.cat((whole[: position * rows], whole[(position + 1) * rows :]))


class KVExchange(torch.autograd.Function):
    """``source = cat(kv_local, received)``; backward returns dK/dV partials to owners."""

    @staticmethod
    def forward(ctx: Any, kv_local: torch.Tensor, exchanger: Exchanger) -> torch.Tensor:  # type: ignore[override]
        ctx.exchanger = exchanger
        ctx.num_local = len(kv_local)
        return torch.cat((kv_local, exchanger.forward(kv_local)))

    @staticmethod
    def backward(ctx: Any, d_source: torch.Tensor):  # type: ignore[override]
        t = ctx.num_local
        d_local = d_source[:t].clone()
        ctx.exchanger.backward(d_source[t:], d_local)
        return d_local, None
