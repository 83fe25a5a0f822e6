"""``bench/gpu_check.py`` runs on a bare CUDA machine: its import graph needs only numpy,
torch (with what torch itself requires) and the project's own packages, and its
``--cpu-smoke`` (the same stages on CPU) runs in a subprocess where the service's
dependencies and flash-attn cannot be imported and no data folder is set, writing every
stage's table. Also: the runtime imports flash-attn only when it is chosen.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from timing import scaled

ROOT = Path(__file__).resolve().parent.parent
BLOCKED = ("fastapi", "uvicorn", "starlette", "grpc", "ortools", "pydantic", "flash_attn",
           "transformers", "hypothesis", "pytest", "matplotlib", "scipy")
OWN = ("planner_service", "worker_runtime", "bench")
STAGES = ("environment", "correctness", "windows", "timings", "figure3", "model_check", "fcp_timings")

CHILD = r"""
import importlib.abc, json, runpy, sys
BLOCKED = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: a bare GPU machine does not have it")

sys.meta_path.insert(0, Block())
out = sys.argv[2]
sys.argv = ["bench.gpu_check", "--cpu-smoke", out]
code = 0
try:
    runpy.run_module("bench.gpu_check", run_name="__main__")
except SystemExit as exc:
    code = exc.code
json.dump(sorted({m.split(".")[0] for m in sys.modules}), open(out + "/modules.json", "w"))
sys.exit(code)
"""

BASELINE = ("import json, sys, numpy, torch, torch.distributed, torch.nn.attention\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")


def allowed_distributions() -> set[str]:
    """numpy, torch and everything they require, transitively (installed distributions)."""
    from importlib import metadata

    seen: set[str] = set()
    todo = ["numpy", "torch"]
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for req in requires:
            if "extra ==" in req:
                continue
            todo.append(req.split(";")[0].split("[")[0].split("<")[0].split(">")[0]
                        .split("=")[0].split("!")[0].split("~")[0].strip())
    return seen


@pytest.mark.slow
def test_gpu_check_smoke_runs_with_only_numpy_and_torch(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PLANNER_DATA_DIR"}
    env["PYTHONPATH"] = str(ROOT)
    env["PLANNER_DATA_DIR"] = str(tmp_path / "no-data-here")
    proc = subprocess.run([sys.executable, "-c", CHILD, ",".join(BLOCKED), str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(240.0))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("gpu_check stage")]
    assert tuple(x.split()[3].rstrip(":") for x in lines) == STAGES, proc.stdout
    for i, name in enumerate(STAGES, 1):
        assert (tmp_path / f"{i}_{name}.md").is_file() and (tmp_path / f"{i}_{name}.json").is_file()
    summary = (tmp_path / "gpu_check.md").read_text()
    assert "family:pile, because wlbllm is not available here" in summary  # the noted fallback
    correctness = json.loads((tmp_path / "2_correctness.json").read_text())
    assert correctness["ok"] and {r["path"] for r in correctness["rows"]} == {
        "segments", "segment_ring", "gathered", "lean"}
    windowed = json.loads((tmp_path / "3_windows.json").read_text())
    assert windowed["ok"] and windowed["rows"] and all(r["ok"] for r in windowed["rows"])

    from importlib import metadata

    modules = json.loads((tmp_path / "modules.json").read_text())
    # What torch imports by itself where installed (tqdm in torch.hub, ...) is torch's.
    base = subprocess.run([sys.executable, "-c", BASELINE], capture_output=True, text=True,
                          timeout=scaled(120.0), env=env)
    own_torch = set(json.loads(base.stdout))
    owners = metadata.packages_distributions()
    allowed = allowed_distributions()
    foreign = [m for m in modules if m not in sys.stdlib_module_names and m not in OWN
               and m not in own_torch and not m.startswith("_") and m in owners
               and not {d.lower().replace("_", "-") for d in owners[m]} & allowed]
    assert foreign == [], f"gpu_check imports {foreign}, which numpy and torch do not require"
    assert not set(modules) & set(BLOCKED)
    assert json.loads((tmp_path / "timings_gpu.json").read_text())["records"]


def test_runtime_imports_flash_attn_only_when_chosen() -> None:
    code = ("import sys, torch\n"
            "from worker_runtime import ContextParallelAttention\n"
            "from planner_service.core.request import PlanRequest\n"
            "from planner_service.solvers.registry import solve\n"
            "plan = solve(PlanRequest(doc_lengths=(5, 3), cp_size=1))\n"
            "attn = ContextParallelAttention(plan)\n"
            "attn(*(torch.zeros(8, h, 8, requires_grad=True) for h in (2, 1, 1))).sum().backward()\n"
            "print('flash_attn' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=scaled(120.0))
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]
