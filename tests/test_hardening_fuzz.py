"""Fuzzing: schemathesis against the service's own OpenAPI spec.

A real ``planner serve`` (one solver process, HTTP only) answers requests that
schemathesis generates from ``/openapi.json``: valid ones (positive mode) and invalid ones
(negative mode) for every operation. Every answer must not be a 5xx and must match the
schema the spec declares for its status code. The normal suite sends a short run (about
150 requests); ``PLANNER_FUZZ_LONG=1`` sends at least 1,000 (benchmarks, nightly runs).

The one 5xx that is allowed: a 504 no sooner than a deadline, the caller's own
(``X-Planner-Deadline-Ms``, e.g. 1 ms) or the server's PLANNER_REQUEST_TIMEOUT_S (a
generated request may ask for a slow solve), which is the documented behaviour.
"""

from __future__ import annotations

import os
import time

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance
from timing import scaled

from planner_service.service.testing import ServerProcess

pytestmark = pytest.mark.slow  # long: starts first under xdist (tests/conftest.py)

LONG = os.environ.get("PLANNER_FUZZ_LONG", "") == "1"
MIN_REQUESTS = 1000 if LONG else 100
EXAMPLES = ({GenerationMode.POSITIVE: 110, GenerationMode.NEGATIVE: 80} if LONG
            else {GenerationMode.POSITIVE: 12, GenerationMode.NEGATIVE: 8})
"""Per operation and mode; operations with few inputs exhaust earlier."""
SERVER_DEADLINE_S = 5.0
"""PLANNER_REQUEST_TIMEOUT_S of the fuzzed server: no solve outlives it."""
FAST_SETTINGS = settings(
    deadline=None, database=None, derandomize=False, print_blob=True,
    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server():
    # Small limits keep generated requests cheap; the checks are the same at any limit.
    env = {"PLANNER_MAX_DOCS": "4096", "PLANNER_MAX_TOKENS": "1048576",
           "PLANNER_MAX_CP_SIZE": "64", "PLANNER_MAX_WAIT_MS": "50",
           "PLANNER_MAX_TIME_LIMIT_S": "1", "PLANNER_MAX_SEQUENCES": "16",
           "PLANNER_QUEUE_SIZE": "256", "PLANNER_REQUEST_TIMEOUT_S": str(SERVER_DEADLINE_S)}
    with ServerProcess(workers=1, grpc=False, env=env) as s:
        yield s


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(f"{server.http_url}/openapi.json")


def caller_deadline_504(case, response, elapsed_s: float) -> bool:
    """A 504 at a deadline: the caller's own (it set one and got the answer no sooner) or
    the server's PLANNER_REQUEST_TIMEOUT_S."""
    if response.status_code != 504:
        return False
    if elapsed_s >= SERVER_DEADLINE_S * 0.9:
        return True
    headers = {k.lower(): v for k, v in (case.headers or {}).items()}
    value = str(headers.get("x-planner-deadline-ms", ""))
    return value.isdigit() and elapsed_s * 1e3 >= int(value) * 0.9


def fuzz_operation(operation, server, session, mode: GenerationMode,
                   stats: dict[str, int]) -> int:
    """Run one operation's generated requests; returns how many were sent."""
    count = 0

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(FAST_SETTINGS, max_examples=EXAMPLES[mode])
    def run(case) -> None:
        nonlocal count
        start = time.monotonic()
        response = case.call(base_url=server.http_url, session=session,
                             timeout=SERVER_DEADLINE_S + scaled(30))
        elapsed = time.monotonic() - start
        count += 1
        if caller_deadline_504(case, response, elapsed):
            stats["caller_504"] += 1
            return
        case.validate_response(response, checks=[not_a_server_error,
                                                 response_schema_conformance])

    try:
        run()
    except Unsatisfiable:
        # Negative mode on an operation without inputs (e.g. GET /healthz): no invalid
        # request exists to generate.
        assert mode is GenerationMode.NEGATIVE, operation.label
    return count


def fuzz(schema, server, session, mode: GenerationMode, stats: dict[str, int]) -> None:
    for result in schema.get_all_operations():
        operation = result.ok()
        count = fuzz_operation(operation, server, session, mode, stats)
        stats["requests"] += count
        stats[operation.label] = stats.get(operation.label, 0) + count


def test_schemathesis_finds_no_5xx_and_no_schema_violation(schema, server):
    stats = {"requests": 0, "caller_504": 0}
    with requests.Session() as session:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(schema, server, session, mode, stats)
    print("schemathesis requests:", stats)
    assert stats["requests"] >= MIN_REQUESTS, stats
    # The server is still healthy and its metrics count no 5xx other than allowed 504s.
    metrics = requests.get(f"{server.http_url}/metrics", timeout=5).text
    five_xx = [line for line in metrics.splitlines()
               if line.startswith("planner_requests_total{") and 'status="5' in line
               and not line.endswith(" 0.0")]
    assert all('status="504"' in line for line in five_xx), five_xx
    assert requests.get(f"{server.http_url}/readyz", timeout=5).status_code == 200
