"""``auto`` picks the (strategy, comm mode) with the least predicted step time."""

from __future__ import annotations

import pytest

from planner_service.core.request import PlanRequest
from planner_service.solvers.auto import CANDIDATES, MODES, candidate_modes, saves_nothing
from planner_service.solvers.registry import solve


def brute_force(**req):
    """Every candidate that is a choice solved on its own (a compact all-gather that saves
    nothing is not one): (est_step_ms, strategy, mode), the least first."""
    out = []
    for i, name in enumerate(CANDIDATES):
        for j, mode in enumerate(candidate_modes(PlanRequest(**req))):
            plan = solve(PlanRequest(**req, strategy=name, comm_mode=mode))
            if not saves_nothing(plan.metrics):
                out.append((plan.metrics.est_step_ms, i, j, name, mode))
    return sorted(out)


@pytest.mark.parametrize("req", [
    dict(doc_lengths=(8192, 4096, 2048, 2048, 1024, 512, 256, 100), cp_size=4),
    dict(doc_lengths=(32768,), cp_size=8),
    dict(doc_lengths=(3000, 2500, 1200, 900, 400, 37), cp_size=3, kernel="h100-fa3"),
    dict(doc_lengths=(16384, 1024, 1024), cp_size=2, link="infiniband"),
    dict(doc_lengths=(700, 300, 250, 100, 40), cp_size=3, kernel="cpu-torch", link="gloo-local"),
])
def test_auto_is_the_least_predicted_candidate(req):
    plan = solve(PlanRequest(**req, strategy="auto"))
    est, _, _, name, mode = brute_force(**req)[0]
    assert (plan.info["chosen"], plan.comm_mode) == (name, mode)
    assert plan.metrics.est_step_ms == pytest.approx(est)
    preds = plan.info["candidates"]
    assert len(preds) == len(CANDIDATES) * len(candidate_modes(PlanRequest(**req)))
    assert min(p["est_step_ms"] for p in preds if not p.get("saves_nothing")) == \
        pytest.approx(est)
    assert plan.info["kernel_profile"] == plan.kernel


def test_a_compact_allgather_that_saves_nothing_is_marked_not_chosen():
    """One doc over every rank: each rank but one holds early chunks others attend, so its
    buffer is all its tokens and compact all-gather moves what full moves."""
    plan = solve(PlanRequest(doc_lengths=(32768,), cp_size=8, strategy="auto"))
    marked = [p for p in plan.info["candidates"] if p.get("saves_nothing")]
    assert marked and {p["comm_mode"] for p in marked} == {"compact_allgather"}
    assert plan.comm_mode != "compact_allgather"
    asked = solve(PlanRequest(doc_lengths=(32768,), cp_size=8, strategy="auto",
                              comm_mode="compact_allgather"))
    assert asked.comm_mode == "compact_allgather"
    assert not any(p.get("saves_nothing") for p in asked.info["candidates"])


def test_hand_built_case_no_exchange_wins():
    # Four equal docs on four ranks: one whole doc per rank needs no KV exchange and
    # balances exactly, so the winner moves nothing; llama3 and ring must gather KV.
    plan = solve(PlanRequest(doc_lengths=(8192,) * 4, cp_size=4, strategy="auto"))
    assert plan.metrics.est_comm_ms == 0.0
    preds = {(p["strategy"], p["comm_mode"]): p["est_step_ms"] for p in plan.info["candidates"]}
    assert preds[("llama3", "full")] > plan.metrics.est_step_ms
    assert preds[("ring", "full")] > plan.metrics.est_step_ms


def test_auto_keeps_a_requested_comm_mode():
    plan = solve(PlanRequest(doc_lengths=(5000, 3000, 100), cp_size=2, strategy="auto",
                             comm_mode="full"))
    assert plan.comm_mode == "full"
    assert {p["comm_mode"] for p in plan.info["candidates"]} == {"full"}


def test_p2p_ring_is_a_candidate_where_the_runtime_runs_a_ring():
    # The PyTorch kernel's ring and flash-attn's segment ring (its default flash path).
    for kernel in ("h100-fa2", "h100-fa3", "cpu-torch"):
        request = PlanRequest(doc_lengths=(100, 50), cp_size=2, kernel=kernel)
        assert candidate_modes(request) == (*MODES, "p2p_ring")
