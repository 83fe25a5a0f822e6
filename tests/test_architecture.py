"""The import graph (grimp): no import circles, no arrow pointing up the layers.

Layers of ``planner_service``, lowest first: ``core`` (the plan contract, cost model and
validation); then ``data``, ``solvers``, ``fcp`` (and ``proto_build``); then the edges
``service``, ``client``, ``cli`` (and ``strategy_summary``, ``plot``). ``fcp`` is FCP's
algorithm alone and imports only the core (the code that builds plans with other strategies
lives in ``solvers``). ``worker_runtime`` imports only the plan contract from ``planner_service``.
And the install: the service (``make run``) needs neither torch nor matplotlib.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]

PACKAGES = ("planner_service", "worker_runtime")

LAYERS = (
    grimp.Layer("cli", "service", "client", "strategy_summary", "plot", independent=False),
    grimp.Layer("solvers", "fcp", "data", "proto_build", independent=False),
    grimp.Layer("core"),
)
"""``planner_service``'s layers, highest first: a layer imports only the layers below it."""

CONTRACT = frozenset({
    "planner_service.core.plan",
    "planner_service.core.model",
    "planner_service.core.cost",
    "planner_service.core.errors",
    "planner_service.core.mask",
    "planner_service.core.paths",
    "planner_service.core.seeing",
})
"""What ``worker_runtime`` may import from ``planner_service``: the plan, the model shape
it carries, the attention mask it records (``core.mask``), the names of comm modes and
execution paths with the rule that picks a path (``core.paths``), the query rows that see a key set
(``core.seeing``, which the step-time model counts too), the exchange volumes of its
shards (``core.cost``) and the error the model shape's checks raise (``core.errors``)."""

@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES)


def import_circles(graph: grimp.ImportGraph) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == module:
                        break
                if len(component) > 1:
                    circles.append(frozenset(component))
    return circles


def test_the_circle_finder_finds_a_circle_and_nothing_else():
    graph = grimp.ImportGraph()
    for importer, imported in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"),
                               ("p.d", "p.e")):
        graph.add_import(importer=importer, imported=imported)
    assert import_circles(graph) == [frozenset({"p.a", "p.b", "p.c"})]


def test_no_import_circles(graph):
    circles = import_circles(graph)
    assert not circles, f"import circles: {[sorted(c) for c in circles]}"


def test_no_layer_imports_a_layer_above_it(graph):
    illegal = graph.find_illegal_dependencies_for_layers(layers=LAYERS,
                                                         containers={"planner_service"})
    found = sorted(
        f"{dep.importer} -> {dep.imported}: "
        + ", ".join(" -> ".join((min(route.heads), *route.middle, min(route.tails)))
                    for route in dep.routes)
        for dep in illegal
    )
    assert not found, "imports pointing up the layers:\n" + "\n".join(found)


def test_fcp_is_the_algorithm_alone(graph):
    imported = {
        (module, target)
        for module in graph.find_descendants("planner_service.fcp") | {"planner_service.fcp"}
        for target in graph.find_modules_directly_imported_by(module)
        if target.startswith("planner_service.")
        and not target.startswith(("planner_service.fcp", "planner_service.core"))
    }
    assert not imported, f"planner_service.fcp imports beyond the core: {sorted(imported)}"


def test_the_worker_runtime_imports_only_the_plan_contract(graph):
    worker = graph.find_descendants("worker_runtime") | {"worker_runtime"}
    imported = {
        (module, target)
        for module in worker
        for target in graph.find_modules_directly_imported_by(module)
        if target.startswith("planner_service") and target not in CONTRACT
    }
    assert not imported, f"worker_runtime imports beyond the plan contract: {sorted(imported)}"
    # The contract is closed: it needs nothing else of planner_service.
    needs = {m for c in CONTRACT for m in graph.find_upstream_modules(c)
             if m.startswith("planner_service.")}
    assert needs <= CONTRACT, f"the plan contract needs {sorted(needs - CONTRACT)}"


def test_the_layer_check_sees_an_upward_import():
    graph = grimp.build_graph(*PACKAGES)
    graph.add_import(importer="planner_service.core.plan", imported="planner_service.cli.common")
    illegal = graph.find_illegal_dependencies_for_layers(layers=LAYERS,
                                                         containers={"planner_service"})
    assert {(d.importer, d.imported) for d in illegal} == {
        ("planner_service.core", "planner_service.cli")}


def test_the_service_and_the_cli_import_neither_torch_nor_matplotlib():
    # `make run` installs the service's dependencies alone (pyproject's [project] list).
    code = ("import sys, planner_service.service.server, planner_service.cli, "
            "planner_service.client; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'matplotlib', "
            "'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_service_install_has_no_torch_and_dev_has_every_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    service = {requirement_name(r) for r in project["dependencies"] + extras["service"]}
    assert not service & {"torch", "matplotlib", "transformers", "flash-attn"}
    dev = set()
    for requirement in extras["dev"]:  # cp-planner[a,b]: the extras a and b
        parsed = Requirement(requirement)
        names = ([requirement_name(r) for extra in parsed.extras for r in extras[extra]]
                 if parsed.name == project["name"] else [requirement_name(requirement)])
        dev.update(names)
    for extra, requirements in extras.items():
        if extra not in ("flash-attn", "dev"):  # flash-attn needs CUDA to build
            assert {requirement_name(r) for r in requirements} <= dev, extra


def requirement_name(requirement: str) -> str:
    return Requirement(requirement).name.lower()
