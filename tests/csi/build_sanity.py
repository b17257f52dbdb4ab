"""Build ``csi-sanity`` (kubernetes-csi's conformance suite) from the Go module proxy, once per pin.

``python3 tests/csi/build_sanity.py`` prints the path of the binary, building it first when it
is missing. It is kept under ``$FLEXHUB_CI_CACHE/csi-sanity/<version>/`` (``tests/csi-sanity-bin/``,
git-ignored, without that cache), keyed by the pinned version (:mod:`tests.gobuild`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gobuild import GoProgram

MODULE = "github.com/kubernetes-csi/csi-test/v5"
#: The pin (it requires the CSI spec v1.13.0 that flexhub/csi/proto is generated from).
VERSION = "v5.6.0"
#: About 5 minutes of module download and compiling on a loaded host.
PROGRAM = GoProgram("csi-sanity", MODULE, VERSION, ["cmd/csi-sanity"])


def bin_dir() -> Path:
    return PROGRAM.bin_dir()


def complete(directory: Path) -> bool:
    return PROGRAM.complete(directory)


def build(log: Path | None = None) -> Path:
    """Return the path of the csi-sanity binary, building it first if needed."""
    return PROGRAM.build(log) / "csi-sanity"


if __name__ == "__main__":
    print(build())
