"""Every shell example of README.md, docs/ and examples/README.md runs as written, or says
why it cannot run here.

The line before each ```bash block is one of:

- ``<!-- shell: run -->``: run here, from a folder laid out like the repository root, with
  ``.venv`` being the venv of this interpreter; it must exit 0, and when a ```text block
  follows, its first line must appear in the output;
- ``<!-- shell: served -->``: run against a planner this module starts (``127.0.0.1:8000``
  becomes its address); every curl must get a 2xx answer, and a ``request_hash`` the block
  shows must be the one the service answers;
- ``<!-- shell: not run: REASON -->``: the reason (a Docker engine, a cluster, minutes of
  benchmark); what such a block exercises is tested elsewhere where it can be.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from timing import scaled

from planner_service.service.testing import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]
FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
SHELL = {"bash", "sh", "shell", "console"}
MARKER = re.compile(r"^<!-- shell: (run|served|not run: (.+?)) -->$")
SERVICE = "http://127.0.0.1:8000"


class Block(NamedTuple):
    page: Path
    line: int
    marker: str
    """'run', 'served', 'not run' or '' (missing)."""
    code: str
    shown: str
    """The first line of a ```text block right after this one ('' if none)."""

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        fences = list(FENCE.finditer(text))
        for i, fence in enumerate(fences):
            if fence.group(1) not in SHELL:
                continue
            before = text[: fence.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            match = MARKER.match(before)
            marker = "" if not match else ("not run" if match.group(2) else match.group(1))
            shown = ""
            after = fences[i + 1] if i + 1 < len(fences) else None
            if after is not None and after.group(1) == "text" and \
                    not text[fence.end(): after.start()].strip():
                shown = after.group(2).strip().splitlines()[0].strip()
            found.append(Block(page, text.count("\n", 0, fence.start()) + 1, marker,
                               fence.group(2), shown))
    return found


BLOCKS = blocks()


def test_every_shell_example_is_run_or_says_why_not() -> None:
    unmarked = [str(b) for b in BLOCKS if not b.marker]
    assert not unmarked, f"shell blocks without a <!-- shell: ... --> line before them: {unmarked}"
    assert {b.marker for b in BLOCKS} == {"run", "served", "not run"}


@pytest.fixture(scope="module")
def repo_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder whose entries are the repository's, with .venv the running venv."""
    folder = tmp_path_factory.mktemp("repo")
    for entry in ROOT.iterdir():
        if entry.name not in (".venv", ".git"):
            (folder / entry.name).symlink_to(entry)
    (folder / ".venv").symlink_to(Path(sys.executable).parent.parent)
    return folder


def run_block(code: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PYTHONPATH": str(cwd), "PATH": f"{venv_bin}:{os.environ['PATH']}",
           "COLUMNS": "200", "PLANNER_LOG_LEVEL": "warning"}
    env.pop("PLANNER_DATA_DIR", None)
    return subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.marker == "run"], ids=str)
def test_a_shell_example_runs_as_written(block: Block, repo_like: Path) -> None:
    done = run_block(block.code, repo_like, scaled(60))
    assert done.returncode == 0, f"{block}:\n{block.code}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    if block.shown:
        assert block.shown in done.stdout, f"{block}: output lacks {block.shown!r}"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(workers=1, grpc=False) as running:
        yield running


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.marker == "served"], ids=str)
def test_a_curl_example_gets_the_answer_it_shows(block: Block, server, repo_like: Path) -> None:
    # curl -s alone exits 0 on an HTTP error: every curl of the block must get a 2xx.
    code = ('curl() { command curl --fail-with-body -sS "$@"; echo; }\n'
            + block.code.replace(SERVICE, server.http_url.rstrip("/")))
    done = run_block(code, repo_like, scaled(60))
    assert done.returncode == 0, f"{block}:\n{code}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    for shown in re.findall(r'"request_hash":"([0-9a-f]+)"', block.code):
        assert re.search(rf'"request_hash":"{shown}', done.stdout), (
            f"{block}: the service's request_hash is not {shown}: {done.stdout[-2000:]}")
