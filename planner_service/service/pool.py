"""Solver processes fed straight from the event loop over pipes.

Why not ``concurrent.futures.ProcessPoolExecutor``: it moves every task through a
management thread and a queue feeder thread, and at hundreds of ~1 ms solves per second
the event loop spends its time handing the GIL to those threads. Here the loop writes a
task to an idle worker's pipe and an ``add_reader`` callback reads the answer: no helper
threads in the server process at all.

Workers come from a forkserver (spawn off Linux), never a fork of the threaded server.
A worker that dies fails its task with :class:`WorkerDied` and is replaced.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger("planner_service.service")


class WorkerDied(RuntimeError):
    """The solver process running a task exited (crash, OOM kill)."""


def pool_context() -> Any:
    """The multiprocessing context of the solver processes (forkserver or spawn)."""
    # Never fork a process that runs threads (grpc, uvicorn): forkserver where it exists.
    method = "forkserver" if sys.platform.startswith("linux") else "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["planner_service.solvers.registry"])
    return ctx


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Exit this worker when the server process is gone (e.g. SIGKILLed): its pipes may be
    held open by siblings, so EOF alone does not always come."""
    import threading
    import time

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            try:
                os.kill(parent_pid, 0)
            except (ProcessLookupError, PermissionError):
                os._exit(0)

    threading.Thread(target=watch, name="planner-parent-watch", daemon=True).start()


def worker_main(conn: Connection, parent_pid: int) -> None:
    """Loop: receive (task id, fn, args), answer (task id, ok, result or exception)."""
    watch_parent(parent_pid)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        task_id, fn, args = message
        try:
            answer = (task_id, True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            answer = (task_id, False, exc)
        try:
            conn.send(answer)
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable exception
            conn.send((task_id, False, RuntimeError(f"{type(exc).__name__}: {exc}")))


class _Worker:
    def __init__(self, process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.task: tuple[int, asyncio.Future[Any]] | None = None


class WorkerPool:
    """``workers`` solver processes; ``submit`` returns a loop future. One event loop only.

    Tasks wait in an unbounded deque here: the caller (Executor) bounds admission.
    """

    def __init__(self, workers: int) -> None:
        assert workers >= 1
        self.size = workers
        self._ctx = pool_context()
        self._workers: list[_Worker] = []
        self._idle: deque[_Worker] = deque()
        self._waiting: deque[tuple[int, asyncio.Future[Any], Callable[..., Any], tuple]] = \
            deque()
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for _ in range(self.size):
            self._spawn()

    def _spawn(self) -> None:
        assert self._loop is not None
        ours, theirs = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=worker_main, args=(theirs, os.getpid()),
                                    name="planner-solver", daemon=True)
        process.start()
        theirs.close()
        worker = _Worker(process, ours)
        self._workers.append(worker)
        self._loop.add_reader(ours.fileno(), self._on_readable, worker)
        self._idle.append(worker)
        self._dispatch()

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Run ``fn(*args)`` in a worker (both must pickle); raises RuntimeError if closed."""
        if self._closing or self._loop is None:
            raise RuntimeError("the solver pool is not running")
        future: asyncio.Future[Any] = self._loop.create_future()
        self._waiting.append((next(self._ids), future, fn, args))
        self._dispatch()
        return future

    def _dispatch(self) -> None:
        while self._idle and self._waiting:
            task_id, future, fn, args = self._waiting.popleft()
            if future.cancelled():
                continue
            worker = self._idle.popleft()
            worker.task = (task_id, future)
            try:
                worker.conn.send((task_id, fn, args))
            except Exception as exc:  # noqa: BLE001 - pickling error or a dead worker
                worker.task = None
                if not future.done():
                    future.set_exception(exc if not isinstance(exc, OSError)
                                         else WorkerDied(f"solver process unreachable: {exc}"))
                if worker.process.is_alive():
                    self._idle.append(worker)

    def _on_readable(self, worker: _Worker) -> None:
        try:
            task_id, ok, value = worker.conn.recv()
        except (EOFError, OSError):
            self._on_death(worker)
            return
        task = worker.task
        worker.task = None
        self._idle.append(worker)
        if task is not None and task[0] == task_id and not task[1].done():
            if ok:
                task[1].set_result(value)
            else:
                task[1].set_exception(value)
        self._dispatch()

    def _on_death(self, worker: _Worker) -> None:
        assert self._loop is not None
        self._loop.remove_reader(worker.conn.fileno())
        worker.conn.close()
        self._workers.remove(worker)
        if worker in self._idle:
            self._idle.remove(worker)
        code = worker.process.exitcode
        if worker.task is not None and not worker.task[1].done():
            worker.task[1].set_exception(WorkerDied(
                f"the solver process exited (code {code}) while planning this request"))
        if not self._closing:
            log.error("solver process %s exited (code %s); starting another",
                      worker.process.pid, code)
            self._spawn()

    async def close(self, grace_s: float = 30.0) -> None:
        """Let running and waiting tasks finish (up to ``grace_s``), then stop the workers;
        tasks still running then fail with WorkerDied."""
        assert self._loop is not None
        deadline = self._loop.time() + grace_s
        while (self._waiting or any(w.task is not None for w in self._workers)) \
                and self._loop.time() < deadline:
            await asyncio.sleep(0.01)
        self._closing = True
        for _, future, _, _ in self._waiting:
            if not future.done():
                future.set_exception(WorkerDied("the service stopped before this solve ran"))
        self._waiting.clear()
        assert self._loop is not None
        for worker in list(self._workers):
            self._loop.remove_reader(worker.conn.fileno())
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in self._workers:
            await self._loop.run_in_executor(None, worker.process.join, 0.5 if
                                             worker.task is not None else 5)
            if worker.process.is_alive():
                worker.process.kill()
            if worker.task is not None and not worker.task[1].done():
                worker.task[1].set_exception(WorkerDied("the service stopped during this solve"))
            worker.conn.close()
        self._workers.clear()
        self._idle.clear()
