"""The step-time model's path table: one model per execution path, one module per model."""

from __future__ import annotations

import importlib
from pathlib import Path

from planner_service.core.paths import ExecutionPath
from planner_service.core.step_time import PATH_MODELS, PathModel
from planner_service.fcp.cost_model import OVERLAPS

PACKAGE = Path(__file__).resolve().parents[1] / "planner_service" / "core" / "step_time"


def test_every_path_has_its_model_in_the_module_named_after_it():
    assert set(PATH_MODELS) == set(ExecutionPath)
    for path, model in PATH_MODELS.items():
        module = importlib.import_module(f"planner_service.core.step_time.{path.value}")
        assert isinstance(model, PathModel) and model is module.MODEL, path
        assert model.terms.__module__ == model.group_terms.__module__ == module.__name__, path
        assert model.hides in OVERLAPS, path


def test_the_modules_stay_small():
    for file in sorted(PACKAGE.glob("*.py")):
        lines = len(file.read_text(encoding="utf-8").splitlines())
        assert lines <= 400, f"{file.name}: {lines} lines"
