"""Spawn a gloo world on loopback for tests, benchmarks and the profiler.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh processes, runs
``fn(rank, world_size, *args)`` in each with torch.distributed initialised (gloo, or NCCL
with one CUDA device per rank; TCP on 127.0.0.1, a free port), and returns the per-rank
results in rank order. A child's
exception comes back as ``DistributedFailure`` with its traceback; a world that does not
finish within ``timeout_s`` is terminated (only the processes started here) and raises
TimeoutError, so a hang never blocks a test run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

FAILURE_GRACE_S = 10.0
"""How long the other ranks get to report once one rank has failed."""


class DistributedFailure(RuntimeError):
    """One or more ranks raised; ``errors`` maps rank -> traceback text."""

    def __init__(self, errors: dict[int, str]) -> None:
        self.errors = errors
        # Show a root cause: ranks that only lost a peer report "closed by peer".
        causes = [r for r in sorted(errors) if "closed by peer" not in errors[r]] or sorted(errors)
        first = causes[0]
        super().__init__(f"ranks {sorted(errors)} failed; rank {first}:\n{errors[first]}")


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
           results: Any, pg_timeout_s: float, threads: int, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


PRELOAD = ("torch", "torch.distributed", "worker_runtime")
"""Imported once by the forkserver (Linux), so that each rank does not pay for importing
torch again: a test suite starts dozens of ranks."""


def _context() -> Any:
    """Forkserver on Linux (ranks fork from a process that has imported PRELOAD, never from
    the caller, which may hold threads); spawn elsewhere. A forkserver already started in
    this process by another user keeps its own preload list; ranks then import torch
    themselves, as under spawn."""
    if not sys.platform.startswith("linux"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    threads: int = 1,
    backend: str = "gloo",
) -> list[Any]:
    """Results of ``fn(rank, world_size, *args)`` on every rank (see module docstring).

    ``backend="nccl"`` puts rank r on CUDA device r (the caller checks there are enough).

    ``fn`` and ``args`` must be picklable (a module-level function). Raises
    DistributedFailure if any rank raised, TimeoutError if the world did not finish.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, fn, args, results, pg_timeout_s, threads, backend))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0 and errors:
                break  # the survivors are stuck waiting for a failed rank
            if left <= 0:
                raise TimeoutError(
                    f"distributed run of {getattr(fn, '__name__', fn)} did not finish in {timeout_s} s; "
                    f"ranks done: {sorted(out) + sorted(errors)}"
                )
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                missing = [i for i in dead if i not in out and i not in errors]
                for i in missing:
                    errors[i] = f"process exited with code {procs[i].exitcode} before reporting"
                continue
            (out if ok else errors)[rank] = value
            if errors:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
    if errors:
        raise DistributedFailure(errors)
    return [out[r] for r in range(world_size)]
