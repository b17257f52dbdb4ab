"""Write the plain manifest (``deploy/kubernetes/flexhub.yaml``) from the Helm chart.

    python3 deploy/render_manifest.py            # rewrite it
    python3 deploy/render_manifest.py --check    # exit 1 if it differs from the chart

The plain manifest is the chart rendered with its defaults, release ``flexhub`` in namespace
``flexhub-system``, the namespace created and labelled for privileged pods: one source, so the
two cannot drift (``tests/deploy/test_helm.py`` runs ``--check``).

It needs ``helm``: ``--helm PATH``, ``$FLEXHUB_HELM``, or the pinned build that
:func:`helm_binary` makes with ``go install`` into ``/var/cache/flexhub-ci`` (a few minutes on
a fresh machine, then reused).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "flexhub"
MANIFEST = REPO / "deploy" / "kubernetes" / "flexhub.yaml"
#: The helm release the chart is tested and rendered with (its Go module, built here).
HELM_VERSION = "v3.22.0"
CACHE = Path(os.environ.get("FLEXHUB_CI_CACHE") or "/var/cache/flexhub-ci")
RELEASE, NAMESPACE = "flexhub", "flexhub-system"
#: The cluster version rendered for (a helm built by ``go install`` assumes 1.20, below the
#: 1.30 the opt-in admission policies need; the defaults render the same either way).
KUBE_VERSION = "1.34.0"
HEADER = """\
# flexhub on every node, as plain manifests: GENERATED from the Helm chart
# (deploy/helm/flexhub) by `python3 deploy/render_manifest.py`; do not edit, change the chart.
# `kubectl apply -f` this file, or `helm install flexhub deploy/helm/flexhub -n flexhub-system`.
# Deleting the DaemonSet leaves the driver installed (kubelet still needs it to unmount); see
# the README, "Deploying to a cluster".
"""


def helm_binary(build: bool = True) -> Path:
    """The pinned ``helm``: ``$FLEXHUB_HELM``, else the cached build (made if ``build``)."""
    given = os.environ.get("FLEXHUB_HELM")
    if given:
        return Path(given)
    binary = CACHE / f"helm-{HELM_VERSION}" / "helm"
    if binary.is_file() or not build:
        return binary
    if shutil.which("go") is None:
        sys.exit("render_manifest: helm is built with Go, which is not installed")
    binary.parent.mkdir(parents=True, exist_ok=True)
    import fcntl

    # one build at a time (CI starts one in the background; a test may ask meanwhile)
    with open(binary.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.is_file():
            env = {**os.environ, "GOBIN": str(binary.parent), "CGO_ENABLED": "0"}
            subprocess.run(
                ["go", "install", f"helm.sh/helm/v3/cmd/helm@{HELM_VERSION}"],
                env=env,
                check=True,
            )
    return binary


def render(helm: Path, *values: str) -> str:
    """``helm template`` of the chart, with ``--set`` ``values``."""
    argv = [str(helm), "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    argv += ["--kube-version", KUBE_VERSION]
    for value in values:
        argv += ["--set", value]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"render_manifest: helm template failed: {proc.stderr.strip()}")
    return proc.stdout


def plain_manifest(helm: Path) -> str:
    """The text the plain manifest must have."""
    body = render(helm, "namespace.create=true")
    lines = [line for line in body.splitlines() if not line.startswith("# Source: ")]
    return HEADER + "\n".join(lines).lstrip("-\n").rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare")
    parser.add_argument("--helm", type=Path, help="the helm binary (default: pinned build)")
    args = parser.parse_args(argv)
    text = plain_manifest(args.helm or helm_binary())
    if args.check:
        if MANIFEST.read_text() != text:
            print(f"{MANIFEST} differs from the chart: run deploy/render_manifest.py")
            return 1
        return 0
    MANIFEST.write_text(text)
    print(MANIFEST)
    return 0


if __name__ == "__main__":
    sys.exit(main())
