"""Pin the Go harness to the control-plane tier's release: ``python3 tests/kubeharness/pin.py``.

The release is the one pin of the repository, ``KUBERNETES_VERSION`` in
``tests/cluster/build.py`` (with ``tests/cluster/go.mod``). This script rewrites the harness's
``go.mod`` from the cluster's: ``require k8s.io/kubernetes`` at that release, every module the
cluster's go.mod requires at the version it requires (so that the two modules select the same
version of every package they share, and Go's build cache compiles each of them once: a cold
machine otherwise compiled most of Kubernetes twice), and the cluster's ``replace`` of every
staging module at the matching ``v0.<minor>.<patch>`` (without them ``go mod tidy`` fails with
"unknown revision v0.0.0"); then ``go mod tidy``, which drops what the harness does not import.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CLUSTER = HERE.parent / "cluster"
MODULE = "flexhub.test/kubeharness"

sys.path.insert(0, str(CLUSTER))
from build import KUBERNETES_VERSION  # noqa: E402


def _block(gomod: str, keyword: str) -> list[str]:
    """The lines of every ``keyword ( ... )`` block of ``gomod``, without comments."""
    lines: list[str] = []
    for body in re.findall(rf"^{keyword} \((.*?)^\)", gomod, re.M | re.S):
        for line in body.splitlines():
            line = line.split("//", 1)[0].strip()
            if line:
                lines.append(line)
    return lines


def render(cluster_gomod: str) -> str:
    go_line = re.search(r"^go \S+$", cluster_gomod, re.M)
    assert go_line, "tests/cluster/go.mod has no go line"
    requires = [
        r for r in _block(cluster_gomod, "require") if not r.startswith("k8s.io/kubernetes ")
    ]
    lines = [
        f"module {MODULE}",
        "",
        go_line.group(0),
        "",
        f"require k8s.io/kubernetes {KUBERNETES_VERSION}",
        "",
        "// Written by pin.py from tests/cluster/go.mod: its versions of every module both",
        "// import, and every staging module of k8s.io/kubernetes at the matching v0.x tag.",
        "require (",
        *[f"\t{r}" for r in requires],
        ")",
        "",
        "replace (",
        *[f"\t{r}" for r in _block(cluster_gomod, "replace")],
        ")",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    (HERE / "go.mod").write_text(render((CLUSTER / "go.mod").read_text()))
    subprocess.run(["go", "mod", "tidy"], cwd=HERE, check=True)
    print(f"pinned k8s.io/kubernetes {KUBERNETES_VERSION} (the control-plane tier's pin)")


if __name__ == "__main__":
    main()
