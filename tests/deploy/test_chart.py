"""What a newcomer to the chart (deploy/helm/flexhub) relies on: helm refuses a mistyped or
mistyped-shape value (values.schema.json) and accepts every value values.yaml documents,
NOTES.txt says what was installed and what to check, and the chart README's values table is
the one values.yaml's comments give (deploy/values_table.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "deploy"))
import render_manifest  # type: ignore[import-not-found]
import values_table  # type: ignore[import-not-found]

CHART = render_manifest.CHART
SCHEMA = CHART / "values.schema.json"


@pytest.fixture(scope="module")
def helm() -> Iterator[Path]:
    """The pinned helm (tests/deploy/test_helm.py builds it the same way)."""
    if shutil.which("go") is None and not render_manifest.helm_binary(build=False).is_file():
        pytest.skip("helm is built with Go, which is not installed (.ci/install-system.sh)")
    yield render_manifest.helm_binary()


def template(
    helm: Path,
    *sets: str,
    values: Path | None = None,
    chart: Path = CHART,
    kube_version: str = render_manifest.KUBE_VERSION,
) -> subprocess.CompletedProcess[str]:
    argv = [str(helm), "template", "flexhub", str(chart), "-n", render_manifest.NAMESPACE]
    argv += ["--kube-version", kube_version]
    if values is not None:
        argv += ["-f", str(values)]
    for value in sets:
        argv += ["--set", value]
    return subprocess.run(argv, capture_output=True, text=True, check=False)


@pytest.mark.parametrize(
    ("value", "refused"),
    [
        ("provisoner.enabled=true", "additional properties 'provisoner' not allowed"),
        ("plugindir=/x", "additional properties 'plugindir' not allowed"),
        ("nodeAgent.enable=true", "additional properties 'enable' not allowed"),
        ("provisioner.serviceAcount.create=false", "'serviceAcount' not allowed"),
        ("storageClasses[0].name=a,storageClasses[0].parameter.backend=nfs", "'parameter'"),
        ("nodeAgent.enabled=yes", "/nodeAgent/enabled"),
        ("provisioner.logLevel=verbose", "/provisioner/logLevel"),
        ("nodeConfig.log_level=debug", "at '/nodeConfig': got object, want string"),
        ("runtimeDir=relative/dir", "/runtimeDir"),
    ],
)
def test_a_mistyped_value_is_refused_by_helm(helm: Path, value: str, refused: str) -> None:
    proc = template(helm, value)
    assert proc.returncode != 0, f"{value} rendered"
    assert "don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert refused in proc.stderr, proc.stderr


def test_every_value_values_yaml_documents_is_accepted(helm: Path, tmp_path: Path) -> None:
    """values.yaml itself, with its documented storageClasses example, every switch turned
    on and each nodeAgent.enabled choice: helm renders them all."""
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    (example,) = [e for e in values_table._entries(text) if e.path == ("storageClasses",)]
    values.update(yaml.safe_load("\n".join(line[2:] for line in example.example)))
    values["provisioner"].update(enabled=True, image={"repository": "mounts", "tag": 1.2})
    values["namespace"]["create"] = True
    values["imagePullSecrets"] = [{"name": "registry"}]
    values["pluginDir"] = "/var/lib/kubelet/volumeplugins"
    values["admissionPolicies"].update(enabled=True, inlineAllowedBackends=["cifs"])
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump(values))
    for choice in ("auto", "true", "false"):
        proc = template(helm, f"nodeAgent.enabled={choice}", values=path)
        assert proc.returncode == 0, proc.stderr
    kinds = {doc["kind"] for doc in yaml.safe_load_all(proc.stdout) if doc}
    assert {"Namespace", "Deployment", "StorageClass", "DaemonSet"} <= kinds


def _objects(node: dict[str, Any], where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if "properties" in node:
        yield where, node
        for key, child in node["properties"].items():
            yield from _objects(child, f"{where}.{key}")
    for key, child in node.get("definitions", {}).items():
        yield from _objects(child, f"#{key}")
    if isinstance(node.get("items"), dict):
        yield from _objects(node["items"], f"{where}[]")


def test_the_schema_closes_every_object_the_chart_owns() -> None:
    """Every object whose keys the schema lists refuses other keys (the mistyped ones), and
    every key of values.yaml is one the schema knows."""
    schema = json.loads(SCHEMA.read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    owned = list(_objects(schema))
    assert len(owned) > 10
    assert [where for where, node in owned if node.get("additionalProperties") is not False] == []
    for entry in values_table._entries((CHART / "values.yaml").read_text()):
        node: dict[str, Any] = schema
        for key in entry.path:
            if "$ref" in node or "properties" not in node:
                break  # inside a free Kubernetes object (resources, nodeSelector)
            assert key in node["properties"], f"{'.'.join(entry.path)} is not in the schema"
            node = node["properties"][key]


def notes(helm: Path, tmp_path: Path, *sets: str, kube_version: str = "1.34.0") -> str:
    """NOTES.txt as `helm install` prints it (helm template renders no notes, and a client
    dry-run still wants a cluster): the chart copied, its notes rendered through `tpl` into
    a ConfigMap."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "files" / "notes.txt").write_text((chart / "templates" / "NOTES.txt").read_text())
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ tpl (.Files.Get "files/notes.txt") . | toJson }}}\n'
    )
    proc = template(helm, *sets, chart=chart, kube_version=kube_version)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    (text,) = [d["data"]["notes"] for d in docs if d["metadata"]["name"] == "notes"]
    return str(text)


def test_the_notes_say_what_was_installed_and_how_to_check(helm: Path, tmp_path: Path) -> None:
    text = notes(helm, tmp_path)
    assert "DaemonSet flexhub" in text
    assert "kubectl -n flexhub-system get pods" in text
    assert "flexhub doctor" in text
    assert "provisioner" not in text.split("Installed")[1].split("\n\n")[0]
    assert "pod-security.kubernetes.io/enforce=privileged" in text  # the namespace is Helm's
    text = notes(
        helm,
        tmp_path / "classes",
        "provisioner.enabled=true",
        "storageClasses[0].name=local,storageClasses[0].parameters.backend=loopfile",
        "storageClasses[1].name=team,storageClasses[1].parameters.backend=nfs",
    )
    assert "Deployment flexhub-provisioner" in text
    assert "StorageClasses: local (loopfile), team (nfs)" in text
    assert "node agent" in text
    assert "mount.nfs" in text  # the default image has no mount tools: a warning
    assert "WARNING" in text


def test_the_notes_warn_of_what_the_values_imply(helm: Path, tmp_path: Path) -> None:
    idle = notes(helm, tmp_path / "a", "provisioner.enabled=true")
    assert "WARNING: provisioner.enabled with no storageClasses" in idle
    orphan = notes(helm, tmp_path / "b", "storageClasses[0].name=x")
    assert "WARNING: storageClasses without provisioner.enabled" in orphan
    bare = notes(helm, tmp_path / "c", "nodeAgent.enabled=true", "nodeAgent.admissionPolicy=false")
    assert "WARNING: the node agent's token" in bare
    made = notes(helm, tmp_path / "d", "namespace.create=true")
    assert "pod-security.kubernetes.io/enforce" not in made  # the chart's namespace has it


def test_the_chart_readme_values_table_is_values_yaml_s() -> None:
    assert values_table.main(["--check"]) == 0, "run python3 deploy/values_table.py"
    readme = values_table.README.read_text()
    assert "| `provisioner.enabled` | `false` |" in readme
    assert '| `nodeAgent.enabled` | `"auto"` | auto, true or false (above) |' in readme


def test_a_changed_comment_makes_the_table_stale(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    original = (CHART / "values.yaml").read_text()
    values.write_text(original.replace("# Always, IfNotPresent or Never", "# changed"))
    table = values_table.values_table(values, SCHEMA)
    assert '| `image.pullPolicy` | `"IfNotPresent"` | changed |' in table
    assert table != values_table.values_table()
    # a table for any page (the docs site): every key of values.yaml is a row or a group's
    lines = values_table.values_table().splitlines()
    rows = {line.split("`")[1] for line in lines if line.startswith("| `")}
    assert {"image.tag", "provisioner.image.tag", "storageClasses", "nodeConfig"} <= rows


def test_any_helm_3_renders_the_defaults_without_kube_version(helm: Path) -> None:
    """A helm built from source (like this one) or an older release assumes Kubernetes 1.20
    when it has no cluster: `helm template` must not need --kube-version for the defaults."""
    argv = [str(helm), "template", "flexhub", str(CHART), "-n", render_manifest.NAMESPACE]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == template(helm).stdout  # the same manifest as for a recent cluster


def test_the_notes_warn_of_a_kubernetes_older_than_the_tested_one(
    helm: Path, tmp_path: Path
) -> None:
    old = notes(helm, tmp_path / "old", kube_version="1.25.3")
    assert "WARNING: Kubernetes v1.25.3 is older than 1.26" in old
    assert "WARNING: Kubernetes" not in notes(helm, tmp_path / "new")
