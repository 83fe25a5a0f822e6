"""Suite-wide settings that keep the tests independent of the machine's speed and load.

- One intra-op thread per test process (torch, OpenMP, BLAS), unless the caller set one:
  `make test` runs two pytest workers on two cores and many tests start servers or
  distributed ranks beside them; a thread pool per process only adds spin-waiting, which
  on a busy machine makes a torch test many times slower.
- Hypothesis: no per-example deadline and no too-slow health check (both measure wall
  clock); the example counts stay in each test's own ``@settings``.
- pytest-timeout's limit (pyproject's ``timeout`` or a test's ``timeout`` mark) scales
  with ``PLANNER_TEST_TIME_SCALE`` like every other allowance (tests/timing.py).
- Under pytest-xdist, the modules that hold a test marked ``slow`` start first, so that
  the workers finish together instead of one running a long test alone at the end.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings
from timing import SCALE, scaled

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
if "torch" in sys.modules:  # imported before this file (by a plugin): the variable came late
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

settings.register_profile(
    "planner", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "planner"))


def _scale_timeout(item: pytest.Item, default: float) -> None:
    """Give ``item`` a timeout mark of its limit times PLANNER_TEST_TIME_SCALE."""
    marker = item.get_closest_marker("timeout")
    args: tuple = ()
    kwargs: dict = {}
    limit = default
    if marker is not None:
        args, kwargs = marker.args[1:], dict(marker.kwargs)
        limit = marker.args[0] if marker.args else kwargs.pop("timeout", default)
        kwargs.pop("timeout", None)
    if limit and limit > 0:
        item.add_marker(pytest.mark.timeout(scaled(float(limit)), *args, **kwargs),
                        append=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SCALE != 1 and config.pluginmanager.hasplugin("timeout"):
        cli = config.getoption("timeout", None)
        default = float(cli if cli is not None else (config.getini("timeout") or 0))
        for item in items:
            _scale_timeout(item, default)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Whole modules move, so that a module-scoped fixture (a server) is still set up
        # once per worker; the sort is stable, so the order is otherwise the collection's.
        slow = {item.path for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.path not in slow)
