"""Every execution path has its runtime module, its test module and its step-time model
module, and the runtime's table holds exactly the paths of the plan contract."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner_service.core.paths import ExecutionPath
from worker_runtime.paths import PATHS, RuntimePath

ROOT = Path(__file__).resolve().parent.parent
NAMES = [p.value for p in ExecutionPath]


@pytest.mark.parametrize("name", NAMES)
def test_every_path_has_a_runtime_module_and_a_test_module(name: str) -> None:
    assert (ROOT / "worker_runtime" / "paths" / f"{name}.py").is_file(), name
    assert (ROOT / "tests" / f"test_path_{name}.py").is_file(), name


@pytest.mark.skipif(not (ROOT / "planner_service" / "core" / "step_time").is_dir(),
                    reason="the step-time model is not yet a package of one module per path")
@pytest.mark.parametrize("name", NAMES)
def test_every_path_has_a_step_time_module(name: str) -> None:
    assert (ROOT / "planner_service" / "core" / "step_time" / f"{name}.py").is_file(), name


def test_the_runtime_table_is_the_enum() -> None:
    assert set(PATHS) == set(ExecutionPath)
    assert len(PATHS) == len(ExecutionPath)
    for path, entry in PATHS.items():
        assert isinstance(entry, RuntimePath) and entry.name is path
        assert entry.run.__module__ == f"worker_runtime.paths.{path.value}"
        assert entry.windowed in PATHS
