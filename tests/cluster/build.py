"""Build the control-plane tier's binaries from the Go module proxy, once per pin.

``python3 tests/cluster/build.py`` prints the directory holding ``etcd``, ``fakecri``,
``kube-apiserver``, ``kube-controller-manager``, ``kube-scheduler`` and ``kubelet``, building
them first when they are missing. They are kept under ``$FLEXHUB_CI_CACHE/cluster/<key>/``
(``/var/cache/flexhub-ci`` by default) or, without that cache, ``tests/cluster/bin/<key>/``
(git-ignored); the key hashes everything the build reads from this directory (``go.mod``,
``go.sum``, the two mains, the flags), so a new pin builds anew and an unchanged one never does.
One build at a time: a second caller waits on the lock and then finds the result.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script by .ci/run

from tests.gobuild import cached_build, go

HERE = Path(__file__).resolve().parent
#: The one pin: the Kubernetes release every binary is built from (its staging modules are
#: v0.<minor>.<patch>, replaced in go.mod). etcd is the server go.mod's requirement of it.
KUBERNETES_VERSION = "v1.37.2"
BINARIES = (
    "etcd",
    "fakecri",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
)
PACKAGES = (
    "./cmd/etcd",
    "./cmd/fakecri",
    "k8s.io/kubernetes/cmd/kube-apiserver",
    "k8s.io/kubernetes/cmd/kube-controller-manager",
    "k8s.io/kubernetes/cmd/kube-scheduler",
    "k8s.io/kubernetes/cmd/kubelet",
)
#: Bound for a cold build: module download and about 20 minutes of compiling on 2 cores.
BUILD_TIMEOUT = 3600


def _ldflags() -> str:
    major, minor = KUBERNETES_VERSION.lstrip("v").split(".")[:2]
    flags = ["-s", "-w"]
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        for key, value in (
            ("gitVersion", KUBERNETES_VERSION),
            ("gitMajor", major),
            ("gitMinor", minor),
            ("gitTreeState", "clean"),
            ("buildDate", "1970-01-01T00:00:00Z"),
        ):
            flags.append(f"-X {package}.{key}={value}")
    return " ".join(flags)


def build_key() -> str:
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "cmd/etcd/main.go", "cmd/fakecri/main.go"):
        digest.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    digest.update(_ldflags().encode() + " ".join(PACKAGES).encode())
    return f"{KUBERNETES_VERSION}-{digest.hexdigest()[:12]}"


def bin_dir() -> Path:
    cache = os.environ.get("FLEXHUB_CI_CACHE")
    base = Path(cache) / "cluster" if cache else HERE / "bin"
    return base / build_key()


def complete(directory: Path) -> bool:
    return (directory / ".complete").exists() and all(
        (directory / name).is_file() for name in BINARIES
    )


def build(log: Path | None = None) -> Path:
    """Return the directory of the binaries, building them first if needed."""

    def make(partial: Path) -> None:
        env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-buildvcs=false"}
        go(["build", "-trimpath", f"-ldflags={_ldflags()}", "-o", f"{partial}/", *PACKAGES],
           cwd=HERE, env=env, timeout=BUILD_TIMEOUT, log=log)  # fmt: skip

    return cached_build(bin_dir(), complete, make)


if __name__ == "__main__":
    print(build())
