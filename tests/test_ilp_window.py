"""The ILP under an attention mask: the windowed block model against an enumeration of
every block placement on tiny instances, and the strategy's plans under masks.

The enumeration scores placements with core/window_work.py (``mask_figures_of``, itself
compared with token-by-token key sets in tests/test_core_window_work.py), independent of
the model's piece and need booleans.
"""

from __future__ import annotations

import itertools
import random

import pytest

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.errors import FieldError
from planner_service.core.mask import parse_mask
from planner_service.core.request import PlanRequest
from planner_service.solvers.balance import TARGET_MET
from planner_service.solvers.ilp import IlpOptions
from planner_service.solvers.ilp.blocks import Blocks, block_shards, cut_blocks
from planner_service.solvers.ilp.cpsat import Cp, solve_model
from planner_service.solvers.ilp.model import canonical_ranks
from planner_service.solvers.ilp.tuning import TUNING
from planner_service.solvers.ilp.window_model import build_window_model, window_values
from planner_service.solvers.ilp.windowed import solve_window_blocks, weighted_cap
from planner_service.solvers.registry import solve

MASKS = ("1x3", "2x4,1xfull", "1x1,1xfull", "3x6", "1x2,2x5,1xfull", "1x16,2x4")
"""Windows shorter than the docs (pieces), of one key, and one no doc exceeds (16:
the causal prefix need)."""
INSTANCES = (  # doc lengths, ranks, granularity: at most 8 blocks
    ((7, 5), 2, 3),
    ((12,), 2, 2),
    ((9, 3, 4), 3, 4),  # no placement within T = 6 tokens
    ((9, 3, 4), 3, 3),
    ((10, 6), 2, 2),
    ((8, 8, 2), 3, 4),
)
R = 1.3
OPTIONS = IlpOptions(granularity=0, time_limit_s=5.0, objective="comm", workers=1, head_docs=0)


def figures(blocks: Blocks, ranks, n: int, mask):
    """(tokens per rank, weighted work per rank, weighted exchange) from window_work."""
    shards = block_shards(blocks, ranks, n)
    f = ww.mask_figures_of(cost.shard_arrays(shards), mask, comm_mode="alltoallv",
                           tokens_per_rank=0)
    return [sum(s.end - s.start for s in rank) for rank in shards], f.workload, f.comm_tokens


def brute(blocks: Blocks, docs, n: int, mask):
    """(least weighted exchange within T and the weighted cap, least (max work, exchange))."""
    cap_tokens = -(-sum(docs) // n)
    cap = weighted_cap(docs, n, R, mask)
    best_comm = best_balance = None
    for ranks in itertools.product(range(n), repeat=len(blocks.blocks)):
        tokens, work, comm = figures(blocks, ranks, n, mask)
        if max(tokens) > cap_tokens:
            continue
        if max(work) <= cap and (best_comm is None or comm < best_comm):
            best_comm = comm
        if best_balance is None or (max(work), comm) < best_balance:
            best_balance = (max(work), comm)
    return best_comm, best_balance


def round_robin(blocks: Blocks, n: int):
    return block_shards(blocks, [b % n for b in range(len(blocks.blocks))], n)


@pytest.mark.parametrize("case", range(len(INSTANCES)))
def test_windowed_model_matches_enumeration(case):
    docs, n, g = INSTANCES[case]
    blocks = cut_blocks(docs, g, head_docs=set())
    assert n ** len(blocks.blocks) <= 6561
    for text in MASKS[case % 2::2]:
        mask = parse_mask(layers=text)
        comm_opt, balance_opt = brute(blocks, docs, n, mask)
        hints = [round_robin(blocks, n)]
        opts = OPTIONS._replace(granularity=g)
        if comm_opt is not None:
            got = solve_window_blocks(docs, n, R, mask, opts, hints, blocks=blocks)
            assert got.status == "OPTIMAL", (docs, text)
            assert got.objective_value == got.best_bound == comm_opt, (docs, text)
            assert figures(blocks, _ranks(blocks, got.shards), n, mask)[2] == comm_opt
        got = solve_window_blocks(docs, n, R, mask, opts._replace(objective="balance"), hints,
                                  blocks=blocks)
        if balance_opt is None:  # no placement within T tokens: the hint, as the fallback
            assert got.status == "FALLBACK"
            continue
        assert got.status == "OPTIMAL", (docs, text)
        assert got.objective_value == balance_opt[0], (docs, text)
        _, work, comm = figures(blocks, _ranks(blocks, got.shards), n, mask)
        assert (max(work), comm) == balance_opt, (docs, text)


def _ranks(blocks: Blocks, shards):
    owner = {(s.doc, s.start): r for r, rank in enumerate(shards) for s in rank}
    return [owner[(b.doc, b.start)] for b in blocks.blocks]


def test_fixed_placement_prices_exactly():
    """With every block fixed, the model's least exchange is the placement's own."""
    rng = random.Random(5)
    cp = Cp.start(1, 5.0, TUNING)
    for _ in range(40):
        docs = [rng.randint(1, 14) for _ in range(rng.randint(1, 3))]
        n = rng.randint(2, 4)
        blocks = cut_blocks(docs, rng.randint(1, 4), head_docs={0})
        mask = parse_mask(layers=rng.choice(MASKS))
        ranks = canonical_ranks(blocks, [rng.randrange(n) for _ in blocks.blocks], n)
        wm = build_window_model(blocks, n, mask, token_cap=sum(docs), work_cap=None)
        for b, rank in enumerate(ranks):
            wm.model.Add(wm.x[b][rank] == 1)
        wm.model.Minimize(wm.comm_total)
        solver, status, _, _ = solve_model(wm.model, 1.0, cp)
        assert status == "OPTIMAL"
        values = window_values(blocks, ranks, n, mask)
        assert int(round(solver.ObjectiveValue())) == values.comm == figures(
            blocks, ranks, n, mask)[2]
        assert [solver.Value(v) for v in wm.load] == values.loads


def _request(docs, n, text, **kw):
    options = {"time_limit_s": 1.0, "granularity": 256, "workers": 1, **kw.pop("options", {})}
    mask = parse_mask(layers=text) if text else parse_mask(window=None)
    return PlanRequest(doc_lengths=docs, cp_size=n, strategy="ilp", options=options,
                       mask=mask, **kw)


def _weighted(plan, mask):
    arrays = cost.shard_arrays(plan.groups[0].shards)
    f = ww.mask_figures_of(arrays, mask, comm_mode="alltoallv",
                           tokens_per_rank=plan.metrics.tokens_per_rank)
    return f.imbalance, f.comm_tokens


@pytest.mark.parametrize("docs,n,text", [
    ((3000, 2000, 1200, 800), 4, "5x256,1xfull"),
    ((4096, 4096), 4, "1x128"),
    ((700, 300, 2000), 2, "3x64,1xfull"),
    ((1500, 900, 600), 3, "1x32,1xfull"),
])
def test_masked_plans_valid_balanced_and_no_worse_than_causal(docs, n, text):
    """Valid (solve validates), within R on the weighted work or declared, and its weighted
    exchange at most the causal ILP plan's priced under the mask where that meets R."""
    mask = parse_mask(layers=text)
    plan = solve(_request(docs, n, text))
    assert plan.info["mask_objective"] == "layer-weighted"
    imb, comm = _weighted(plan, mask)
    assert imb <= plan.info["imbalance_target"] + 1e-12 or plan.info[TARGET_MET] is False
    assert (TARGET_MET in plan.info) == (imb > plan.info["imbalance_target"])
    assert comm == plan.info["objective_value"]
    causal = solve(_request(docs, n, None))
    c_imb, c_comm = _weighted(causal, mask)
    if c_imb <= plan.info["imbalance_target"]:
        assert comm <= c_comm


def test_masked_plan_deterministic_and_balance_objective():
    request = _request((3000, 1000, 500), 2, "2x128,1xfull")
    assert solve(request).to_json() == solve(request).to_json()
    plan = solve(_request((3000, 1000, 500), 2, "2x128,1xfull", options={"objective": "balance"}))
    assert plan.info["objective"] == "balance"


def test_field_errors_under_a_mask():
    with pytest.raises(FieldError, match="imbalance_target"):
        weighted_cap((2,), 2, 1.0, parse_mask(layers="1x8,1xfull"))
    with pytest.raises(FieldError, match="options.objective"):
        solve(_request((300, 200), 2, "1x8", options={"objective": "fast"}))
    with pytest.raises(FieldError, match="options.granularity"):
        solve(_request((300, 200), 2, "1x8", options={"granularity": 301}))
    with pytest.raises(FieldError, match="options.granularity .* window implications"):
        solve(_request((60000, 60000), 16, "1x30000", options={"granularity": 512}))


def test_kv_bound_under_a_mask_declares_weighted_balance():
    """With a KV bound the causal bounded path plans; its declaration is the weighted one."""
    mask = parse_mask(layers="3x64,1xfull")
    plan = solve(_request((700, 300, 2000), 2, "3x64,1xfull", max_kv_tokens_per_rank=4000))
    imb, _ = _weighted(plan, mask)
    assert (TARGET_MET in plan.info) == (imb > plan.info["imbalance_target"])
