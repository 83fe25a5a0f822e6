"""What pyproject.toml declares: ranges with a lock beside them, and extras that match roles.

The wheel itself (built, installed in fresh venvs, served) and pip's resolution of
``cp-planner[worker]`` beside an installed torch are checked by ``.ci/wheel_smoke.py`` in CI.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
META = PROJECT["project"]
EXTRAS = META["optional-dependencies"]
LOCK = {re.sub(r"[-_.]+", "-", Requirement(line).name).lower(): Version(line.split("==")[1])
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")}
SERVER_STACK = {"fastapi", "uvicorn", "starlette", "grpcio-health-checking",
                "grpcio-reflection", "ortools", "pandas"}
"""What a training rank does not use: the web and gRPC servers, OR-Tools (ilp) and pandas."""


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> list[tuple[str, Requirement]]:
    """(where, requirement) for every requirement but the extras' references to cp-planner."""
    found = [("dependencies", Requirement(r)) for r in META["dependencies"]]
    found += [(extra, Requirement(r)) for extra, rs in EXTRAS.items() for r in rs]
    found += [("build-system", Requirement(r)) for r in PROJECT["build-system"]["requires"]]
    return [(where, r) for where, r in found if r.name != META["name"]]


@pytest.mark.parametrize("where,requirement", declared(), ids=lambda x: str(x))
def test_every_requirement_is_a_range_holding_its_locked_version(where, requirement) -> None:
    operators = {spec.operator for spec in requirement.specifier}
    assert operators == {">=", "<"}, f"{where}: {requirement} needs a lower and an upper bound"
    locked = LOCK.get(norm(requirement.name))
    assert locked is not None, f"constraints.txt pins no {requirement.name}"
    assert requirement.specifier.contains(locked, prereleases=True), (
        f"{where}: {requirement} excludes the locked {requirement.name}=={locked}")


def test_the_lock_pins_exact_versions_only() -> None:
    lines = [line for line in (ROOT / "constraints.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.+]*", x) for x in lines)
    assert "cp-planner" not in LOCK


@pytest.mark.parametrize("extra", ["worker", "gpu", "flash-attn"])
def test_torch_ranges_keep_every_supported_release(extra: str) -> None:
    torch, = [Requirement(r) for r in EXTRAS[extra] if Requirement(r).name == "torch"]
    for version in ("2.10.0", "2.11.0", "2.12.0", "2.12.1", "2.13.0", "2.14.1"):
        assert torch.specifier.contains(version), (extra, version)
    for version in ("2.9.1", "2.15.0", "3.0.0"):
        assert not torch.specifier.contains(version), (extra, version)
    assert [r for r in EXTRAS["gpu"] if Requirement(r).name == "flash-attn"] == []


def closure(requirements: list[str]) -> set[str]:
    """Names of the distributions pip installs for ``requirements``, read from the
    metadata of this venv (which holds every extra)."""
    env = default_environment()
    seen: set[str] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({**env, "extra": extra}):
            continue
        name = norm(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(requirement.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for sub in requires:
            for wanted in requirement.extras or {""}:
                todo.append((Requirement(sub), wanted))
    return seen


def test_a_training_rank_installs_no_server_stack() -> None:
    worker = closure(META["dependencies"] + EXTRAS["worker"])
    assert "torch" in worker and "grpcio" in worker and "httpx" in worker
    assert not worker & SERVER_STACK, sorted(worker & SERVER_STACK)


def test_the_planner_host_installs_no_torch() -> None:
    host = closure(META["dependencies"] + EXTRAS["service"])
    assert {"fastapi", "uvicorn", "ortools"} <= host
    assert not host & {"torch", "transformers", "matplotlib"}


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_client_and_its_fallback_import_nothing_of_the_server_stack() -> None:
    code = ("import sys\n"
            "from planner_service.client import PlanClient\n"
            "from planner_service.client.local import prepare\n"
            "import planner_service.client.grpc_backend, planner_service.client.agreement\n"
            "import worker_runtime\n"
            "prepare()\n"
            "with PlanClient('embedded', cp_size=4) as client:\n"
            "    client.prefetch(0, [4099, 37, 1023])\n"
            "    assert client.get(0, timeout=60).plan.cp_size == 4\n"
            "print(sorted({m.split('.')[0] for m in sys.modules}))\n")
    done = python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = {norm(m) for m in eval(done.stdout.strip().splitlines()[-1])}
    assert not loaded & {"fastapi", "uvicorn", "starlette", "ortools", "pandas"}, loaded


@pytest.mark.parametrize("blocked,statement,message", [
    ("torch", "import worker_runtime",
     "worker_runtime needs torch: pip install 'cp-planner[worker]'"),
    ("ortools", "import planner_service.solvers.ilp",
     "strategy 'ilp' needs OR-Tools: pip install 'cp-planner[ilp]'"),
])
def test_a_part_whose_extra_is_missing_names_the_extra(blocked, statement, message) -> None:
    done = python(f"import sys\nsys.modules[{blocked!r}] = None\n{statement}\n")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == f"ImportError: {message}"


def test_serve_without_the_service_extra_says_which_to_install() -> None:
    done = python("import sys\nsys.modules['uvicorn'] = None\n"
                  "sys.argv = ['planner', 'serve']\n"
                  "from planner_service.cli import main\nmain()\n")
    assert done.returncode == 2, done.stdout + done.stderr
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and "pip install 'cp-planner[service]'" in lines[0], lines
