"""The settings table of ``docs/settings.md``, generated from :class:`Settings`.

    python -m planner_service.service.settings_doc        # prints the Markdown table

One row per field: the environment variable, its default, the values it accepts (from the
field's pydantic constraints) and its meaning (the attribute docstring under the field in
``settings.py``). ``tests/test_docs.py`` checks that the table in ``docs/settings.md`` is
exactly this output, so the documentation cannot drift from the code.
"""

from __future__ import annotations

import ast
import inspect
from typing import Any, NamedTuple

import annotated_types
from pydantic.fields import FieldInfo

from planner_service.service.settings import Settings

ENV_PREFIX = "PLANNER_"
HEADER = ("| variable | default | accepts | meaning |", "|---|---|---|---|")


class SettingRow(NamedTuple):
    variable: str
    default: str
    accepts: str
    meaning: str


def field_docstrings(cls: type) -> dict[str, str]:
    """Attribute docstrings of ``cls``: the string literal right under each annotated field."""
    body = ast.parse(inspect.getsource(cls)).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for node, after in zip(body.body, body.body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split()).replace("``", "`")
    return docs


def _text(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        doc = " ".join((info.default_factory.__doc__ or "computed at start").split())
        return doc.rstrip(".")
    if info.default is None:
        return "unset"
    return f"`{_text(info.default)}`"


def _accepts(info: FieldInfo) -> str:
    if info.annotation is bool:
        return "`true`, `false`"
    if info.annotation is str:
        return "text"
    if info.annotation not in (int, float):
        return "text"
    low = high = ""
    for rule in info.metadata:
        if isinstance(rule, annotated_types.Ge):
            low = f"{_text(rule.ge)}"
        elif isinstance(rule, annotated_types.Gt):
            low = f"> {_text(rule.gt)}"
        elif isinstance(rule, annotated_types.Le):
            high = f"{_text(rule.le)}"
    kind = "integer" if info.annotation is int else "number"
    if low.startswith(">"):
        return f"{kind} {low}, at most {high}" if high else f"{kind} {low}"
    return f"{kind} {low} to {high}" if low and high else kind


def settings_rows() -> list[SettingRow]:
    """The table's rows, in the order the fields are declared."""
    docs = field_docstrings(Settings)
    return [SettingRow(f"`{ENV_PREFIX}{name.upper()}`", _default(info), _accepts(info),
                       docs.get(name, ""))
            for name, info in Settings.model_fields.items()]


def markdown_table() -> str:
    """The settings table as Markdown lines (no trailing newline)."""
    lines = list(HEADER)
    lines += [f"| {r.variable} | {r.default} | {r.accepts} | {r.meaning} |"
              for r in settings_rows()]
    return "\n".join(lines)


def main() -> None:
    print(markdown_table())


if __name__ == "__main__":
    main()
