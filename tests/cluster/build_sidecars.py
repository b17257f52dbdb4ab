"""Build the kubernetes-csi sidecars of the control-plane tier from the Go module proxy, once per pin.

``python3 tests/cluster/build_sidecars.py`` prints the directory holding ``csi-provisioner``,
``csi-resizer``, ``csi-snapshotter``, ``snapshot-controller`` and the snapshot CRDs
(``crd/*.yaml``), building them first when they are missing. They are kept under
``$FLEXHUB_CI_CACHE/sidecars/<key>/`` or, without that cache, ``tests/cluster/bin/sidecars/<key>/``
(git-ignored); the key hashes ``sidecars/go.mod``, ``sidecars/go.sum`` and the flags, so a new pin
builds anew and an unchanged one never does. One build at a time: a second caller waits on the
lock and then finds the result.

Every sidecar's go.mod has ``replace`` directives, so ``go install module/cmd/x@version`` refuses
them: ``sidecars/go.mod`` requires the pinned releases as ``tool`` packages, with every k8s.io
staging module at the one release they require (v0.33.1). external-snapshotter v8.3.0 replaces its
``client/v8`` module with its own tree, which the proxy does not serve at v8.3.0; its release
notes change nothing in it since client/v8 v8.2.0, the version the other sidecars require, so
that is the client built and the module the CRDs are copied from.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script by .ci/run

from tests.gobuild import cached_build, go

HERE = Path(__file__).resolve().parent
MODULE_DIR = HERE / "sidecars"
#: The pinned releases (sidecars/go.mod requires exactly these).
PROVISIONER = "github.com/kubernetes-csi/external-provisioner/v5@v5.3.0"
RESIZER = "github.com/kubernetes-csi/external-resizer@v1.14.0"
SNAPSHOTTER = "github.com/kubernetes-csi/external-snapshotter/v8@v8.3.0"
SNAPSHOT_CLIENT = "github.com/kubernetes-csi/external-snapshotter/client/v8"
BINARIES = ("csi-provisioner", "csi-resizer", "csi-snapshotter", "snapshot-controller")
PACKAGES = (
    "github.com/kubernetes-csi/external-provisioner/v5/cmd/csi-provisioner",
    "github.com/kubernetes-csi/external-resizer/cmd/csi-resizer",
    "github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter",
    "github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller",
)
#: The snapshot CRDs, from the snapshot client module's config/crd/.
CRDS = (
    "snapshot.storage.k8s.io_volumesnapshotclasses.yaml",
    "snapshot.storage.k8s.io_volumesnapshotcontents.yaml",
    "snapshot.storage.k8s.io_volumesnapshots.yaml",
)
LDFLAGS = "-s -w"
#: Bound for a cold build: module download and about 10 minutes of compiling on 2 loaded cores.
BUILD_TIMEOUT = 2400


def build_key() -> str:
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum"):
        digest.update(name.encode() + b"\0" + (MODULE_DIR / name).read_bytes() + b"\0")
    digest.update(LDFLAGS.encode() + " ".join(PACKAGES).encode() + " ".join(CRDS).encode())
    return digest.hexdigest()[:16]


def bin_dir() -> Path:
    cache = os.environ.get("FLEXHUB_CI_CACHE")
    base = Path(cache) / "sidecars" if cache else HERE / "bin" / "sidecars"
    return base / build_key()


def complete(directory: Path) -> bool:
    return (
        (directory / ".complete").exists()
        and all((directory / name).is_file() for name in BINARIES)
        and all((directory / "crd" / name).is_file() for name in CRDS)
    )


def _module_dir(module: str, env: dict[str, str]) -> Path:
    """Where the Go module cache holds ``module`` at the version go.mod requires."""
    listed = subprocess.run(["go", "list", "-m", "-json", module], cwd=MODULE_DIR, env=env,
                            check=True, timeout=300, capture_output=True, text=True)  # fmt: skip
    return Path(json.loads(listed.stdout)["Dir"])


def build(log: Path | None = None) -> Path:
    """Return the directory of the sidecars and CRDs, building them first if needed."""

    def make(partial: Path) -> None:
        env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=readonly -buildvcs=false"}
        go(["build", "-trimpath", f"-ldflags={LDFLAGS}", "-o", f"{partial}/", *PACKAGES],
           cwd=MODULE_DIR, env=env, timeout=BUILD_TIMEOUT, log=log)  # fmt: skip
        # The build read the client module, so the module cache holds it.
        client = _module_dir(SNAPSHOT_CLIENT, env)
        (partial / "crd").mkdir()
        for name in CRDS:
            shutil.copyfile(client / "config" / "crd" / name, partial / "crd" / name)

    return cached_build(bin_dir(), complete, make)


if __name__ == "__main__":
    print(build())
