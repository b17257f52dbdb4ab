"""Pin the Go harness to the control-plane tier's release: ``python3 tests/kubeharness/pin.py``.

The release is the one pin of the repository, ``KUBERNETES_VERSION`` in
``tests/cluster/build.py`` (with ``tests/cluster/go.mod``). This script rewrites the harness's
``go.mod`` from the cluster's: every module the cluster's go.mod requires
(``k8s.io/kubernetes`` at that release among them) at the version it requires (so that the two modules select the same
version of every package they share, and Go's build cache compiles each of them once: a cold
machine otherwise compiled most of Kubernetes twice), and the cluster's ``replace`` of every
staging module at the matching ``v0.<minor>.<patch>`` (without them ``go mod tidy`` fails with
"unknown revision v0.0.0"); then ``go mod tidy``, which drops what the harness does not import.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
CLUSTER = HERE.parent / "cluster"
MODULE = "flexhub.test/kubeharness"


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
    lines = [
        f"module {MODULE}",
        "",
        go_line.group(0),
        "",
        "// Written by pin.py from tests/cluster/go.mod: its versions of every module both",
        "// import, and every staging module of k8s.io/kubernetes at the matching v0.x tag.",
        "require (",
        *[f"\t{r}" for r in _block(cluster_gomod, "require")],
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
    pinned = re.search(r"^\s*k8s\.io/kubernetes (\S+)", (HERE / "go.mod").read_text(), re.M)
    print(f"pinned k8s.io/kubernetes {pinned and pinned.group(1)} (the control-plane tier's pin)")


if __name__ == "__main__":
    main()
