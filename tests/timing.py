"""One factor for every wall-clock allowance the tests give the code under test.

``PLANNER_TEST_TIME_SCALE`` (default 1, any positive number) multiplies the waits a test
grants: server start-up, client timeouts, polling deadlines, the slack around a product
bound. A slow or busy machine raises this one number instead of editing tests. A bound that
is the product's own contract (a configured deadline or shutdown grace) stays as configured;
only the test's headroom around it scales.
"""

from __future__ import annotations

import os


def _scale() -> float:
    raw = os.environ.get("PLANNER_TEST_TIME_SCALE", "1")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"PLANNER_TEST_TIME_SCALE must be a positive number, got {raw!r}")
    return value


SCALE = _scale()
"""The factor, read once per test process."""


def scaled(seconds: float) -> float:
    """``seconds`` of allowance, scaled by ``PLANNER_TEST_TIME_SCALE``."""
    return seconds * SCALE
