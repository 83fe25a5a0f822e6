"""One check per field, in the core: every bad request raises a FieldError naming its field,
and each edge reports that field as it is (HTTP 422 ``field``, gRPC INVALID_ARGUMENT
trailer ``field``, the client's ServiceError ``.field``, the CLI's flag to change)."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from timing import scaled
from typer.testing import CliRunner

from planner_service.cli import app as cli_app
from planner_service.client.backends import EmbeddedBackend, ServiceError, make_backend
from planner_service.client.local import solve_schedule_dict as solve_local
from planner_service.core.errors import FieldError
from planner_service.core.model import ModelSpec
from planner_service.core.request import PlanRequest
from planner_service.service.http_app import create_app
from planner_service.service.settings import load_settings
from planner_service.service.testing import grpc_in_thread
from planner_service.solvers.registry import solve

BODY = {"doc_lengths": [4099, 37, 1023, 8191, 1, 511], "cp_size": 4}
SETTINGS = {"workers": 0}

CHECKED_BY_THE_REQUEST = [
    ({"cp_size": 0}, "cp_size"),
    ({"cp_size": 2000}, "cp_size"),
    ({"doc_lengths": []}, "doc_lengths"),
    ({"doc_lengths": [5, 0]}, "doc_lengths.1"),
    ({"context_length": 0}, "context_length"),
    ({"context_length": 4000}, "doc_lengths"),
    ({"imbalance_target": 0.5}, "imbalance_target"),
    ({"comm_mode": "pigeon"}, "comm_mode"),
    ({"kernel": "tpu"}, "kernel"),
    ({"link": "carrier-pigeon"}, "link"),
    ({"model": {"num_heads": 3}}, "model.num_kv_heads"),
    ({"model": {"dtype_bytes": 3}}, "model.dtype_bytes"),
    ({"model": {"head_dim": 0}}, "model.head_dim"),
    ({"strategy": "nope"}, "strategy"),
    ({"options": {"bogus": 1}}, "options"),
]
"""(changes to BODY, the field): found by PlanRequest, ModelSpec or the registry."""

CHECKED_BY_THE_STRATEGY = [
    ({"strategy": "ilp", "options": {"objective": "speed"}}, "options.objective"),
    ({"strategy": "ilp", "options": {"granularity": 10**6}}, "options.granularity"),
    ({"strategy": "fcp", "options": {"intra": "fcp"}}, "options.intra"),
    ({"strategy": "fcp", "options": {"intra": "nope"}}, "options.intra"),
    ({"strategy": "fcp", "options": {"memory_tokens": 16}}, "options.memory_tokens"),
    ({"strategy": "fcp", "options": {"search": "exhaustive"}}, "options.search"),
    ({"strategy": "fcp", "options": {"profile": "nope"}}, "options.profile"),
    # A ring too large for the step-time model to price (step_time.runs.MAX_RING_PAIRS).
    ({"strategy": "zigzag", "doc_lengths": [131072], "cp_size": 1024}, "comm_mode"),
]
"""Found by the strategy's own option checks, when it solves."""

BAD = CHECKED_BY_THE_REQUEST + CHECKED_BY_THE_STRATEGY


def core_request(changes: dict[str, Any]) -> PlanRequest:
    data = {**BODY, **changes}
    if "model" in data:
        data["model"] = ModelSpec(**data["model"])
    return PlanRequest(**{**data, "doc_lengths": tuple(data["doc_lengths"])})


@pytest.mark.parametrize(("changes", "field"), BAD)
def test_the_core_raises_a_field_error_naming_the_field(changes, field):
    with pytest.raises(FieldError) as info:
        solve(core_request(changes))
    assert info.value.field == field
    assert str(info.value).startswith(field.split(".")[0]), str(info.value)
    assert "\n" not in str(info.value)


def test_a_field_error_survives_pickling_to_and_from_a_solver_process():
    error = pickle.loads(pickle.dumps(FieldError("options.granularity", "options.granularity "
                                                 "must be an integer >= 1, got 0")))
    assert isinstance(error, FieldError) and error.field == "options.granularity"
    assert str(error) == "options.granularity must be an integer >= 1, got 0"


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    with TestClient(create_app(load_settings(**SETTINGS))) as client:
        yield client


@pytest.mark.parametrize(("changes", "field"), BAD)
def test_http_answers_422_with_the_field(http, changes, field):
    r = http.post("/v1/plan", json={**BODY, **changes})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field, r.json()
    if (changes, field) in CHECKED_BY_THE_STRATEGY or field in ("kernel", "strategy", "options"):
        assert r.json()["detail"].startswith(field.split(".")[0])  # the core's own message


@pytest.fixture(scope="module")
def grpc_url() -> Iterator[str]:
    """A grpc.aio server on loopback in a thread of this process."""
    with grpc_in_thread(load_settings(**SETTINGS), timeout_s=scaled(30)) as (url, _):
        yield url


@pytest.mark.parametrize(("changes", "field"), BAD)
def test_grpc_answers_invalid_argument_with_the_field(grpc_url, changes, field):
    backend = make_backend(grpc_url, token="")
    try:
        with pytest.raises(ServiceError) as info:
            backend.plan({**BODY, **changes}, scaled(30))
    finally:
        backend.close()
    assert info.value.code == "INVALID_ARGUMENT" and info.value.field == field, info.value


@pytest.mark.parametrize(("changes", "field"), BAD)
def test_the_clients_local_planner_reports_the_field(changes, field):
    with pytest.raises(ServiceError) as info:
        EmbeddedBackend().plan({**BODY, **changes}, 30.0)
    assert info.value.invalid_input and info.value.field == field, info.value


def test_a_comparison_is_checked_in_one_place_for_the_service_and_the_client(http):
    for strategies, options, field in ((["flashcp", "nope"], {}, "strategies"),
                                       (["flashcp", "flashcp"], {}, "strategies"),
                                       ([], {}, "strategies"),
                                       (["flashcp", "ring"], {"bogus": 1}, "options")):
        r = http.post("/v1/compare", json={**BODY, "strategies": strategies, "options": options})
        assert r.status_code == 422 and r.json()["field"] == field, r.text
        with pytest.raises(ServiceError) as info:
            EmbeddedBackend().compare({**BODY, "options": options}, strategies, 30.0)
        assert info.value.field == field and info.value.message == r.json()["detail"]


@pytest.mark.parametrize(("args", "flag"), [
    (["plan", "--docs", "5,6", "--cp", "2000"], "--cp"),
    (["plan", "--docs", "50,60", "--cp", "2", "--context", "70"], "--docs or --dataset"),
    (["plan", "--docs", "5,6", "--cp", "2", "--kernel", "tpu"], "--kernel"),
    (["plan", "--docs", "5,6", "--cp", "2", "--imbalance-target", "0.5"],
     "--imbalance-target"),
    (["schedule", "--sequences", "9000;2000", "-N", "4", "--memory-tokens", "0"],
     "--memory-tokens"),
    (["schedule", "--sequences", "9000;2000", "-N", "4", "--search", "all"], "--search"),
])
def test_the_cli_names_the_flag_that_sets_the_field(args, flag):
    result = CliRunner().invoke(cli_app, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().endswith(f"; change {flag}"), result.stderr


SCHEDULE = {"sequences": [[3000, 500], [4096]], "num_ranks": 4, "memory_tokens": 2048}


@pytest.mark.parametrize(("changes", "field"), [
    ({"search": "all"}, "search"),
    ({"method": "guess"}, "method"),
    ({"strategy": "fcp"}, "strategy"),
    ({"full_attention": [True, "no"]}, "full_attention.1"),
    ({"micro_batches": 3}, "micro_batches"),
    ({"memory_tokens": 64}, "memory_tokens"),
    ({"model": {"num_heads": 3}}, "model.num_kv_heads"),
    ({"surprise": 1}, "surprise"),
])
def test_a_schedule_request_names_the_field_in_the_service_and_the_local_scheduler(
        http, changes, field):
    body = {**SCHEDULE, **changes}
    r = http.post("/v1/schedule", json=body)
    assert r.status_code == 422 and r.json()["field"] == field, r.text
    with pytest.raises(ServiceError) as info:
        solve_local(body)
    assert info.value.field == field and info.value.message == r.json()["detail"]
