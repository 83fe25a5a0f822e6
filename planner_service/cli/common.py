"""What every ``planner`` command shares: the console, one-line errors and ``--debug``.

An error the user can cause (a ``ValueError`` from validation, an ``OSError`` from a file
or a port) ends the command with ONE line on stderr, ``error: <what to change>``, and exit
code 2; ``planner --debug ...`` shows the traceback instead. A request check's FieldError
(or a service's answer naming a field) also names the flag that sets the field.
"""

from __future__ import annotations

from typing import Any

import typer
from rich.console import Console
from typer.core import TyperGroup

from planner_service.core.errors import FieldError

# Wide enough for the tables when piped (rich defaults to 80 columns without a terminal).
console = Console(width=None if Console().is_terminal else 150)

DEBUG_KEY = "planner.debug"
"""The command context's ``meta`` key: whether ``--debug`` was given."""

USER_ERRORS = (ValueError, OSError)
"""What a user can cause: bad values (pydantic's ValidationError is a ValueError), and
files or ports that are missing, unreadable or taken."""

FIELD_FLAGS = {
    "doc_lengths": "--docs or --dataset", "cp_size": "--cp", "strategy": "--strategy",
    "context_length": "--context", "truncate": "--truncate",
    "imbalance_target": "--imbalance-target", "comm_mode": "--comm-mode", "kernel": "--kernel",
    "link": "--link", "sequences": "--sequences or --dataset", "num_ranks": "--ranks",
    "memory_tokens": "--memory-tokens", "profile": "--profile", "search": "--search",
    "micro_batches": "--micro-batches", "window": "--window", "layers": "--layers",
    "hf_config": "--hf-config",
}
"""Request field (a FieldError's ``field``, first part) -> the flag of ``planner plan``,
``compare`` or ``schedule`` that sets it."""


def one_line(message: str) -> str:
    """``message`` on one line (pydantic and OS errors span several)."""
    return " ".join(message.split())


def describe(exc: BaseException) -> str:
    """A user error as one line; for a bad request field, with the flag that sets it."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        return one_line(f"{exc.filename}: {exc.strerror}")
    from planner_service.client.base import ServiceError  # the client: only on an error

    text = one_line(str(exc)) or type(exc).__name__
    field = exc.field if isinstance(exc, (FieldError, ServiceError)) else None
    flag = FIELD_FLAGS.get((field or "").split(".")[0])
    return f"{text}; change {flag}" if flag else text


def fail(message: str) -> typer.Exit:
    """Print ``error: message`` on one line to stderr; the Exit (code 2) to raise."""
    typer.echo(f"error: {one_line(message)}", err=True)
    return typer.Exit(code=2)


def note(message: str) -> None:
    """A one-line remark on stderr (kept out of JSON printed to stdout)."""
    typer.echo(one_line(message), err=True)


class OneLineErrors(TyperGroup):
    """The command group: a user error becomes ``fail``'s one line, unless ``--debug``."""

    def invoke(self, ctx: Any) -> Any:  # typer's own click Context
        try:
            return super().invoke(ctx)
        except USER_ERRORS as exc:
            if ctx.meta.get(DEBUG_KEY):
                raise
            raise fail(describe(exc)) from None
