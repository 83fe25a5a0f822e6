"""The gRPC stubs of ``planner_service/proto/planner.proto``, in ``planner_service/proto_gen/``.

The stubs are committed and ship in the wheel, so the service needs no protoc at run time
(grpcio-tools is a dev dependency). After an edit of the proto, ``make proto`` (``python -m
planner_service.proto_build``) regenerates them; :func:`load` refuses stubs made from another
proto, and ``tests/test_proto_stubs.py`` checks that regenerating gives the committed bytes.

Generation holds a file lock and replaces files atomically, so concurrent processes see
either the old or the new complete set.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_FILE = PACKAGE_DIR / "proto" / "planner.proto"
OUT_DIR = PACKAGE_DIR / "proto_gen"
STUB_PACKAGE = "planner_service.proto_gen"


class Stubs(NamedTuple):
    pb2: ModuleType
    """Messages (planner_pb2)."""
    pb2_grpc: ModuleType
    """Service stub, servicer base and ``add_PlannerServicer_to_server``."""


def proto_sha256(proto: Path = PROTO_FILE) -> str:
    return hashlib.sha256(proto.read_bytes()).hexdigest()


def _stamp(out: Path) -> str | None:
    """The proto hash the stubs in ``out`` were made from, or None if they are incomplete."""
    init = out / "__init__.py"
    if not all((out / name).is_file() for name in ("planner_pb2.py", "planner_pb2_grpc.py")):
        return None
    if not init.is_file():
        return None
    for line in init.read_text().splitlines():
        if line.startswith("PROTO_SHA256 = "):
            return line.split("=", 1)[1].strip().strip('"')
    return None


def is_stale(proto: Path = PROTO_FILE, out: Path = OUT_DIR) -> bool:
    """True if the stubs are missing or were generated from different proto content."""
    return _stamp(out) != proto_sha256(proto)


def generate(proto: Path = PROTO_FILE, out: Path = OUT_DIR) -> None:
    """Run protoc (grpcio-tools) and install the stubs in ``out``.

    Raises RuntimeError if grpcio-tools is missing or protoc fails.
    """
    try:
        from grpc_tools import protoc
    except ImportError as exc:  # pragma: no cover - a dev dependency
        raise RuntimeError("grpcio-tools is needed to generate the gRPC stubs: "
                           "pip install -c constraints.txt -e '.[dev]'") from exc
    import grpc_tools

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".proto_gen-") as tmp:
        well_known = Path(grpc_tools.__file__).parent / "_proto"
        code = protoc.main([
            "grpc_tools.protoc", f"-I{proto.parent}", f"-I{well_known}",
            f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(proto),
        ])
        if code != 0:
            raise RuntimeError(f"protoc failed on {proto} with exit code {code}")
        stem = proto.stem
        grpc_file = Path(tmp) / f"{stem}_pb2_grpc.py"
        # protoc writes a top-level import; the stubs live in a package.
        grpc_file.write_text(grpc_file.read_text().replace(
            f"import {stem}_pb2 as", f"from {STUB_PACKAGE} import {stem}_pb2 as"))
        (Path(tmp) / "__init__.py").write_text(
            f'"""Generated from {proto.name} by planner_service.proto_build; do not edit."""\n'
            f'PROTO_SHA256 = "{proto_sha256(proto)}"\n')
        # __init__.py last: its stamp marks the set complete.
        for name in (f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py", "__init__.py"):
            os.replace(Path(tmp) / name, out / name)


def ensure_stubs(proto: Path = PROTO_FILE, out: Path = OUT_DIR) -> None:
    """Generate the stubs under a file lock if they are missing or stale."""
    if not is_stale(proto, out):
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".proto_gen.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if is_stale(proto, out):  # another process may have finished meanwhile
                generate(proto, out)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load() -> Stubs:
    """Import the committed stubs.

    Raises:
        RuntimeError: if they were generated from another version of the proto.
    """
    if is_stale(PROTO_FILE, OUT_DIR):
        raise RuntimeError(f"the gRPC stubs in {OUT_DIR} were not generated from {PROTO_FILE}: "
                           f"run `make proto`")
    pb2 = importlib.import_module(f"{STUB_PACKAGE}.planner_pb2")
    pb2_grpc = importlib.import_module(f"{STUB_PACKAGE}.planner_pb2_grpc")
    return Stubs(pb2, pb2_grpc)


def main() -> None:
    generate()
    print(f"generated gRPC stubs for {PROTO_FILE.name} in {OUT_DIR}", file=sys.stderr)


if __name__ == "__main__":
    main()
