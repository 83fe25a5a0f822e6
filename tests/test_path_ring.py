"""The ring (the PyTorch kernel on ``p2p_ring`` plans) with overlap on and off, on spawned
gloo worlds of 3, 5 and 8 ranks: float64 results equal the dense reference, bytes equal the
plan's full-exchange figure per step (twice that backward), and the KV tokens a rank holds
equal the plan's ``kv_tokens_peak``. The ring's planned calls cover every document-mask
pair of the rank exactly once.
"""

from __future__ import annotations

import pytest
from runtime_cases import check_overlap_world, overlap_plans, rank_path_state

from worker_runtime import build_layout
from worker_runtime.paths import PATHS
from worker_runtime.paths.ring_steps import slot_rows

CASES = [("p2p_ring", True), ("p2p_ring", False)]
"""(comm mode, overlap): the ring with overlap on and off."""


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 5, 8])
def test_ring_is_exact_with_ring_bytes_and_kv_peak(world_size: int) -> None:
    check_overlap_world(world_size, CASES)


def test_planned_calls_cover_every_pair_once() -> None:
    """Per rank: the local call's pairs plus those of every step with queries (the block of
    slot ``i - s``) are the rank's document mask, each pair once; 3 shifts per step."""
    for world_size in (3, 5):
        for plan in overlap_plans(world_size):
            for group in plan.groups:
                for slot, rank in enumerate(group.ranks):
                    state = rank_path_state(plan, rank, "ring", "p2p_ring")
                    lay = build_layout(plan, rank)
                    r, n, i = lay.num_real, lay.num_ranks, lay.slot
                    doc, pos = lay.doc_ids[:r], lay.positions[:r]
                    calls = PATHS["ring"].planned_calls(state)
                    assert calls[0][2:] == ("local", 0, r, 0, r)
                    got = [(int(d), int(p), int(kp)) for d, p in zip(doc, pos, strict=True)
                           for kd, kp in zip(doc, pos, strict=True) if kd == d and kp <= p]
                    used = [(s, st) for s, st in enumerate(state.steps, start=1) if len(st.rows)]
                    assert len(calls) == 1 + len(used)
                    for c, (s, st) in zip(calls[1:], used, strict=True):
                        assert (c.buffer, c.q_hi - c.q_lo, c.k_hi) == ("block", len(st.rows), lay.num_tokens)
                        key_doc, key_pos = slot_rows(lay, (i - s) % n)
                        got += [(int(doc[q]), int(pos[q]), int(kp)) for q in st.rows.tolist()
                                for kd, kp in zip(key_doc, key_pos, strict=True)
                                if kd == doc[q] and kp <= pos[q]]
                    held = sorted((d, p) for d, a, e in group.shards[slot] for p in range(a, e))
                    assert sorted(got) == [(d, p, k) for d, p in held for k in range(p + 1)], (
                        f"{plan.strategy} rank {rank}")
                    transfers = PATHS["ring"].planned_transfers(state)
                    assert [tuple(t) for t in transfers] == [("shift", lay.num_tokens, 3 * (n - 1))]
