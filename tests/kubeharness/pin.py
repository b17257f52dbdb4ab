"""Pin the Go harness to one Kubernetes release: ``python3 tests/kubeharness/pin.py [1.34.4]``.

The release is the one constant in ``KUBERNETES_VERSION``. This script (optionally writes a
new one there, then) rewrites ``go.mod``: ``require k8s.io/kubernetes v<release>`` and a
``replace`` for every staging module that release's own go.mod replaces with
``./staging/...``, at the matching ``v0.<minor>.<patch>``; then ``go mod tidy``. Without
those replaces ``go mod tidy`` fails with "unknown revision v0.0.0".
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VERSION_FILE = HERE / "KUBERNETES_VERSION"
MODULE = "flexhub.test/kubeharness"
GO_LINE = "go 1.25.0"


def staging_modules(release: str) -> list[str]:
    """The modules k8s.io/kubernetes@v<release> replaces with its own staging tree."""
    out = subprocess.run(
        ["go", "mod", "download", "-json", f"k8s.io/kubernetes@v{release}"],
        cwd=HERE,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    gomod = Path(json.loads(out)["GoMod"]).read_text()
    return sorted(set(re.findall(r"^\s*(k8s\.io/[\w.-]+) => \./staging/", gomod, re.M)))


def render(release: str, modules: list[str]) -> str:
    staging = "v0." + release.split(".", 1)[1]
    lines = [
        f"module {MODULE}",
        "",
        GO_LINE,
        "",
        f"require k8s.io/kubernetes v{release}",
        "",
        "// Written by pin.py from KUBERNETES_VERSION: every staging module of",
        "// k8s.io/kubernetes at the matching v0.x tag.",
        "replace (",
        *[f"\t{m} => {m} {staging}" for m in modules],
        ")",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1:
        VERSION_FILE.write_text(sys.argv[1].lstrip("v") + "\n")
    release = VERSION_FILE.read_text().strip()
    (HERE / "go.mod").write_text(render(release, staging_modules(release)))
    subprocess.run(["go", "mod", "tidy"], cwd=HERE, check=True)
    print(f"pinned k8s.io/kubernetes v{release}")


if __name__ == "__main__":
    main()
