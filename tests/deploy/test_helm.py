"""The Helm chart (deploy/helm/flexhub) renders with the pinned helm, carries every value an
operator sets to where it belongs, agrees on one version with flexhub, and is the source of
the plain manifest (which therefore cannot drift from it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import flexhub
from flexhub.config import load_config
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "deploy"))
import render_manifest  # type: ignore[import-not-found]

CHART = render_manifest.CHART


@pytest.fixture(scope="module")
def helm() -> Iterator[Path]:
    """The pinned helm (built from its Go module once per machine: several minutes cold)."""
    if shutil.which("go") is None and not render_manifest.helm_binary(build=False).is_file():
        pytest.skip("helm is built with Go, which is not installed (.ci/install-system.sh)")
    yield render_manifest.helm_binary()


def render(helm: Path, *values: str) -> dict[str, dict[str, Any]]:
    docs = yaml.safe_load_all(render_manifest.render(helm, *values))
    return {doc["kind"]: doc for doc in docs if doc}


def pod_of(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = docs["DaemonSet"]["spec"]["template"]["spec"]
    return spec


def test_the_chart_lints(helm: Path) -> None:
    proc = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_defaults_reach_every_linux_amd64_node_with_the_node_config(helm: Path) -> None:
    docs = render(helm)
    assert sorted(docs) == ["ConfigMap", "DaemonSet", "ServiceAccount"]  # namespace: Helm's
    pod = pod_of(docs)
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
    assert {"operator": "Exists"} in pod["tolerations"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["hostPID"] is True and pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert container["image"] == f"flexhub:{flexhub.__version__}"
    assert container["imagePullPolicy"] == "IfNotPresent"
    args = container["args"]
    assert args[args.index("--config-from") + 1] == "/etc/flexhub-node-config/flexhub.toml"
    assert args[args.index("--config") + 1] == "/etc/flexhub/flexhub.toml"
    assert "--plugin-dir" not in args  # detected on each node
    host = next(m for m in container["volumeMounts"] if m["name"] == "host")
    assert host == {"name": "host", "mountPath": "/host", "mountPropagation": "HostToContainer"}
    config = next(m for m in container["volumeMounts"] if m["name"] == "node-config")
    assert config["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == "node-config")
    assert volume["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    text = docs["ConfigMap"]["data"]["flexhub.toml"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert text == values["nodeConfig"]


def test_the_default_node_config_is_one_flexhub_accepts(helm: Path, tmp_path: Path) -> None:
    text = render(helm)["ConfigMap"]["data"]["flexhub.toml"]
    (tmp_path / "flexhub.toml").write_text(text)
    config = load_config(tmp_path / "flexhub.toml")
    assert str(config.state_dir) == "/var/lib/flexhub"
    assert config.backend_table("loopfile")["root"] == "/var/lib/flexhub/loopfiles"


def test_every_operator_value_lands_where_it_belongs(helm: Path) -> None:
    docs = render(
        helm,
        "pluginDir=/var/lib/kubelet/volumeplugins",
        "image.repository=registry.example/flexhub",
        "image.tag=9.9.9",
        "image.pullPolicy=Always",
        "nodeSelector.pool=storage",
        "tolerations[0].key=dedicated",
        "tolerations[0].operator=Equal",
        "tolerations[0].value=storage",
        "resources.limits.memory=512Mi",
        "priorityClassName=storage-critical",
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].key=zone",
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
        "serviceAccount.create=false",
        "serviceAccount.name=storage-nodes",
        "hostConfigPath=/etc/storage/flexhub.toml",
        "runtimeDir=/opt/flexhub-runtimes",
        'nodeConfig=log_level = "debug"',
    )
    assert "ServiceAccount" not in docs
    pod = pod_of(docs)
    assert pod["serviceAccountName"] == "storage-nodes"
    assert pod["nodeSelector"]["pool"] == "storage"
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "storage"}]
    assert pod["priorityClassName"] == "storage-critical"
    assert "nodeAffinity" in pod["affinity"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.example/flexhub:9.9.9"
    assert container["imagePullPolicy"] == "Always"
    assert container["resources"]["limits"]["memory"] == "512Mi"
    args = container["args"]
    assert args[args.index("--plugin-dir") + 1] == "/var/lib/kubelet/volumeplugins"
    assert args[args.index("--config") + 1] == "/etc/storage/flexhub.toml"
    assert args[args.index("--runtime-dir") + 1] == "/opt/flexhub-runtimes"
    probe = container["livenessProbe"]["exec"]["command"]
    assert probe[probe.index("--config") + 1] == "/etc/storage/flexhub.toml"
    assert docs["ConfigMap"]["data"]["flexhub.toml"].strip() == 'log_level = "debug"'


def test_a_changed_node_config_rolls_the_daemonset(helm: Path) -> None:
    def checksum(*values: str) -> str:
        annotations = render(helm, *values)["DaemonSet"]["spec"]["template"]["metadata"]
        return str(annotations["annotations"]["checksum/node-config"])

    assert checksum() != checksum('nodeConfig=log_level = "debug"')


def test_the_namespace_is_created_labelled_for_privileged_pods_when_asked(helm: Path) -> None:
    docs = render(helm, "namespace.create=true")
    namespace = docs["Namespace"]["metadata"]
    assert namespace["name"] == render_manifest.NAMESPACE
    assert namespace["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_the_daemonset_selector_is_the_one_shipped_before(helm: Path) -> None:
    """A selector is immutable: an older plain manifest's DaemonSet must upgrade in place."""
    selector = render(helm)["DaemonSet"]["spec"]["selector"]
    assert selector == {"matchLabels": {"app.kubernetes.io/name": "flexhub"}}


def test_chart_app_and_flexhub_agree_on_one_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == flexhub.__version__


def test_the_plain_manifest_is_the_chart_rendered(helm: Path) -> None:
    """deploy/kubernetes/flexhub.yaml is generated; an edit of either alone fails here."""
    assert render_manifest.main(["--check", "--helm", str(helm)]) == 0, (
        "run python3 deploy/render_manifest.py"
    )
    docs = list(yaml.safe_load_all(render_manifest.MANIFEST.read_text()))
    assert [d["kind"] for d in docs] == ["Namespace", "ServiceAccount", "ConfigMap", "DaemonSet"]
