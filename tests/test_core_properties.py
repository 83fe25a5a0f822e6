"""Property tests: every strategy's plan passes the validator on adversarial inputs.

Covers N that divides nothing, one huge doc, thousands of 1-token docs and N larger
than the token count. 300 examples per strategy (each input family is drawn about 60
times), 100 for ``auto``; tests/test_flashcp_scale.py runs the named adversarial inputs
exactly.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner_service import PlanRequest, solve, validate_plan
from planner_service.core.errors import FieldError
from planner_service.solvers.registry import strategy_names

pytestmark = pytest.mark.slow  # long: starts first under xdist (tests/conftest.py)

# The ILP and FCP have their own property tests (they are slower per example).
FAST_STRATEGIES = [
    s for s in ("llama3", "per_doc", "ring", "zigzag", "flashcp", "flashcp_paper")
    if s in strategy_names()
]

small_n = st.integers(min_value=1, max_value=17)
any_n = st.integers(min_value=1, max_value=1024)

inputs = st.one_of(
    # General: a few docs of any length, any N.
    st.tuples(st.lists(st.integers(1, 50_000), min_size=1, max_size=40), any_n),
    # One huge doc among small ones.
    st.tuples(
        st.tuples(
            st.integers(100_000, 1_000_000), st.lists(st.integers(1, 2_000), max_size=20)
        ).map(lambda t: [t[0], *t[1]]),
        small_n,
    ),
    # Thousands of 1-token docs.
    st.tuples(st.integers(1_000, 3_000).map(lambda n: [1] * n), small_n),
    # N larger than the token count.
    st.tuples(st.lists(st.integers(1, 5), min_size=1, max_size=6), st.integers(30, 1024)),
    # Tiny mixed inputs.
    st.tuples(st.lists(st.integers(1, 9), min_size=1, max_size=8), st.integers(1, 7)),
)


RING_STRATEGIES = ("ring", "zigzag")
"""Their plans run as rings; a ring too large for the step-time model to price
(core/step_time/runs.MAX_RING_PAIRS) is refused on ``comm_mode``."""


def check_case(strategy, case):
    doc_lengths, cp_size = case
    try:
        plan = solve(
            PlanRequest(doc_lengths=doc_lengths, cp_size=cp_size, strategy=strategy), check=False
        )
    except FieldError as exc:
        assert strategy in RING_STRATEGIES and exc.field == "comm_mode", str(exc)
        assert "\n" not in str(exc) and "use fewer ranks or another comm_mode" in str(exc)
        return
    validate_plan(plan)
    assert plan.cp_size == cp_size
    group = plan.groups[0]
    tokens = sum(doc_lengths)
    assert sum(group.rank_stats.tokens) == tokens
    # Padding is explicit and small: at most a few tokens per doc above ceil(S / N).
    assert plan.metrics.tokens_per_rank <= -(-tokens // cp_size) + 2 * len(doc_lengths) + 2
    assert plan.metrics.imbalance >= 1.0 - 1e-12
    assert 0.0 <= plan.metrics.comm_saving_alltoallv <= 1.0


@pytest.mark.parametrize("strategy", FAST_STRATEGIES)
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(case=inputs)
def test_every_plan_passes_the_validator(strategy, case):
    check_case(strategy, case)


# auto runs three solvers per example: fewer examples, same properties.
@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(case=inputs)
def test_auto_plans_pass_the_validator(case):
    check_case("auto", case)
