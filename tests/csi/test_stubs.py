"""The committed CSI stubs are what the pinned tools make of the pinned spec, byte for byte."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from flexhub.csi.proto import generate
from tests.ciplugin import on_ci


def _missing() -> str:
    if shutil.which("go") is None:
        return "go (go mod download of the spec module)"
    if importlib.util.find_spec("grpc_tools") is None:
        return "grpcio-tools"
    return ""


def test_regenerating_the_stubs_gives_the_committed_files(tmp_path: Path) -> None:
    missing = _missing()
    if missing:
        if on_ci():
            pytest.fail(f"CI must regenerate the CSI stubs, but {missing} is missing")
        pytest.skip(f"needs {missing}")
    written = generate.generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(generate.GENERATED)
    for name in generate.GENERATED:
        fresh, committed = (tmp_path / name).read_bytes(), (generate.HERE / name).read_bytes()
        assert fresh == committed, f"flexhub/csi/proto/{name} differs from a regeneration"


def test_the_stubs_import_and_serve_the_spec_version_s_services() -> None:
    from flexhub.csi.proto import csi_pb2, csi_pb2_grpc

    services = csi_pb2.DESCRIPTOR.services_by_name
    assert {"Identity", "Controller", "Node", "GroupController", "SnapshotMetadata"} <= set(
        services
    )
    # v1.13.0's alpha health RPCs are there: the stubs are of the pinned version
    assert "NodeGetVolumeHealth" in services["Node"].methods_by_name
    assert csi_pb2.DESCRIPTOR.package == "csi.v1"
    assert hasattr(csi_pb2_grpc, "add_NodeServicer_to_server")
