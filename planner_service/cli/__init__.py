"""The ``planner`` command line (typer + rich).

Each command group lives in its own module and registers on ``app``; modules that a
deployment lacks (e.g. the service) are skipped, so the core CLI always works.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    help="Context-parallel sharding planner: plan, compare, serve.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

COMMAND_MODULES = (
    "planner_service.cli.plan_cmd",  # plan, compare
    "planner_service.cli.serve_cmd",  # serve (service issue)
    "planner_service.cli.fcp_cmd",  # schedule, fit-profile (FCP issue)
)


def _load_commands() -> None:
    for module in COMMAND_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


def main() -> None:
    _load_commands()
    app()
