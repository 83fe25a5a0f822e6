"""CI: the wheel and the sdist, built from the committed tree, install and serve.

1. ``git archive HEAD`` (what a clone holds, nothing beside it) is built with ``python -m
   build`` in a tools venv: the sdist, then the wheel from the sdist.
2. Each of the two is installed with the ``service`` extra (at constraints.txt's versions)
   into a fresh venv, and from a folder outside the source: ``planner --help``, ``planner plan
   --dataset wlbllm``, ``planner serve`` answering ``/v1/plan`` over HTTP and ``Plan`` over
   gRPC, then stopping with exit 0 on SIGTERM.
3. ``pip install 'cp-planner[worker]'`` is resolved (``--dry-run``, offline: ``--no-index``,
   the wheel and installed metadata only) into a venv holding torch 2.12 (or 2.10, 2.14.1):
   pip must keep that torch and install cp-planner alone; with torch 2.9 it must refuse.
   The venv holds no real packages, only their metadata (copied from the running venv), so
   no torch is downloaded.

Every step has a time limit; any failure prints what the command said and exits non-zero.
Run: ``.venv/bin/python .ci/wheel_smoke.py`` (``.ci/run`` does after ``make test``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
PLAN_BODY = {"doc_lengths": [4099, 37, 1023, 8191], "cp_size": 4, "strategy": "flashcp"}


def log(message: str) -> None:
    print(f"wheel-smoke: {message}", flush=True)


def run(cmd: list[str], *, timeout: float, cwd: Path | None = None, check: bool = True,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; on a non-zero exit (``check``) or a timeout, stop with its output."""
    try:
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        sys.exit(f"wheel-smoke: FAILED: {' '.join(cmd)} ran over {timeout:.0f} s\n"
                 f"{exc.stdout or ''}{exc.stderr or ''}")
    if check and done.returncode != 0:
        sys.exit(f"wheel-smoke: FAILED (exit {done.returncode}): {' '.join(cmd)}\n"
                 f"{done.stdout[-4000:]}{done.stderr[-4000:]}")
    return done


def venv(path: Path) -> Path:
    run([sys.executable, "-m", "venv", str(path)], timeout=120)
    return path / "bin"


def build(work: Path) -> tuple[Path, Path]:
    """The sdist and the wheel of the committed tree."""
    src = work / "src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True,
                             timeout=120, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True, timeout=120)
    tools = venv(work / "tools")
    run([str(tools / "pip"), "install", "-q", "-c", str(CONSTRAINTS), "build"], timeout=300)
    run([str(tools / "python"), "-m", "build", "--outdir", str(work / "dist"), str(src)],
        timeout=600)
    sdist, = (work / "dist").glob("*.tar.gz")
    wheel, = (work / "dist").glob("*.whl")
    return sdist, wheel


def start_server(bin_dir: Path, cwd: Path) -> tuple[subprocess.Popen[str], str, str]:
    """``planner serve`` on free ports; (process, HTTP URL, gRPC target)."""
    env = {**os.environ, "PLANNER_WORKERS": "1", "PLANNER_LOG_LEVEL": "warning"}
    proc = subprocess.Popen([str(bin_dir / "planner"), "serve", "--http-port", "0",
                             "--grpc-port", "0"], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    seen: list[str] = []
    http = grpc = None
    deadline = time.monotonic() + 90
    os.set_blocking(proc.stdout.fileno(), False)
    while time.monotonic() < deadline and not (http and grpc):
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
            continue
        seen.append(line)
        http = http or next(iter(re.findall(r"http://[\d.]+:\d+", line)), None)
        found = re.search(r"grpc(?:://| on | )\s*([\d.]+:\d+)", line, re.IGNORECASE)
        grpc = grpc or (found.group(1) if found else None)
    if not (http and grpc):
        proc.kill()
        sys.exit("wheel-smoke: FAILED: planner serve printed no HTTP and gRPC address in 90 s:\n"
                 + "".join(seen) + (proc.stdout.read() or ""))
    return proc, http, grpc


def check_served(bin_dir: Path, cwd: Path) -> None:
    proc, http, grpc = start_server(bin_dir, cwd)
    try:
        request = urllib.request.Request(f"{http}/v1/plan", data=json.dumps(PLAN_BODY).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            plan = json.loads(reply.read())
        assert reply.status == 200 and plan["cp_size"] == 4, plan
        log(f"  HTTP {http}/v1/plan: 200, plan {plan['plan_id'][:12]}")
        probe = ("import grpc\n"
                 "from planner_service.proto_build import load\n"
                 "pb2, pb2_grpc = load()\n"
                 f"stub = pb2_grpc.PlannerStub(grpc.insecure_channel({grpc!r}))\n"
                 f"reply = stub.Plan(pb2.PlanRequest(**{PLAN_BODY!r}), timeout=60)\n"
                 "print(reply.plan_id)\n")
        done = run([str(bin_dir / "python"), "-I", "-c", probe], cwd=cwd, timeout=120)
        if done.stdout.strip() != plan["plan_id"]:
            sys.exit(f"wheel-smoke: FAILED: gRPC Plan answered {done.stdout.strip()!r}, HTTP "
                     f"{plan['plan_id']}\n{done.stderr}")
        log(f"  gRPC {grpc} Plan: the same plan")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            sys.exit("wheel-smoke: FAILED: planner serve did not stop within 60 s of SIGTERM")
    if code != 0:
        sys.exit(f"wheel-smoke: FAILED: planner serve exited {code} on SIGTERM")


def check_installed(artifact: Path, work: Path) -> None:
    """Install ``artifact`` with the service extra into a fresh venv and use it."""
    log(f"{artifact.name}: install into a fresh venv")
    bin_dir = venv(work / f"venv-{artifact.suffix.strip('.')}")
    run([str(bin_dir / "pip"), "install", "-q", "-c", str(CONSTRAINTS),
         f"cp-planner[service] @ {artifact.as_uri()}"], timeout=600)
    cwd = work / "elsewhere"  # nothing of the source beside the process
    cwd.mkdir(exist_ok=True)
    done = run([str(bin_dir / "pip"), "show", "torch"], timeout=60, check=False)
    if done.returncode == 0:
        sys.exit("wheel-smoke: FAILED: the service install pulled in torch")
    done = run([str(bin_dir / "planner"), "--help"], cwd=cwd, timeout=60)
    assert "serve" in done.stdout and "plan" in done.stdout, done.stdout
    log("  planner --help: ok")
    done = run([str(bin_dir / "planner"), "plan", "--dataset", "wlbllm", "--context", "32768",
                "--cp", "4", "--json"], cwd=cwd, timeout=120, env={**os.environ,
                                                                  "PLANNER_DATA_DIR": ""})
    plan = json.loads(done.stdout)
    assert sum(plan["doc_lengths"]) == 32768 and plan["cp_size"] == 4, plan
    log(f"  planner plan --dataset wlbllm: {len(plan['doc_lengths'])} documents")
    check_served(bin_dir, cwd)


def fake_env(path: Path, torch_version: str) -> Path:
    """A venv without pip whose site-packages holds only metadata: every distribution of
    the running interpreter (cp-planner excluded), torch at ``torch_version``."""
    bin_dir = path / "bin"
    run([sys.executable, "-m", "venv", "--without-pip", str(path)], timeout=120)
    site, = path.glob("lib/python*/site-packages")
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if not name or name.lower().replace("_", "-") == "cp-planner":
            continue
        text = dist.read_text("METADATA") or f"Metadata-Version: 2.1\nName: {name}\n"
        version = dist.version
        if name.lower() == "torch":
            version = torch_version
            text = re.sub(r"(?m)^Version: .*$", f"Version: {version}", text)
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(text)
        (info / "INSTALLER").write_text("wheel-smoke\n")
    return bin_dir


def check_worker_resolution(wheel: Path, work: Path) -> None:
    """pip keeps a supported torch and refuses an unsupported one (offline, --dry-run)."""
    if importlib.util.find_spec("torch") is None:
        sys.exit("wheel-smoke: FAILED: run me with the dev venv (.venv/bin/python): the fake "
                 "environments copy its torch metadata")
    for torch_version, supported in (("2.12.0", True), ("2.10.0", True), ("2.14.1", True),
                                     ("2.9.1", False)):
        bin_dir = fake_env(work / f"fake-torch-{torch_version}", torch_version)
        report = work / f"report-{torch_version}.json"
        # --isolated: no pip configuration of this machine (its find-links hold a torch).
        done = run([sys.executable, "-m", "pip", "--isolated", "--python",
                    str(bin_dir / "python"), "install", "--dry-run", "--no-index",
                    "--find-links", str(wheel.parent), "--report", str(report),
                    f"cp-planner[worker] @ {wheel.as_uri()}"], timeout=300, check=False)
        chosen = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}"
                        for i in json.loads(report.read_text())["install"]) \
            if done.returncode == 0 else None
        if supported:
            if chosen != ["cp-planner==0.1.0"]:
                sys.exit(f"wheel-smoke: FAILED: beside torch {torch_version}, pip install "
                         f"'cp-planner[worker]' would install {chosen}:\n"
                         f"{done.stdout}{done.stderr}")
            log(f"torch {torch_version} installed: pip install 'cp-planner[worker]' keeps it "
                f"and installs {chosen}")
        else:
            # pip names the conflict: "cp-planner[worker] 0.1.0 depends on torch<2.15,>=2.10"
            refused = (chosen is None and "depends on torch" in done.stdout + done.stderr) or (
                chosen is not None and any(c.startswith("torch==") for c in chosen))
            if not refused:
                sys.exit(f"wheel-smoke: FAILED: torch {torch_version} is below the supported "
                         f"range, yet [worker] resolved to {chosen} beside it:\n"
                         f"{done.stdout}{done.stderr}")
            log(f"torch {torch_version} installed: [worker] does not accept it")


def main() -> None:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="wheel-smoke-") as tmp:
        work = Path(tmp)
        sdist, wheel = build(work)
        log(f"built {sdist.name} and {wheel.name} ({time.monotonic() - start:.0f} s)")
        check_worker_resolution(wheel, work)
        for artifact in (wheel, sdist):
            check_installed(artifact, work)
    log(f"passed in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
