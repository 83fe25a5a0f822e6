"""Bad input to the library raises ValueError naming the field."""

import pytest

from planner_service import ModelSpec, PlanRequest, solve
from planner_service.core.request import debug_request


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"doc_lengths": []}, "doc_lengths"),
        ({"doc_lengths": [5, 0]}, r"doc_lengths\[1\]"),
        ({"doc_lengths": [5, -3]}, r"doc_lengths\[1\]"),
        ({"doc_lengths": [5, 2.5]}, r"doc_lengths\[1\]"),
        ({"doc_lengths": [5, 3.0]}, r"doc_lengths\[1\]"),
        ({"doc_lengths": [True]}, r"doc_lengths\[0\]"),
        ({"doc_lengths": "123"}, "doc_lengths"),
        ({"doc_lengths": [2**31]}, r"doc_lengths\[0\]"),
        ({"cp_size": 0}, "cp_size"),
        ({"cp_size": -1}, "cp_size"),
        ({"cp_size": 1025}, "cp_size"),
        ({"cp_size": 2.0}, "cp_size"),
        ({"context_length": 0}, "context_length"),
        ({"imbalance_target": 0.9}, "imbalance_target"),
        ({"imbalance_target": float("nan")}, "imbalance_target"),
        ({"comm_mode": "carrier-pigeon"}, "comm_mode"),
        ({"kernel": "tpu"}, "kernel profile"),
        ({"link": "smoke"}, "link profile"),
    ],
)
def test_rejects_bad_field(changes, field):
    with pytest.raises(ValueError, match=field):
        debug_request(**changes)


def test_rejects_sum_above_context():
    with pytest.raises(ValueError, match="context_length 100"):
        PlanRequest(doc_lengths=[60, 60], cp_size=2, context_length=100)


def test_rejects_doc_longer_than_context():
    with pytest.raises(ValueError, match="doc of length 200, longer than context_length 100"):
        PlanRequest(doc_lengths=[200], cp_size=2, context_length=100)


def test_allows_truncation_when_asked_and_records_it():
    plan = solve(
        PlanRequest(doc_lengths=[60, 60, 30], cp_size=2, context_length=100, truncate=True)
    )
    assert plan.doc_lengths == (60, 40)
    assert plan.info["truncated_tokens"] == 50


def test_rejects_unknown_strategy_listing_valid_names():
    with pytest.raises(ValueError, match="strategy 'nope' is unknown; valid: .*flashcp"):
        solve(debug_request(strategy="nope"))


def test_rejects_unknown_option():
    with pytest.raises(ValueError, match="not options of strategy 'llama3'"):
        solve(debug_request(strategy="llama3", options={"x": 1}))


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"num_kv_heads": 5}, "num_kv_heads"),
        ({"head_dim": 0}, "head_dim"),
        ({"dtype_bytes": 3}, "dtype_bytes"),
    ],
)
def test_rejects_bad_model(changes, field):
    with pytest.raises(ValueError, match=field):
        ModelSpec(**changes)
