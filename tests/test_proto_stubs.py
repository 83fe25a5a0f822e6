"""The committed gRPC stubs are exactly what protoc makes of the packaged proto."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner_service import proto_build

STUB_FILES = ("__init__.py", "planner_pb2.py", "planner_pb2.pyi", "planner_pb2_grpc.py")


def test_regenerating_the_stubs_gives_the_committed_files(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    proto_build.generate(proto_build.PROTO_FILE, tmp_path / "proto_gen")
    changed = [name for name in STUB_FILES
               if (tmp_path / "proto_gen" / name).read_bytes()
               != (proto_build.OUT_DIR / name).read_bytes()]
    assert not changed, f"planner_service/proto_gen/{changed} differ from protoc's: run make proto"
    assert sorted(p.name for p in proto_build.OUT_DIR.glob("*.py*")) == sorted(STUB_FILES)


def test_the_stubs_load_and_refuse_another_proto(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    stubs = proto_build.load()
    assert stubs.pb2.PlanRequest(cp_size=4).cp_size == 4
    assert hasattr(stubs.pb2_grpc, "add_PlannerServicer_to_server")
    edited = tmp_path / "planner.proto"
    edited.write_text(proto_build.PROTO_FILE.read_text() + "\n// edited\n")
    monkeypatch.setattr(proto_build, "PROTO_FILE", edited)
    with pytest.raises(RuntimeError, match="make proto"):
        proto_build.load()
