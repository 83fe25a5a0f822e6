"""Test-only hooks, off unless the setting ``PLANNER_TEST_HOOKS=1`` is in the server's
environment (read once, with the other settings, at start).

With the setting on, the executor calls :func:`install` once in the server process and
once in each solver process as it starts: it registers the strategy ``test_hang``, which
sleeps for ``options.seconds`` (default an hour) and then plans like ``ring``. It is a
solver that is guaranteed slow, so the tests of deadlines, cancellation, readiness and
shutdown do not depend on any real solver staying slow on some input. They run the
server as a child process (``planner serve``), so the hook lives in the product, behind
the setting. Never set it in production.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from planner_service.core.build import Layout
from planner_service.core.errors import FieldError
from planner_service.core.request import PlanRequest

HANG = "test_hang"


def hang_layout(doc_lengths: Sequence[int], request: PlanRequest) -> Layout:
    """Sleep ``options.seconds`` (a solver that ignores every deadline), then plan as ring."""
    from planner_service.solvers.baselines import ring_layout

    seconds = request.options.get("seconds", 3600.0)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise FieldError("options.seconds", f"options.seconds must be a number >= 0, got {seconds!r}")
    end = time.monotonic() + float(seconds)
    while time.monotonic() < end:
        time.sleep(min(0.05, max(0.0, end - time.monotonic())))
    return ring_layout(doc_lengths, request)


def install() -> None:
    """Register the test strategies in this process (idempotent); the caller checks the
    setting (Settings.test_hooks)."""
    from planner_service.solvers.registry import STRATEGIES, Strategy, add_test_strategy

    if HANG not in STRATEGIES:
        add_test_strategy(Strategy(name=HANG, description="test hook: sleeps options.seconds, then ring",
                          solver=hang_layout, comm_mode="p2p_ring",
                          options={"seconds": "how long to sleep (default 3600)"}))
