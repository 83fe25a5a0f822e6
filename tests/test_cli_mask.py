"""``planner plan --window / --layers / --hf-config``: the mask reaches the plan, bad
values end with one line naming the flag (exit 2)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from planner_service.cli import app
from planner_service.core.mask import CAUSAL, parse_mask
from planner_service.core.plan import Plan
from planner_service.core.validate import validate_plan

runner = CliRunner()
DOCS = ["plan", "--docs", "4099,37,1023,8191,1,511", "--cp", "4", "--json"]


def plan_of(*flags: str) -> Plan:
    result = runner.invoke(app, [*DOCS, *flags])
    assert result.exit_code == 0, result.output
    plan = Plan.from_json(result.stdout)
    validate_plan(plan)
    return plan


def one_line_error(*flags: str) -> str:
    result = runner.invoke(app, ["plan", "--docs", "100,200", "--cp", "2", *flags])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_the_mask_flags_reach_the_plan() -> None:
    assert plan_of("--layers", "5x1024,1xfull").mask == parse_mask(layers="5x1024,1xfull")
    assert plan_of("--window", "128").mask == parse_mask(window=128)
    causal = plan_of()
    assert plan_of("--window", "full").to_json() == causal.to_json()
    assert plan_of("--layers", "3xfull").to_json() == causal.to_json()
    assert causal.mask == CAUSAL and "mask" not in json.loads(causal.to_json())


@pytest.mark.parametrize(("flags", "names"), [
    (("--window", "0"), "--window"),
    (("--window", "-3"), "--window"),
    (("--window", "abc"), "--window"),
    (("--layers", ""), "--layers"),
    (("--layers", "5x"), "--layers"),
    (("--layers", "0x1024"), "--layers"),
    (("--layers", "1x0"), "--layers"),
    (("--layers", "1.5x10"), "--layers"),
    (("--window", "5", "--layers", "1x5"), "exclusive"),
    (("--hf-config", "/nonexistent/config.json"), "--hf-config"),
])
def test_bad_mask_flags_end_with_one_line(flags: tuple[str, ...], names: str) -> None:
    assert names in one_line_error(*flags)


def test_a_local_transformers_config_gives_its_mask(tmp_path) -> None:
    pytest.importorskip("transformers")
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    (mistral / "config.json").write_text(json.dumps(
        {"model_type": "mistral", "num_hidden_layers": 4, "sliding_window": 4096}))
    assert plan_of("--hf-config", str(mistral)).mask == parse_mask(
        layers=[{"window": 4096, "count": 4}])
    assert plan_of("--hf-config", str(mistral / "config.json")).mask.windows == (4096,)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    assert "--hf-config" in one_line_error("--hf-config", str(bad))


def test_compare_takes_the_mask_flags_of_plan() -> None:
    """``planner compare`` reads the same flags; each strategy's summary is that of its
    plans under the mask (layer-weighted imbalance)."""
    from planner_service.core.request import PlanRequest
    from planner_service.strategy_summary import summarize_strategies

    docs = ["compare", "--docs", "4099,37,1023,8191,1,511", "--cp", "4", "--json",
            "--strategies", "flashcp,contiguous_halo"]
    result = runner.invoke(app, [*docs, "--layers", "5x1024,1xfull"])
    assert result.exit_code == 0, result.output
    got = {s["strategy"]: s["imbalance_mean"] for s in json.loads(result.stdout)}
    base = PlanRequest(doc_lengths=(4099, 37, 1023, 8191, 1, 511), cp_size=4,
                       mask=parse_mask(layers="5x1024,1xfull"))
    want = {s.strategy: s.imbalance_mean
            for s in summarize_strategies(["flashcp", "contiguous_halo"],
                                          [base.doc_lengths], base)}
    assert got == want
    causal = json.loads(runner.invoke(app, docs).stdout)
    assert got != {s["strategy"]: s["imbalance_mean"] for s in causal}
    bad = runner.invoke(app, [*docs, "--window", "0"])
    assert bad.exit_code == 2 and "--window" in bad.stderr
    assert len(bad.stderr.splitlines()) == 1
    table = runner.invoke(app, [*docs[:-3], "--window", "128"])
    assert table.exit_code == 0 and "mask 1x128" in table.stdout
