"""The documentation: a short README, the settings table equal to the code, no dead links.

Every relative link in README.md and docs/*.md must name a file or folder of the
repository; a link with an anchor into a Markdown file must name one of its headings.
Links inside code blocks and to other sites are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from planner_service.service.settings import Settings
from planner_service.service.settings_doc import ENV_PREFIX, markdown_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 250
TABLE_START = "<!-- settings-table:start -->"
TABLE_END = "<!-- settings-table:end -->"

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not EXTERNAL.match(t)]


def test_the_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_docs_exist_and_every_page_is_indexed() -> None:
    index = DOCS / "index.md"
    assert index.is_file()
    linked = {Path(t.split("#")[0]).name for t in relative_links(index)}
    unlisted = [p.name for p in PAGES if p.parent == DOCS and p != index and p.name not in linked]
    assert not unlisted, f"docs/index.md does not link {unlisted}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    dead = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or ROOT not in (file, *file.parents):
            dead.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            dead.append(target)
    assert not dead, f"{page.relative_to(ROOT)}: dead links {dead}"


def test_the_link_checker_sees_links_and_ignores_code() -> None:
    page = "[a](docs/x.md) ![b](img.png#top) [c](https://e.org) `[d](no.md)`\n```\n[e](f.md)\n```\n"
    found = [t for t in LINK.findall(prose(page)) if not EXTERNAL.match(t)]
    assert found == ["docs/x.md", "img.png#top"]
    assert slug("Jobs: submit, then `GET` (long-poll)") == "jobs-submit-then-get-long-poll"


def settings_block() -> str:
    text = (DOCS / "settings.md").read_text()
    assert text.count(TABLE_START) == 1 and text.count(TABLE_END) == 1
    return text.split(TABLE_START)[1].split(TABLE_END)[0].strip()


def test_the_settings_table_is_generated_from_settings_py() -> None:
    assert settings_block() == markdown_table(), (
        "docs/settings.md is out of date: paste the output of "
        "`python -m planner_service.service.settings_doc` between its markers")


def test_the_settings_table_has_every_setting_once_with_its_meaning() -> None:
    table = markdown_table()
    for name in Settings.model_fields:
        row = [line for line in table.splitlines()
               if line.startswith(f"| `{ENV_PREFIX}{name.upper()}` |")]
        assert len(row) == 1, name
        assert row[0].rstrip(" |").split(" | ")[-1], f"{name} has no docstring in settings.py"


def test_the_settings_table_exists_once() -> None:
    """Other pages link to docs/settings.md instead of carrying a copy of the table."""
    copies = [p.name for p in PAGES if "| `PLANNER_HTTP_PORT` |" in p.read_text()]
    assert copies == ["settings.md"]


HISTORY = re.compile(r"\b(scratch run|this session|two versions back|previous version|"
                     r"previously|issue \d+)\b|\bcommit [0-9a-f]{7,40}\b|\bDESIGN\.md\b",
                     re.IGNORECASE)
"""History and references outside the repository: a page or docstring says what is, and
cites docs/ pages, not a design file, an issue or a commit."""
RESULTS = sorted((ROOT / "bench" / "results").glob("*.md"))
SOURCES = sorted(p for folder in ("planner_service", "worker_runtime", "bench", "tests",
                                  "examples")
                 for p in (ROOT / folder).rglob("*.py")
                 if "proto_gen" not in p.parts and p != Path(__file__).resolve())


@pytest.mark.parametrize("page", PAGES + RESULTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_are_written_for_users_not_as_history(page: Path) -> None:
    found = sorted({m.group(0) for m in HISTORY.finditer(page.read_text())})
    assert not found, f"{page.relative_to(ROOT)}: {found}"


def test_code_cites_no_history_or_outside_file() -> None:
    found = {str(p.relative_to(ROOT)): sorted({m.group(0) for m in HISTORY.finditer(p.read_text())})
             for p in SOURCES}
    assert SOURCES and not {k: v for k, v in found.items() if v}


def test_serve_help_points_at_the_settings_page() -> None:
    from typer.testing import CliRunner

    from planner_service.cli import app

    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "docs/settings.md" in result.output and (DOCS / "settings.md").is_file()
    assert "python -m planner_service.service.settings_doc" in result.output


@pytest.mark.parametrize("page", [README, ROOT / "docs" / "api.md"], ids=lambda p: p.name)
def test_the_curl_example_shows_the_plan_that_request_gets(page: Path) -> None:
    import json

    from planner_service.core.request import PlanRequest
    from planner_service.solvers.registry import solve

    text = page.read_text()
    body = json.loads(re.search(r"-d '(\{\"doc_lengths\".*?\})'", text).group(1))
    plan = solve(PlanRequest(**{k: tuple(v) if isinstance(v, list) else v for k, v in body.items()}))
    assert f"x-plan-id: {plan.plan_id}" in text
    assert f'"est_step_ms":{plan.metrics.est_step_ms:.2f}' in text
