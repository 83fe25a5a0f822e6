"""bench/window_quality.py prices plans with core/window_work.py: under a causal mask its
figures are the plan's own; the per-sequence comparison counts only the sequences where the
baseline meets R. bench/window_repair.py times the repair only where it runs."""

from bench.window_quality import MASKS, Priced, paired_exchange, price
from bench.window_repair import repair_share
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


def test_the_paired_exchange_counts_only_sequences_where_the_baseline_meets_r():
    def priced(imbalance, comm):
        return Priced(imbalance, imbalance, comm, 1.0)

    flashcp = [priced(1.01, 10), priced(1.02, 30), priced(1.0, 50), priced(1.03, 5)]
    halo = [priced(1.04, 20), priced(1.05, 25), priced(2.0, 1), priced(1.049, 5)]
    # Sequence 3's halo misses R; of the other three, flashcp exchanges at most as much on 2.
    assert paired_exchange(flashcp, halo, "halo") == "flashcp's exchange <= halo's on 2 / 3"


def test_the_repair_benchmark_times_a_repair_only_where_the_causal_plan_misses_r():
    mask = parse_layers_text(MASKS["gemma3-like"])
    assert repair_share([300, 20, 20], 1, None, mask) == 0.0
    assert repair_share([9000, 400, 300, 200, 100], 8, None, mask) >= 0.0
