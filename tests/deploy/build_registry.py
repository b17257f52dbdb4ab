"""Build CNCF distribution's ``registry`` (an OCI registry server) from the Go module proxy.

``python3 tests/deploy/build_registry.py`` prints the path of the binary, building it first
when it is missing (:mod:`tests.gobuild`: cached under ``$FLEXHUB_CI_CACHE/registry/<version>/``).
The release test pushes flexhub's image and chart to it on 127.0.0.1.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gobuild import GoProgram

PROGRAM = GoProgram(
    "registry", "github.com/distribution/distribution/v3", "v3.1.2", ["cmd/registry"]
)


def build(log: Path | None = None) -> Path:
    return PROGRAM.build(log) / "registry"


if __name__ == "__main__":
    print(build())
