"""``solve`` pauses the cyclic garbage collector and restores the state it found: after a
solve, after a failed solve, with the collector disabled by the caller, and across
overlapping pauses in several threads."""

from __future__ import annotations

import gc
import threading

import pytest

from planner_service.core.errors import FieldError
from planner_service.core.request import debug_request
from planner_service.solvers import registry
from planner_service.solvers.baselines import per_doc_layout
from planner_service.solvers.gc_pause import paused_gc
from planner_service.solvers.registry import Strategy, solve


@pytest.fixture(autouse=True)
def collector_restored():
    enabled = gc.isenabled()
    yield
    if enabled:
        gc.enable()
    else:
        gc.disable()


def test_solve_pauses_the_collector_and_enables_it_again(monkeypatch):
    seen = []

    def probe(doc_lengths, request):
        seen.append(gc.isenabled())
        return per_doc_layout(doc_lengths, request)

    monkeypatch.setitem(registry.STRATEGIES, "gc-probe", Strategy(
        name="gc-probe", description="per_doc, noting the collector's state",
        solver=probe, comm_mode="full"))
    gc.enable()
    solve(debug_request(strategy="gc-probe"))
    assert seen == [False]
    assert gc.isenabled()


def test_a_failed_solve_enables_the_collector_again():
    gc.enable()
    with pytest.raises(FieldError):
        solve(debug_request(strategy="no-such-strategy"))
    assert gc.isenabled()


def test_a_collector_disabled_by_the_caller_stays_disabled():
    gc.disable()
    solve(debug_request())
    with paused_gc():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_pauses_enable_the_collector_when_the_last_ends():
    gc.enable()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    inside = []

    def first():
        with paused_gc():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second():
        first_in.wait(5)
        with paused_gc():
            second_in.set()
            first_out.wait(5)
            inside.append(gc.isenabled())  # the first pause ended, this one has not

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert inside == [False]
    assert gc.isenabled()
