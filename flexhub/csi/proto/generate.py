"""Regenerate the stubs of this directory from the pinned protos.

``python3 -m flexhub.csi.proto.generate [OUT_DIR]`` fetches two Go modules through
``go mod download`` (the Go module proxy) and runs ``grpc_tools.protoc`` (the pinned
``grpcio-tools``) on their protos with ``--python_out``, ``--grpc_python_out`` and
``--pyi_out``:

* ``csi.proto`` of ``github.com/container-storage-interface/spec`` at :data:`SPEC_VERSION`;
* ``pkg/apis/pluginregistration/v1/api.proto`` of ``k8s.io/kubelet`` at
  :data:`KUBELET_VERSION` (the kubelet's plugin-registration service, which flexhub serves
  itself: :mod:`flexhub.csi.registration`).

OUT_DIR defaults to this directory; a test generates into a temporary one and compares byte for
byte. The protos themselves are not kept here: the modules are their one source (the stubs
embed their descriptors).

Each proto is compiled as ``flexhub/csi/proto/<name>.proto`` so that the generated
``*_pb2_grpc.py`` imports ``flexhub.csi.proto.<name>_pb2`` (the wire names stay ``csi.v1.*`` and
``pluginregistration.*``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = [
    "GENERATED",
    "KUBELET_MODULE",
    "KUBELET_VERSION",
    "SPEC_MODULE",
    "SPEC_VERSION",
    "generate",
    "module_dir",
    "spec_proto",
]

SPEC_MODULE = "github.com/container-storage-interface/spec"
SPEC_VERSION = "v1.13.0"
#: The kubelet staging module of the control-plane tier's pin (tests/cluster/go.mod).
KUBELET_MODULE = "k8s.io/kubelet"
KUBELET_VERSION = "v0.37.2"
#: Each proto: (module, version, path in the module, the name it is compiled as).
_PROTOS = (
    (SPEC_MODULE, SPEC_VERSION, "csi.proto", "csi"),
    (
        KUBELET_MODULE,
        KUBELET_VERSION,
        "pkg/apis/pluginregistration/v1/api.proto",
        "pluginregistration",
    ),
)
#: The files this script writes (what protoc makes of the protos).
GENERATED = tuple(
    f"{name}{suffix}" for *_, name in _PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
)
HERE = Path(__file__).resolve().parent
_PACKAGE_PATH = Path("flexhub/csi/proto")


def spec_proto(work: Path) -> Path:
    """``csi.proto`` of the pinned spec module, downloaded with ``go mod download``."""
    return module_dir(work, SPEC_MODULE, SPEC_VERSION) / "csi.proto"


def module_dir(work: Path, module: str, version: str) -> Path:
    """The directory of ``module@version`` in the Go module cache (``go mod download``)."""
    proc = subprocess.run(
        ["go", "mod", "download", "-json", f"{module}@{version}"],
        cwd=work,
        env=_go_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"go mod download {module}@{version} failed: {proc.stderr}")
    return Path(json.loads(proc.stdout)["Dir"])


def _go_env() -> dict[str, str]:
    import os

    return {**os.environ, "GOFLAGS": "-mod=mod", "GO111MODULE": "on"}


def generate(out: Path = HERE) -> list[Path]:
    """Write :data:`GENERATED` into ``out``; return their paths."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        include = work / "include"
        (include / _PACKAGE_PATH).mkdir(parents=True)
        generated = work / "out"
        generated.mkdir()
        for module, version, source, name in _PROTOS:
            proto = _PACKAGE_PATH / f"{name}.proto"
            shutil.copyfile(module_dir(work, module, version) / source, include / proto)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "grpc_tools.protoc",
                    f"-I{include}",
                    f"--python_out={generated}",
                    f"--grpc_python_out={generated}",
                    f"--pyi_out={generated}",
                    str(proto),
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
