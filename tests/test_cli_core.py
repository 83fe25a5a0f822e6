"""The core CLI: plan and compare, as tables, JSON and a plot."""

import json

import pytest
from timing import scaled
from typer.testing import CliRunner

from planner_service import Plan, validate_plan
from planner_service.cli import app

runner = CliRunner()
DOCS = "4099,37,1023,8191,1,511,2047,3001,17,6143,733,97,5000"


def test_plan_prints_ranks_and_metrics():
    result = runner.invoke(app, ["plan", "--docs", DOCS, "--cp", "4"])
    assert result.exit_code == 0, result.output
    assert "flashcp plan, N = 4" in result.output
    assert "imbalance" in result.output and "all-to-all-v" in result.output


def test_plan_json_is_a_valid_plan():
    result = runner.invoke(
        app, ["plan", "--docs", DOCS, "--cp", "3", "--strategy", "per_doc", "--json"]
    )
    assert result.exit_code == 0, result.output
    plan = Plan.from_dict(json.loads(result.output))
    validate_plan(plan)
    assert plan.strategy == "per_doc" and plan.cp_size == 3


def test_compare_lists_every_core_strategy_and_plots(tmp_path):
    png = tmp_path / "cmp.png"
    result = runner.invoke(app, ["compare", "--docs", DOCS, "--cp", "4", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    for name in ("llama3", "per_doc", "ring", "zigzag", "flashcp"):
        assert name in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_marks_a_compact_allgather_that_saves_nothing():
    """One document on 4 ranks: every rank's padded compact send is a whole rank's tokens,
    so the table's compact all-gather saving is 0 and the note says it is not a choice."""
    result = runner.invoke(app, ["compare", "--docs", "8192", "--cp", "4",
                                 "--strategies", "flashcp,llama3"])
    assert result.exit_code == 0, result.output
    text = result.output.replace("\n", " ")
    assert "compact all-gather saves nothing for flashcp, llama3 here" in text
    assert "not a choice over full" in text


def test_compare_samples_batches_of_a_family_as_json():
    result = runner.invoke(
        app,
        [
            "compare",
            "--dataset",
            "family:web",
            "--context",
            "16384",
            "--batches",
            "3",
            "--cp",
            "4",
            "--strategies",
            "llama3,flashcp",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [r["strategy"] for r in rows] == ["llama3", "flashcp"]
    assert all(r["num_sequences"] == 3 for r in rows)


@pytest.mark.parametrize(
    "args,message",
    [
        (["plan", "--docs", "5,-1", "--cp", "2"], "doc_lengths[1]"),
        (["plan", "--docs", "5,x", "--cp", "2"], "--docs must be comma-separated integers"),
        (["plan", "--docs", "5", "--cp", "0"], "cp_size"),
        (["plan", "--docs", "5", "--strategy", "nope"], "strategy 'nope' is unknown"),
        (["plan", "--cp", "2"], "exactly one of --docs or --dataset"),
        (["compare", "--dataset", "wlbllm", "--cp", "2"], "--dataset needs --context"),
    ],
)
def test_rejects_bad_input_with_exit_2(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output.replace("\n", "")


def test_url_asks_a_running_service_and_gets_the_local_plan():
    from planner_service.service.testing import ServerProcess

    # workers=0: the server solves in a thread; the CLI's client path is what this checks.
    with ServerProcess(workers=0, grpc=False, startup_timeout_s=scaled(90)) as server:
        result = runner.invoke(
            app, ["plan", "--docs", DOCS, "--cp", "4", "--json", "--url", server.http_url]
        )
        assert result.exit_code == 0, result.output
        local = runner.invoke(app, ["plan", "--docs", DOCS, "--cp", "4", "--json"])
        assert result.output == local.output
        result = runner.invoke(
            app,
            [
                "compare",
                "--docs",
                DOCS,
                "--cp",
                "4",
                "--strategies",
                "llama3,flashcp",
                "--url",
                server.http_url,
            ],
        )
        assert result.exit_code == 0, result.output
        assert "llama3" in result.output and "flashcp" in result.output
        bad = runner.invoke(
            app,
            ["plan", "--docs", "5,1", "--cp", "2", "--strategy", "nope", "--url", server.http_url],
        )
        assert bad.exit_code == 2
