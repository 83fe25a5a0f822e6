"""The solver pool's waiting tasks, by lane: fast first, slow round-robin over clients.

A task here is anything with ``lane``, ``client``, ``queued`` (loop time of its
submission) and ``future`` (done once it no longer needs to run). Every operation is
O(1) but ``waiting`` and ``oldest_queued`` (O(waiting tasks), for metrics and readiness).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Protocol

FAST, SLOW = "fast", "slow"
"""The lanes (service/cost_gate.py names them too)."""


class Queued(Protocol):
    lane: str
    client: str
    queued: float
    future: Any


class Lanes:
    """Waiting tasks: one FIFO for the fast lane, one FIFO per client for the slow lane."""

    def __init__(self) -> None:
        self._fast: deque[Queued] = deque()
        self._slow: OrderedDict[str, deque[Queued]] = OrderedDict()
        """client -> its waiting slow-lane tasks; ``take`` rotates over the clients."""

    def add(self, task: Queued) -> None:
        if task.lane == FAST:
            self._fast.append(task)
        else:
            self._slow.setdefault(task.client, deque()).append(task)

    def take(self, reserved: bool) -> Any:
        """The next live task a worker may take, or None: the fast lane first; then (for
        an unreserved worker) the slow lane, one task of each waiting client in turn."""
        while self._fast:
            task = self._fast.popleft()
            if not task.future.done():
                return task
        while self._slow and not reserved:
            client, queue = next(iter(self._slow.items()))
            task = queue.popleft()
            if queue:
                self._slow.move_to_end(client)
            else:
                del self._slow[client]
            if not task.future.done():
                return task
        return None

    def tasks(self, lane: str | None = None) -> list[Any]:
        """The waiting tasks of ``lane`` (None: both), expired ones included."""
        fast = list(self._fast) if lane in (None, FAST) else []
        slow = [t for q in self._slow.values() for t in q] if lane in (None, SLOW) else []
        return fast + slow

    def waiting(self, lane: str) -> int:
        """Live waiting tasks of ``lane``."""
        return sum(not t.future.done() for t in self.tasks(lane))

    def oldest_queued(self, lane: str) -> float | None:
        """Submission time of the oldest live waiting task of ``lane`` (None if none)."""
        queued = [t.queued for t in self.tasks(lane) if not t.future.done()]
        return min(queued) if queued else None

    def clear(self) -> None:
        self._fast.clear()
        self._slow.clear()
