"""Solver processes fed straight from the event loop over pipes, each task under a deadline.

Why not ``concurrent.futures.ProcessPoolExecutor``: it moves every task through a
management thread and a queue feeder thread, and at hundreds of ~1 ms solves per second
the event loop spends its time handing the GIL to those threads. Here the loop writes a
task to an idle worker's pipe and an ``add_reader`` callback reads the answer: no helper
threads in the server process at all.

Every task has a deadline (loop time). A task still waiting when its deadline passes is
dropped; a task still running then, or one whose future is cancelled (every caller went
away), has its worker process killed and replaced unless it finishes within KILL_AFTER_S:
a solver cannot be interrupted safely from outside, but a process can, so no request holds
a worker more than a quarter second past its deadline.

Two lanes (service/cost_gate.py): ``reserved`` workers take only fast-lane tasks, the
others take fast-lane tasks first and then slow-lane tasks round-robin over the clients
that submitted them, so a cheap plan never waits behind a slow solve and one client's
slow requests cannot keep another's waiting.

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
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from planner_service.core.errors import FieldError
from planner_service.service.lanes import SLOW, Lanes

log = logging.getLogger("planner_service.service")

KILL_AFTER_S = 0.25
"""A solve whose caller is answered (deadline) or gone gets this long to finish on its own
before its process is killed: a solve that was nearly done costs no process restart, so
requests with tiny deadlines cannot make the pool fork for each of them."""
KILL_CHECK_S = 0.05
"""How often a killed worker is checked for having exited (its pipe EOF may lag)."""
PRELOAD = ("planner_service.service.executor", "planner_service.solvers.ilp",
           "planner_service.solvers.fcp_strategy", "planner_service.solvers.auto")
"""Imported once by the forkserver, so a solver process that replaces a killed one starts
warm (milliseconds, not the seconds of importing pydantic and OR-Tools afresh)."""
STUCK_AFTER_S = 1.0
"""A worker still busy this long after its task's deadline counts as stuck (readiness)."""
Observer = Callable[[str, float, str], None]
"""Called once per task that started: (label, seconds it ran, outcome), the outcome one of
ok, refused (a FieldError), error, timeout, abandoned, died."""


class WorkerDied(RuntimeError):
    """The solver process running a task exited (crash, OOM kill)."""


class TaskExpired(RuntimeError):
    """A task's deadline passed before it finished; its worker was killed and replaced."""


def pool_context() -> Any:
    """The multiprocessing context of the solver processes (forkserver or spawn)."""
    # Never fork a process that runs threads (grpc, uvicorn): forkserver where it exists.
    method = "forkserver" if sys.platform.startswith("linux") else "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))
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


SLOW_NICE = 10
"""Niceness of the unreserved solver processes (they run the slow lane): the OS gives
the reserved fast-lane process and the event loop the CPU first when cores are short."""


def worker_main(conn: Connection, parent_pid: int, nice: int = 0,
                setup: Callable[[], None] | None = None) -> None:
    """Loop: receive (task id, fn, args), answer (task id, ok, result or exception);
    ``setup()`` runs once before the first task."""
    watch_parent(parent_pid)
    if setup is not None:
        setup()
    if nice:
        try:
            os.nice(nice)
        except OSError:  # not permitted here: same priority as the server
            pass
    # Requests never name server files: profiles come by value or by operator-given name.
    from planner_service.fcp.cost_model import forbid_profile_files

    forbid_profile_files()
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


@dataclass(eq=False)
class _Task:
    id: int
    future: asyncio.Future[Any]
    fn: Callable[..., Any]
    args: tuple
    deadline: float
    """Loop time after which the task is dropped (waiting) or its worker killed (running)."""
    lane: str = SLOW
    client: str = ""
    label: str = ""
    queued: float = 0.0
    """Loop time of its submission."""
    started: float | None = None
    """Loop time it was sent to a worker."""
    observed: bool = False
    timer: asyncio.TimerHandle | None = None
    worker: _Worker | None = None


@dataclass(eq=False)
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: Connection
    reserved: bool = False
    """Takes fast-lane tasks only."""
    task: _Task | None = None
    killed: bool = False
    gone: bool = field(default=False)


class WorkerPool:
    """``workers`` solver processes; ``submit`` returns a loop future. One event loop only.

    Tasks wait in a deque here: the caller (Executor) bounds admission. Cancel a task's
    future to abandon it (its worker is killed if it already runs).
    """

    def __init__(self, workers: int, reserved: int = 0,
                 observer: Observer | None = None,
                 setup: Callable[[], None] | None = None) -> None:
        """``setup``: a picklable function each solver process runs once as it starts
        (the test hooks; None: nothing)."""
        assert workers >= 1 and reserved >= 0
        self.size = workers + reserved
        self.reserved = reserved
        self.observer = observer
        self.setup = setup
        self._ctx = pool_context()
        self._workers: list[_Worker] = []
        self._idle: deque[_Worker] = deque()
        self._queue = Lanes()
        """Tasks not yet sent to a worker."""
        self._tasks: dict[asyncio.Future[Any], _Task] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self.kills = 0
        """Workers killed because their task expired or was abandoned."""

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for i in range(self.size):
            self._spawn(reserved=i < self.reserved)

    def _spawn(self, reserved: bool = False) -> None:
        assert self._loop is not None
        ours, theirs = self._ctx.Pipe(duplex=True)
        nice = 0 if reserved or not self.reserved else SLOW_NICE
        process = self._ctx.Process(target=worker_main,
                                    args=(theirs, os.getpid(), nice, self.setup),
                                    name="planner-solver", daemon=True)
        process.start()
        theirs.close()
        worker = _Worker(process, ours, reserved=reserved)
        self._workers.append(worker)
        self._loop.add_reader(ours.fileno(), self._on_readable, worker)
        self._idle.append(worker)
        self._dispatch()

    # ---- tasks ------------------------------------------------------------------------

    def submit(self, fn: Callable[..., Any], *args: Any, timeout_s: float,
               lane: str = SLOW, client: str = "", label: str = "") -> asyncio.Future[Any]:
        """Run ``fn(*args)`` in a worker (both must pickle) for at most ``timeout_s`` from
        now, queueing included; the future then fails with TaskExpired. ``lane``: fast or
        slow; ``client`` orders the slow lane (round-robin); ``label`` is passed to the
        observer. Raises RuntimeError if the pool is closed."""
        if self._closing or self._loop is None:
            raise RuntimeError("the solver pool is not running")
        future: asyncio.Future[Any] = self._loop.create_future()
        now = self._loop.time()
        task = _Task(next(self._ids), future, fn, args, now + timeout_s, lane=lane,
                     client=client, label=label, queued=now)
        task.timer = self._loop.call_at(task.deadline, self._expire, task)
        self._tasks[future] = task
        future.add_done_callback(self._on_future_done)
        self._queue.add(task)
        self._dispatch()
        return future

    def _observe(self, task: _Task, outcome: str) -> None:
        """Report a started task's run time and outcome to the observer, once."""
        if task.observed or task.started is None or self._loop is None:
            return
        task.observed = True
        if self.observer is not None:
            self.observer(task.label, self._loop.time() - task.started, outcome)

    def waiting(self, lane: str) -> int:
        """Live tasks of ``lane`` not yet sent to a worker."""
        return self._queue.waiting(lane)

    def oldest_wait_s(self, lane: str) -> float:
        """How long the oldest waiting task of ``lane`` has waited (0 if none)."""
        assert self._loop is not None
        queued = self._queue.oldest_queued(lane)
        return 0.0 if queued is None else self._loop.time() - queued

    def extend(self, future: asyncio.Future[Any], timeout_s: float) -> None:
        """Let a task run until ``timeout_s`` from now if that is later than its deadline
        (another caller with a later deadline joined it)."""
        task = self._tasks.get(future)
        assert self._loop is not None
        if task is None or future.done():
            return
        deadline = self._loop.time() + timeout_s
        if deadline > task.deadline:
            task.deadline = deadline
            if task.timer is not None:
                task.timer.cancel()
            task.timer = self._loop.call_at(deadline, self._expire, task)

    def _expire(self, task: _Task) -> None:
        if not task.future.done():
            task.future.set_exception(TaskExpired(
                "the solve did not finish within its deadline; its solver process was "
                "stopped"))
            task.future.exception()  # retrieved: the caller may be gone

    def _on_future_done(self, future: asyncio.Future[Any]) -> None:
        """Finished, expired or cancelled: forget the task; kill its worker if it runs."""
        task = self._tasks.pop(future, None)
        if task is None:
            return
        if task.timer is not None:
            task.timer.cancel()
        worker = task.worker
        if worker is not None and worker.task is task and not self._closing:
            self._observe(task, "abandoned" if future.cancelled() else "timeout")
            why = ("its solve passed its deadline" if not future.cancelled()
                   else "every caller of its solve went away")
            assert self._loop is not None
            self._loop.call_later(KILL_AFTER_S, self._kill_if_busy_with, worker, task, why)

    def _kill_if_busy_with(self, worker: _Worker, task: _Task, why: str) -> None:
        if worker.task is task and not worker.gone and not self._closing:
            self._kill(worker, why)

    def _kill(self, worker: _Worker, why: str) -> None:
        """Stop a busy worker now; it is replaced as soon as it has exited."""
        assert self._loop is not None
        if worker.killed:
            return
        worker.killed = True
        worker.task = None
        self.kills += 1
        log.warning("stopping solver process %s: %s", worker.process.pid, why)
        try:
            worker.process.kill()
        except Exception:  # noqa: BLE001 - it may be gone already
            pass
        self._loop.call_later(KILL_CHECK_S, self._reap, worker)

    def _reap(self, worker: _Worker) -> None:
        if worker.gone or self._closing:
            return
        if worker.process.is_alive():
            assert self._loop is not None
            self._loop.call_later(KILL_CHECK_S, self._reap, worker)
            return
        self._on_death(worker)

    def _dispatch(self) -> None:
        assert self._loop is not None
        # Reserved workers first, so a fast task leaves the others free for slow ones.
        for worker in sorted(self._idle, key=lambda w: not w.reserved):
            task: _Task | None = self._queue.take(worker.reserved)
            if task is None:
                continue
            self._idle.remove(worker)
            worker.task = task
            task.worker = worker
            task.started = self._loop.time()
            try:
                worker.conn.send((task.id, task.fn, task.args))
            except Exception as exc:  # noqa: BLE001 - pickling error or a dead worker
                worker.task = None
                task.worker = None
                task.started = None
                if not task.future.done():
                    task.future.set_exception(
                        exc if not isinstance(exc, OSError)
                        else WorkerDied(f"solver process unreachable: {exc}"))
                if worker.process.is_alive():
                    self._idle.append(worker)

    def _on_readable(self, worker: _Worker) -> None:
        try:
            task_id, ok, value = worker.conn.recv()
        except (EOFError, OSError):
            self._on_death(worker)
            return
        if worker.killed:
            return  # an answer that raced the kill: the process is going anyway
        task = worker.task
        worker.task = None
        self._idle.append(worker)
        if task is not None and task.id == task_id and not task.future.done():
            task.worker = None
            self._observe(task, "ok" if ok else "refused" if isinstance(value, FieldError)
                          else "error")
            if ok:
                task.future.set_result(value)
            else:
                task.future.set_exception(value)
        self._dispatch()

    def _on_death(self, worker: _Worker) -> None:
        assert self._loop is not None
        if worker.gone:
            return
        worker.gone = True
        self._loop.remove_reader(worker.conn.fileno())
        worker.conn.close()
        self._workers.remove(worker)
        if worker in self._idle:
            self._idle.remove(worker)
        code = worker.process.exitcode
        task = worker.task
        worker.task = None
        if task is not None and not task.future.done():
            self._observe(task, "died")
            task.future.set_exception(WorkerDied(
                f"the solver process exited (code {code}) while planning this request"))
        if not self._closing:
            if not worker.killed:
                log.error("solver process %s exited (code %s); starting another",
                          worker.process.pid, code)
            self._spawn(worker.reserved)

    # ---- health and shutdown ----------------------------------------------------------

    def stuck(self) -> int:
        """Workers busy past their task's deadline plus STUCK_AFTER_S, or killed and not
        yet replaced for that long (0 in a healthy pool: expired tasks are killed)."""
        assert self._loop is not None
        now = self._loop.time()
        count = 0
        for worker in self._workers:
            if worker.task is not None and now > worker.task.deadline + STUCK_AFTER_S:
                count += 1
            elif worker.killed:
                count += 1
        return count

    def healthy(self) -> bool:
        """At least one worker can take a task within its deadline."""
        return len(self._workers) - self.stuck() > 0

    @property
    def closing(self) -> bool:
        """True once close() stopped taking tasks."""
        return self._closing

    @property
    def busy(self) -> bool:
        return bool(self._queue.tasks()) or any(w.task is not None for w in self._workers)

    async def close(self, deadline: float) -> None:
        """Let running and waiting tasks finish until loop time ``deadline``, then stop the
        workers (killing those still busy); unfinished tasks fail with WorkerDied."""
        assert self._loop is not None
        while self.busy and self._loop.time() < deadline:
            await asyncio.sleep(0.01)
        self._closing = True
        for task in self._queue.tasks():
            if not task.future.done():
                task.future.set_exception(WorkerDied("the service stopped before this solve "
                                                     "ran"))
        self._queue.clear()
        for worker in list(self._workers):
            self._loop.remove_reader(worker.conn.fileno())
            if worker.task is None and not worker.killed:
                try:
                    worker.conn.send(None)
                except OSError:
                    pass
            else:
                worker.killed = True
                worker.process.kill()
        # Idle workers exit on the None message at once; give them a moment, together.
        stop_by = self._loop.time() + 0.5
        while any(w.process.is_alive() for w in self._workers) and self._loop.time() < stop_by:
            await asyncio.sleep(0.01)
        for worker in self._workers:
            if worker.process.is_alive():
                worker.process.kill()
            if worker.task is not None and not worker.task.future.done():
                worker.task.future.set_exception(WorkerDied("the service stopped during this "
                                                            "solve"))
            worker.conn.close()
        for worker in self._workers:
            worker.process.join(0.1)
        self._workers.clear()
        self._idle.clear()
