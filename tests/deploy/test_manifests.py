"""The shipped manifests parse, the DaemonSet matches the image the repo builds, and the
example PVs pass `flexhub validate`."""

from __future__ import annotations

import subprocess
import sys

import yaml

from tests.conftest import PYTHON, REPO

sys.path.insert(0, str(REPO / "deploy"))
import build_image  # type: ignore[import-not-found]

DEPLOY = REPO / "deploy"


def test_daemonset_matches_the_image_and_reaches_every_node() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "flexhub.yaml").read_text()))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Namespace", "ServiceAccount", "ConfigMap", "DaemonSet"]
    pod = docs[3]["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert {"operator": "Exists"} in pod["tolerations"]
    (container,) = pod["containers"]
    assert container["securityContext"]["privileged"] is True
    assert container["resources"]["requests"]
    probe = container["livenessProbe"]["exec"]["command"]
    assert probe[: len(build_image.ENTRYPOINT)] == build_image.ENTRYPOINT
    assert probe[len(build_image.ENTRYPOINT) :][:3] == ["doctor", "--probe", "--host-root"]
    # the host's unmounts of staged volumes must reach the pod's copy of the host's /
    host = {"name": "host", "mountPath": "/host", "mountPropagation": "HostToContainer"}
    assert host in container["volumeMounts"]
    assert {"name": "host", "hostPath": {"path": "/", "type": "Directory"}} in pod["volumes"]


def test_example_pvs_validate() -> None:
    for example in sorted((DEPLOY / "examples").glob("*.yaml")):
        proc = subprocess.run(
            [PYTHON, "-m", "flexhub", "validate", str(example)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, (example.name, proc.stdout, proc.stderr)
