"""Python's cyclic garbage collector paused while a solve runs (``registry.solve``).

A large solve allocates hundreds of thousands of shard tuples and the lists that hold
them; each allocation counts toward the collector's thresholds, so collections of the
young generations, and now and then of every tracked object in the process, run inside
the solve and scan what it has built so far, for nothing: the solve's garbage is freed
by reference counting.

Why pausing is safe: reference counting still frees every object that is not part of a
reference cycle the moment it is dropped; only cyclic garbage waits for the collector,
and a solve makes little (none from the fast strategies, a few thousand objects from the
ILP's model). The pause lasts one solve (bounded by its deadline in the service) and the
collector runs as usual afterwards, so cycles made meanwhile, by the solve or by other
threads, are collected then. Pauses may overlap (solves in several threads): the
collector is disabled when the first starts and re-enabled when the last ends, and only
if it was enabled before the first, so a caller that disabled it keeps it disabled.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class _Pauses:
    """Pauses in progress across threads, and whether the collector was on before."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.was_enabled = False


_PAUSES = _Pauses()


@contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic collector while the body runs (module docstring); restore the
    state found before the first of overlapping pauses when the last ends, also on an
    exception."""
    with _PAUSES.lock:
        if _PAUSES.count == 0:
            _PAUSES.was_enabled = gc.isenabled()
            gc.disable()
        _PAUSES.count += 1
    try:
        yield
    finally:
        with _PAUSES.lock:
            _PAUSES.count -= 1
            if _PAUSES.count == 0 and _PAUSES.was_enabled:
                gc.enable()
