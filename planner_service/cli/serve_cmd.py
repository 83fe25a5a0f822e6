"""``planner serve``: the HTTP + gRPC service (settings from PLANNER_* variables)."""

from __future__ import annotations

from typing import Annotated

import typer

from planner_service.cli import app


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address [PLANNER_HOST, 127.0.0.1]")] = None,
    http_port: Annotated[int | None, typer.Option(
        "--http-port", "--port", help="HTTP port, 0 for any [PLANNER_HTTP_PORT, 8000]")] = None,
    grpc_port: Annotated[int | None, typer.Option(
        help="gRPC port, 0 for any [PLANNER_GRPC_PORT, 50051]")] = None,
    workers: Annotated[int | None, typer.Option(
        help="Solver processes, 0 for one thread [PLANNER_WORKERS, cores - 1]")] = None,
    no_grpc: Annotated[bool, typer.Option("--no-grpc", help="HTTP only")] = False,
) -> None:
    """Run the planner service: HTTP (web page at /, OpenAPI at /docs) and gRPC.

    Every other setting comes from PLANNER_* environment variables (the README (planner service, settings)).
    """
    from pydantic import ValidationError

    from planner_service.service.server import run
    from planner_service.service.settings import load_settings

    overrides = {k: v for k, v in {"host": host, "http_port": http_port, "grpc_port": grpc_port,
                                   "workers": workers}.items() if v is not None}
    if no_grpc:
        overrides["grpc_enabled"] = False
    try:
        settings = load_settings(**overrides)
    except ValidationError as exc:
        raise typer.BadParameter(str(exc)) from None
    raise typer.Exit(run(settings))
