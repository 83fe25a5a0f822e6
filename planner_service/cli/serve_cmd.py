"""``planner serve``: the HTTP + gRPC service (settings from PLANNER_* variables).

Before the service starts (and warms its solver pool), the settings are validated and
both ports are tried, so a bad setting or a taken port ends in one line naming the flag
or variable to change.
"""

from __future__ import annotations

import errno
import socket
from typing import TYPE_CHECKING, Annotated

import typer

from planner_service.cli.common import fail

if TYPE_CHECKING:
    from pydantic import ValidationError

FLAGS = {"host": "--host", "http_port": "--http-port", "grpc_port": "--grpc-port",
         "workers": "--workers", "grpc_enabled": "--no-grpc"}
"""Settings that ``planner serve`` also takes as flags."""


def setting_name(field: str) -> str:
    """How a user sets ``field``: its flag (if any) and its environment variable."""
    env = f"PLANNER_{field.upper()}"
    return f"{FLAGS[field]} or {env}" if field in FLAGS else env


def settings_error(exc: ValidationError) -> str:
    """pydantic's errors of the settings as one line naming each flag or variable."""
    parts = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "settings"
        parts.append(f"{setting_name(field)}: {error['msg']}, got {error.get('input')!r}")
    return "bad settings: " + "; ".join(parts)


def check_port(host: str, port: int, what: str, field: str) -> None:
    """Raise ``fail`` naming the setting to change if ``host:port`` cannot be listened on
    (port 0 takes any free port: only the host is checked)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise fail(f"bind address {host!r} cannot be resolved ({exc}); change "
                   f"{setting_name('host')}") from None
    if port == 0:
        return
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # As the servers do: a port held only by connections in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be used ({exc.strerror})"
            raise fail(f"{what} port {port} on {host} {why}; choose another with "
                       f"{setting_name(field)} (0 takes any free port)") from None


SERVICE_MODULES = ("fastapi", "uvicorn", "grpc_health", "grpc_reflection", "ortools")
"""What ``serve`` imports beyond the core: pyproject's ``service`` extra."""


def require_service_extra() -> None:
    """Raise ``fail`` naming the extra to install if a server module is missing."""
    import importlib.util

    missing = [name for name in SERVICE_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise fail(f"planner serve needs {', '.join(missing)}: "
                   f"pip install 'cp-planner[service]'")


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

    Every other setting is a PLANNER_* environment variable: see docs/settings.md.

    `python -m planner_service.service.settings_doc` prints them all as a table.
    """
    from pydantic import ValidationError

    require_service_extra()
    from planner_service.core.profiles import default_kernel_profile
    from planner_service.service.server import run
    from planner_service.service.settings import load_settings

    overrides = {k: v for k, v in {"host": host, "http_port": http_port, "grpc_port": grpc_port,
                                   "workers": workers}.items() if v is not None}
    if no_grpc:
        overrides["grpc_enabled"] = False
    try:
        settings = load_settings(**overrides)
    except ValidationError as exc:
        raise fail(settings_error(exc)) from None
    try:  # a request that names no kernel resolves it; a bad name must stop the start
        default_kernel_profile()
    except ValueError as exc:
        raise fail(str(exc)) from None
    check_port(settings.host, settings.http_port, "HTTP", "http_port")
    if settings.grpc_enabled:
        if settings.grpc_port == settings.http_port != 0:
            raise fail(f"HTTP and gRPC both ask for port {settings.http_port}; change "
                       f"{setting_name('grpc_port')}")
        check_port(settings.host, settings.grpc_port, "gRPC", "grpc_port")
    raise typer.Exit(run(settings))
