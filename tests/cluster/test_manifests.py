"""Scenario 9: every manifest flexhub ships is accepted by the real API server.

Server-side apply with a dry run and strict field validation: a misspelt field, a value of
the wrong type or an object the schema rejects fails here, as ``kubectl apply
--server-side --dry-run=server`` would fail for an operator. Namespaces are created for real
first (a dry-run Namespace does not exist for the objects inside it)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from tests.cluster.cluster import Cluster
from tests.cluster.manifests import apply, documents
from tests.conftest import REPO

pytestmark = [pytest.mark.cluster]
DEPLOY = REPO / "deploy"


def _apply_all(cluster: Cluster, docs: list[dict[str, Any]], source: str) -> int:
    for doc in docs:
        if doc["kind"] == "Namespace":
            apply(cluster, doc)
    count = 0
    for doc in docs:
        try:
            apply(cluster, doc, dry_run=True)
        except ApiException as exc:
            pytest.fail(
                f"{source}: {doc['kind']}/{doc['metadata'].get('name')} refused: "
                f"{exc.status} {exc.body}",
                pytrace=False,
            )
        count += 1
    return count


def _manifest_files() -> list[Path]:
    files = sorted(DEPLOY.glob("*.yaml")) + sorted((DEPLOY / "kubernetes").glob("*.yaml"))
    files += sorted((DEPLOY / "examples").glob("*.yaml"))
    return files


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_is_accepted(cluster: Cluster, path: Path) -> None:
    assert _apply_all(cluster, documents(path.read_text()), path.name) > 0


def test_the_rendered_chart_is_accepted(cluster: Cluster) -> None:
    sys.path.insert(0, str(DEPLOY))
    try:
        import render_manifest
    finally:
        sys.path.remove(str(DEPLOY))
    helm = render_manifest.helm_binary()
    for values in (
        (),
        ("namespace.create=true", "serviceAccount.create=true"),
        ("namespace.create=true", "provisioner.enabled=true"),
        # a loopfile class: the node agent too, its Roles and its admission policy
        (
            "namespace.create=true",
            "provisioner.enabled=true",
            "storageClasses[0].name=local",
            "storageClasses[0].parameters.backend=loopfile",
            "storageClasses[0].volumeBindingMode=WaitForFirstConsumer",
        ),
    ):
        docs = documents(render_manifest.render(helm, *values))
        assert _apply_all(cluster, docs, f"chart {values}") > 0


def test_a_broken_manifest_is_refused(cluster: Cluster) -> None:
    """The check above can fail: a DaemonSet with a misspelt field is refused."""
    docs = documents((DEPLOY / "kubernetes" / "flexhub.yaml").read_text())
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    for doc in docs:
        if doc["kind"] == "Namespace":
            apply(cluster, doc)
    daemonset["spec"]["template"]["spec"]["containerz"] = daemonset["spec"]["template"]["spec"].pop(
        "containers"
    )
    with pytest.raises(ApiException) as caught:
        apply(cluster, daemonset, dry_run=True)
    assert "containerz" in str(caught.value.body)
