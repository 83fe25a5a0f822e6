"""The ``planner`` command line (typer + rich): one table of commands.

Commands: ``plan`` and ``compare`` (:mod:`.plan_cmd`), ``serve`` (:mod:`.serve_cmd`),
``schedule`` and ``fit-profile`` (:mod:`.fcp_cmd`), ``fit-step-profile``
(:mod:`.step_fit_cmd`). Errors a user can cause print one line and exit 2 (:mod:`.common`);
``planner --debug ...`` shows their traceback.
"""

from __future__ import annotations

from typing import Annotated

import typer

from planner_service.cli import fcp_cmd, plan_cmd, serve_cmd, step_fit_cmd
from planner_service.cli.common import DEBUG_KEY, OneLineErrors

app = typer.Typer(
    cls=OneLineErrors,
    help="Context-parallel sharding planner: plan, compare, serve.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


@app.callback()
def root(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option(
        "--debug", help="Show the traceback of an error instead of its one line")] = False,
) -> None:
    """Context-parallel sharding planner: plan, compare, serve."""
    ctx.meta[DEBUG_KEY] = debug


app.command()(plan_cmd.plan)
app.command(name="compare")(plan_cmd.compare_cmd)
app.command()(serve_cmd.serve)
app.command()(fcp_cmd.schedule)
app.command(name="fit-profile")(fcp_cmd.fit_profile_cmd)
app.command(name="fit-step-profile")(step_fit_cmd.fit_step_profile_cmd)


def main() -> None:
    """The ``planner`` console script."""
    app()
