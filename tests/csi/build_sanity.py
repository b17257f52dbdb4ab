"""Build ``csi-sanity`` (kubernetes-csi's conformance suite) from the Go module proxy, once per pin.

``python3 tests/csi/build_sanity.py`` prints the path of the binary, building it first when it
is missing. It is kept under ``$FLEXHUB_CI_CACHE/csi-sanity/<version>/`` (``tests/csi/bin/``,
git-ignored, without that cache), keyed by the pinned version: a new pin builds anew, an unchanged
one never does. One build at a time: a second caller waits on the lock and then finds the result.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULE = "github.com/kubernetes-csi/csi-test/v5"
#: The pin (it requires the CSI spec v1.13.0 that flexhub/csi/proto is generated from).
VERSION = "v5.6.0"
#: Bound for a cold build: about 5 minutes of module download and compiling on a loaded host.
BUILD_TIMEOUT = 1800


def bin_dir() -> Path:
    cache = os.environ.get("FLEXHUB_CI_CACHE")
    base = Path(cache) / "csi-sanity" if cache else HERE / "bin"
    return base / VERSION


def binary() -> Path:
    return bin_dir() / "csi-sanity"


def complete(directory: Path) -> bool:
    return (directory / ".complete").exists() and (directory / "csi-sanity").is_file()


def build(log: Path | None = None) -> Path:
    """Return the path of the csi-sanity binary, building it first if needed."""
    target = bin_dir()
    if complete(target):
        return target / "csi-sanity"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if complete(target):
            return target / "csi-sanity"
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        env = {
            **os.environ,
            "CGO_ENABLED": "0",
            "GOFLAGS": "-mod=mod -buildvcs=false",
            "GOBIN": str(partial),
        }
        started = time.monotonic()
        out = open(log, "w") if log else None  # noqa: SIM115 - closed below
        try:
            subprocess.run(
                ["go", "install", "-trimpath", f"{MODULE}/cmd/csi-sanity@{VERSION}"],
                cwd=partial,
                env=env,
                check=True,
                timeout=BUILD_TIMEOUT,
                stdout=out or sys.stderr,
                stderr=subprocess.STDOUT,
            )
        finally:
            if out:
                out.close()
        (partial / ".complete").write_text(f"built in {time.monotonic() - started:.0f} s\n")
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    # Older versions go.
    for old in target.parent.iterdir():
        if old.is_dir() and old != target and not old.name.endswith(".partial"):
            shutil.rmtree(old, ignore_errors=True)
    return target / "csi-sanity"


if __name__ == "__main__":
    print(build())
