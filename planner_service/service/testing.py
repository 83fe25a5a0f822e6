"""Run the planner on loopback, for tests and benchmarks.

:class:`ServerProcess`: ``planner serve`` in a child process. The server binds port 0 (or
given ports) and prints one line with the bound ports; the class waits for it, so there
is no race for free ports. :func:`grpc_in_thread`: the gRPC server of one in-process
``PlannerService``, on an event loop in a thread.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

LINE = re.compile(r"planner serving: (http://[^/ ]+)/ .*?(?:gRPC on (\S+)|gRPC disabled)")


class ServerProcess:
    """A ``planner serve`` child; use as a context manager (stops it with SIGTERM)."""

    def __init__(self, *, workers: int = 1, http_port: int = 0, grpc_port: int = 0,
                 grpc: bool = True, env: dict[str, str] | None = None,
                 startup_timeout_s: float = 90.0) -> None:
        self.workers = workers
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.grpc = grpc
        self.env = dict(env or {})
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.http_url = ""
        self.grpc_target = ""
        self.output: deque[str] = deque(maxlen=200)

    def start(self) -> ServerProcess:
        """Start and wait for the 'planner serving' line; raises RuntimeError if it dies."""
        args = [sys.executable, "-c", "from planner_service.cli import main; main()", "serve",
                "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                "--workers", str(self.workers)]
        if not self.grpc:
            args.append("--no-grpc")
        env = {**os.environ, "PLANNER_LOG_LEVEL": "warning", "PYTHONUNBUFFERED": "1",
               **self.env}
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        found = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line.rstrip())
                match = LINE.search(line)
                if match and not found.is_set():
                    self.http_url = match.group(1)
                    self.grpc_target = match.group(2) or ""
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not found.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("planner serve did not start:\n" + "\n".join(self.output))
        # Remember the bound ports so that restart() comes back on the same ones.
        self.http_port = int(self.http_url.rsplit(":", 1)[1])
        if self.grpc_target:
            self.grpc_port = int(self.grpc_target.rsplit(":", 1)[1])
        return self

    @property
    def grpc_url(self) -> str:
        return f"grpc://{self.grpc_target}"

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then wait; returns the exit code (SIGKILL after ``timeout_s``)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def kill(self) -> None:
        """SIGKILL, as a crash would (the solver workers notice and exit too)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants (server, forkserver, solvers)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except (OSError, StopIteration):
            pass
    return total


@contextmanager
def grpc_in_thread(settings: Any, *, timeout_s: float = 30.0) -> Iterator[tuple[str, Any]]:
    """``(grpc://host:port, service)`` of a ``PlannerService`` serving gRPC on loopback
    port 0 in a thread of this process; stopped on exit. ``settings``: ``Settings``."""
    import asyncio

    from planner_service.service.grpc_server import start_grpc
    from planner_service.service.ops import PlannerService

    svc = PlannerService(settings)
    loop = asyncio.new_event_loop()
    started: dict[str, Any] = {}
    ready = threading.Event()

    async def main() -> None:
        await svc.start()
        started["server"] = await start_grpc(svc, "127.0.0.1", 0)
        started["stop"] = asyncio.Event()
        ready.set()
        await started["stop"].wait()
        await started["server"].stop(0)
        await svc.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    if not ready.wait(timeout_s):
        raise TimeoutError(f"the gRPC server did not start within {timeout_s} s")
    try:
        yield f"grpc://127.0.0.1:{started['server'].port}", svc
    finally:
        loop.call_soon_threadsafe(started["stop"].set)
        thread.join(timeout_s / 3)


@contextmanager
def rss_bounded_server(env: dict[str, str], growth_mib: float, *,
                       workers: int = 1) -> Iterator[ServerProcess]:
    """A :class:`ServerProcess` whose whole process tree may grow by less than
    ``growth_mib`` of RSS while the block runs (AssertionError on exit otherwise)."""
    with ServerProcess(workers=workers, env=env) as server:
        assert server.proc is not None  # started
        pid = server.proc.pid
        before = tree_rss_mib(pid)
        yield server
        after = tree_rss_mib(pid)
        print(f"server tree RSS: {before:.0f} MiB before, {after:.0f} after")
        assert after - before < growth_mib, (before, after)
