"""The error every validation of a request raises: which field is wrong, and why.

The service answers it with HTTP 422 (``{"detail", "field"}``) or gRPC INVALID_ARGUMENT
(trailer ``field``), the client's local planner with a ServiceError carrying the same
field, and the CLI with one line naming the flag to change; none of them parses the text.
"""

from __future__ import annotations

from typing import Any


class FieldError(ValueError):
    """Bad input: ``field`` is the dotted path of the offending request field, as the
    HTTP body names it (``cp_size``, ``doc_lengths.3``, ``model.num_kv_heads``,
    ``options.time_limit_s``); the message starts with the field's name and states the
    allowed range or values."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses the service's process boundary: pickle both arguments, not just args.
        return type(self), (self.field, str(self))

