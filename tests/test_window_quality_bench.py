"""bench/window_quality.py prices plans with core/window_work.py: under a causal mask its
figures are the plan's own."""

from bench.window_quality import MASKS, price
from planner_service.core.mask import CAUSAL, parse_layers_text
from planner_service.core.request import debug_request
from planner_service.solvers.registry import solve


def test_a_causal_mask_prices_a_plan_as_its_metrics():
    for strategy in ("flashcp", "per_doc", "contiguous_halo"):
        plan = solve(debug_request(strategy=strategy, comm_mode="alltoallv"))
        priced = price(plan, CAUSAL)
        assert priced.weighted_imbalance == plan.metrics.imbalance == priced.causal_imbalance
        assert priced.comm_per_layer == plan.metrics.alltoallv_tokens


def test_windowed_masks_never_exchange_more_than_causal():
    plan = solve(debug_request(strategy="flashcp"))
    for text in MASKS.values():
        assert price(plan, parse_layers_text(text)).comm_per_layer <= \
            price(plan, CAUSAL).comm_per_layer
