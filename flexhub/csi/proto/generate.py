"""Regenerate the CSI stubs of this directory from ``csi.proto`` of the pinned spec.

``python3 -m flexhub.csi.proto.generate [OUT_DIR]`` fetches the Go module
``github.com/container-storage-interface/spec`` at :data:`SPEC_VERSION` through ``go mod download``
(the Go module proxy) and runs ``grpc_tools.protoc`` (the pinned ``grpcio-tools``) on its
``csi.proto`` with ``--python_out``, ``--grpc_python_out`` and ``--pyi_out``. OUT_DIR defaults
to this directory; a test generates into a temporary one and compares byte for byte. The
proto itself is not kept here: the module is its one source (the stubs embed its descriptor).

The proto is compiled as ``flexhub/csi/proto/csi.proto`` so that the generated
``csi_pb2_grpc.py`` imports ``flexhub.csi.proto.csi_pb2`` (the wire names stay ``csi.v1.*``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["GENERATED", "SPEC_MODULE", "SPEC_VERSION", "generate", "spec_proto"]

SPEC_MODULE = "github.com/container-storage-interface/spec"
SPEC_VERSION = "v1.13.0"
#: The files this script writes (what protoc makes of the spec's proto).
GENERATED = ("csi_pb2.py", "csi_pb2.pyi", "csi_pb2_grpc.py")
HERE = Path(__file__).resolve().parent
_PACKAGE_PATH = Path("flexhub/csi/proto")


def spec_proto(work: Path) -> Path:
    """``csi.proto`` of the pinned spec module, downloaded with ``go mod download``."""
    proc = subprocess.run(
        ["go", "mod", "download", "-json", f"{SPEC_MODULE}@{SPEC_VERSION}"],
        cwd=work,
        env=_go_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"go mod download {SPEC_MODULE}@{SPEC_VERSION} failed: {proc.stderr}")
    directory = Path(json.loads(proc.stdout)["Dir"])
    return directory / "csi.proto"


def _go_env() -> dict[str, str]:
    import os

    return {**os.environ, "GOFLAGS": "-mod=mod", "GO111MODULE": "on"}


def generate(out: Path = HERE) -> list[Path]:
    """Write :data:`GENERATED` into ``out``; return their paths."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        include = work / "include"
        (include / _PACKAGE_PATH).mkdir(parents=True)
        proto = include / _PACKAGE_PATH / "csi.proto"
        shutil.copyfile(spec_proto(work), proto)
        generated = work / "out"
        generated.mkdir()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"-I{include}",
                f"--python_out={generated}",
                f"--grpc_python_out={generated}",
                f"--pyi_out={generated}",
                str(_PACKAGE_PATH / "csi.proto"),
            ],
            cwd=include,
            check=True,
            timeout=120,
        )
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            shutil.copyfile(generated / _PACKAGE_PATH / name, out / name)
            written.append(out / name)
        return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(path)
