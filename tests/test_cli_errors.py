"""Errors a user can cause end ``planner`` with one line naming what to change, exit 2.

Each case checks the exit code, that stderr is exactly one line starting ``error:``, what
that line names, and that no traceback is printed; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import json
import socket

import pytest
from typer.testing import CliRunner

from planner_service.cli import app
from planner_service.cli.plan_cmd import SKIPPED_BY_DEFAULT
from planner_service.solvers.registry import strategy_names

runner = CliRunner()


def one_line_error(args: list[str], env: dict[str, str] | None = None) -> str:
    """Run ``planner args``; assert the one-line error contract and return the line."""
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture
def no_server(monkeypatch):
    """``planner serve`` must fail before it starts anything."""
    def run(settings):
        raise AssertionError(f"the service started with {settings}")

    monkeypatch.setattr("planner_service.service.server.run", run)


@pytest.fixture
def taken_port():
    """A port another process (here: a socket) listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_missing_lengths_file_names_the_flag_and_the_file(tmp_path):
    path = tmp_path / "missing.json"
    line = one_line_error(["plan", "--dataset", f"file:{path}", "--context", "8192"])
    assert f"--dataset file:{path}" in line and "does not exist" in line


@pytest.mark.parametrize(("content", "says"), [
    ("[1, 2,", "not readable JSON"),
    ('{"a": 1}', "non-empty JSON list"),
    ('[5, "x"]', "entry 1 is 'x'"),
])
def test_a_malformed_lengths_file_says_what_is_wrong(tmp_path, content, says):
    path = tmp_path / "lengths.json"
    path.write_text(content)
    line = one_line_error(["plan", "--dataset", f"file:{path}", "--context", "8192"])
    assert says in line and str(path) in line


def test_an_unknown_data_set_lists_the_valid_ones():
    line = one_line_error(["compare", "--dataset", "nope", "--context", "8192"])
    assert "'nope'" in line and "family:NAME" in line and "file:PATH" in line


def test_a_missing_data_folder_names_the_variable_to_set(tmp_path):
    env = {"PLANNER_DATA_DIR": str(tmp_path / "nowhere")}
    line = one_line_error(["plan", "--dataset", "wlbllm", "--context", "8192"], env=env)
    assert "PLANNER_DATA_DIR" in line and "wlbllm_doc_lengths.json" in line


def test_schedule_errors_are_one_line_too(tmp_path):
    line = one_line_error(["schedule", "--dataset", "nope"])
    assert "--dataset nope" in line
    missing = tmp_path / "profile.json"
    line = one_line_error(["schedule", "--sequences", "9000;2000", "-N", "4",
                           "--profile", f"file:{missing}"])
    assert line.startswith("error: profile:") and str(missing) in line
    line = one_line_error(["fit-profile", str(tmp_path / "timings.json"),
                           "--out", str(tmp_path / "out.json")])
    assert "timings.json" in line


def test_debug_shows_the_traceback_instead(tmp_path):
    args = ["plan", "--dataset", f"file:{tmp_path / 'missing.json'}", "--context", "8192"]
    result = runner.invoke(app, ["--debug", *args])
    assert result.exit_code != 2
    assert isinstance(result.exception, ValueError) and "does not exist" in str(result.exception)


def test_serve_names_the_flag_of_a_taken_http_port(no_server, taken_port):
    line = one_line_error(["serve", "--http-port", str(taken_port), "--no-grpc"])
    assert f"HTTP port {taken_port}" in line and "in use" in line
    assert "--http-port" in line and "PLANNER_HTTP_PORT" in line


def test_serve_names_the_flag_of_a_taken_grpc_port(no_server, taken_port):
    line = one_line_error(["serve", "--http-port", "0", "--grpc-port", str(taken_port)])
    assert f"gRPC port {taken_port}" in line and "in use" in line
    assert "--grpc-port" in line and "PLANNER_GRPC_PORT" in line


@pytest.mark.parametrize(("args", "env", "names"), [
    (["serve", "--workers", "-1"], {}, "--workers or PLANNER_WORKERS"),
    (["serve", "--http-port", "70000"], {}, "--http-port or PLANNER_HTTP_PORT"),
    (["serve"], {"PLANNER_WORKERS": "many"}, "--workers or PLANNER_WORKERS"),
    (["serve"], {"PLANNER_MAX_TOKENS": "-5"}, "PLANNER_MAX_TOKENS"),
    (["serve"], {"PLANNER_KERNEL_PROFILE": "bogus"}, "PLANNER_KERNEL_PROFILE"),
    (["serve", "--host", "no-such-host.invalid", "--http-port", "0"], {}, "--host"),
])
def test_serve_names_the_setting_to_change(no_server, args, env, names):
    line = one_line_error(args, env=env)
    assert names in line


def test_compare_runs_every_strategy_or_says_which_it_skipped_and_why():
    result = runner.invoke(app, ["compare", "--docs", "4099,37,1023,8191,1,511", "--cp", "4",
                                 "--json"])
    assert result.exit_code == 0, result.output
    compared = {row["strategy"] for row in json.loads(result.stdout)}
    skipped = set(strategy_names()) - compared
    assert skipped == set(SKIPPED_BY_DEFAULT) & set(strategy_names())
    for name in skipped:
        assert f"skipped {name}" in result.stderr and SKIPPED_BY_DEFAULT[name] in result.stderr
