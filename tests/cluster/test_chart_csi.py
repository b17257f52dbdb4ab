"""The chart's CSI mode on a real API server: the CSIDriver and the accounts and RBAC
(installed by tests/cluster/accounts.py, as the CSI tier's processes run with them), the
StorageClasses and the workloads (server-side dry run) all accepted with strict field
validation; each CSI account may do exactly what the rendered chart grants it, asked of the
API server's own authorizer, and the node plugin's account only write Events."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.cluster.accounts import NAMESPACE, Accounts, client_of, mint_token, render, username
from tests.cluster.cluster import Cluster
from tests.cluster.manifests import apply

pytestmark = [pytest.mark.cluster, pytest.mark.root]

DRIVER = "flexhub.csi.k8s.io"
#: What the render below holds beyond the accounts' objects (tests/cluster/accounts.py).
CLASSES = (
    "csi.storageClasses[0].name=flexhub-csi-probe-loopfile",
    "csi.storageClasses[0].volumeBindingMode=WaitForFirstConsumer",
    "csi.storageClasses[0].parameters.backend=loopfile",
    "csi.storageClasses[1].name=flexhub-csi-probe-nfs",
    "csi.storageClasses[1].parameters.backend=nfs",
    "csi.storageClasses[1].parameters.server=nfs1.example.com",
)
#: (group, resource[/subresource]) the sidecars touch, or that a stolen token would want.
RESOURCES = [
    ("", "persistentvolumes"),
    ("", "persistentvolumeclaims"),
    ("", "persistentvolumeclaims/status"),
    ("", "pods"),
    ("", "nodes"),
    ("", "events"),
    ("", "secrets"),
    ("", "configmaps"),
    ("storage.k8s.io", "storageclasses"),
    ("storage.k8s.io", "csinodes"),
    ("storage.k8s.io", "csidrivers"),
    ("storage.k8s.io", "volumeattachments"),
    ("storage.k8s.io", "csistoragecapacities"),
    ("snapshot.storage.k8s.io", "volumesnapshots"),
    ("snapshot.storage.k8s.io", "volumesnapshotcontents"),
    ("snapshot.storage.k8s.io", "volumesnapshotcontents/status"),
    ("snapshot.storage.k8s.io", "volumesnapshotclasses"),
    ("coordination.k8s.io", "leases"),
    ("apps", "replicasets"),
    ("rbac.authorization.k8s.io", "rolebindings"),
]
CLUSTER_SCOPED = {
    "persistentvolumes",
    "nodes",
    "storageclasses",
    "csinodes",
    "csidrivers",
    "volumeattachments",
    "volumesnapshotcontents",
    "volumesnapshotcontents/status",
    "volumesnapshotclasses",
}
VERBS = ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"]
NAMES = [None, "flexhub-csi-k8s-io", "external-snapshotter-leader-flexhub-csi-k8s-io", "other"]


def granted(
    docs: list[dict[str, Any]], account: str
) -> list[tuple[str, str, set[str], str | None, set[str] | None]]:
    """Each rule the chart's bindings give ``account``: (group, resource, verbs, the
    namespace it holds in or None for all, the names it is limited to or None)."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs}
    found = []
    for binding in docs:
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        if not any(
            s["name"] == account and s["namespace"] == NAMESPACE for s in binding["subjects"]
        ):
            continue
        where = binding["metadata"].get("namespace")
        ref = binding["roleRef"]
        role = roles[(ref["kind"], where if ref["kind"] == "Role" else None, ref["name"])]
        for rule in role["rules"]:
            names = set(rule["resourceNames"]) if rule.get("resourceNames") else None
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    found.append((group, resource, set(rule["verbs"]), where, names))
    return found


def want(
    rules: list[tuple[str, str, set[str], str | None, set[str] | None]],
    group: str,
    resource: str,
    verb: str,
    ns: str,
    name: str | None,
) -> bool:
    return any(
        (g, r) == (group, resource)
        and verb in verbs
        and (where is None or where == ns)
        and (names is None or name in names)
        for g, r, verbs, where, names in rules
    )


def allowed(api: Any, group: str, resource: str, verb: str, ns: str, name: str | None) -> bool:
    resource, _, subresource = resource.partition("/")
    attributes = {"group": group, "resource": resource, "verb": verb, "namespace": ns}
    if subresource:
        attributes["subresource"] = subresource
    if name:
        attributes["name"] = name
    review = client.AuthorizationV1Api(api).create_self_subject_access_review(
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attributes},
        }
    )
    return bool(review.status.allowed)


@pytest.fixture(scope="module")
def csi_apis(cluster: Cluster, accounts: Accounts) -> Iterator[dict[str, Any]]:
    made = {
        "csi-controller": client_of(cluster, mint_token(cluster, "flexhub-csi-controller", 3600)),
        "csi-node": client_of(cluster, mint_token(cluster, "flexhub-csi-node", 3600)),
    }
    yield made
    for api in made.values():
        api.close()


def test_the_csi_render_is_accepted_by_the_api_server_with_strict_validation(
    cluster: Cluster, accounts: Accounts
) -> None:
    """The accounts' objects and the CSIDriver are applied (the accounts fixture); the CSI
    StorageClasses too, and the node DaemonSet, the controller Deployment and the node
    config's ConfigMap as a server-side dry run (every field known, every value valid)."""
    assert f"CSIDriver//{DRIVER}" in accounts.applied
    driver = client.StorageV1Api(cluster.api).read_csi_driver(DRIVER)
    assert driver.spec.attach_required is False and driver.spec.pod_info_on_mount is True
    assert driver.spec.fs_group_policy == "File"
    assert driver.spec.volume_lifecycle_modes == ["Persistent"]
    docs = render(*CLASSES, "csi.registrar.image=example.invalid/registrar:v1")
    classes = [d for d in docs if d["kind"] == "StorageClass"]
    assert [c["metadata"]["name"] for c in classes] == [
        "flexhub-csi-probe-loopfile",
        "flexhub-csi-probe-nfs",
    ]
    storage = client.StorageV1Api(cluster.api)
    try:
        for sc in classes:
            apply(cluster, sc)
            made = storage.read_storage_class(sc["metadata"]["name"])
            assert made.provisioner == DRIVER and made.allow_volume_expansion is True
    finally:
        for sc in classes:
            with contextlib.suppress(ApiException):
                storage.delete_storage_class(sc["metadata"]["name"])
    workloads = [
        d
        for d in docs
        if d["kind"] in ("DaemonSet", "Deployment", "ConfigMap")
        and d["metadata"]["name"].startswith(("flexhub-csi", "flexhub-node-config"))
    ]
    assert sorted(f"{d['kind']}/{d['metadata']['name']}" for d in workloads) == [
        "ConfigMap/flexhub-node-config",
        "DaemonSet/flexhub-csi-node",
        "Deployment/flexhub-csi-controller",
    ]
    for doc in workloads:
        apply(cluster, doc, dry_run=True)  # raises on an unknown field or a refused value
    # and it would: a misplaced field or a propagation mode the API does not know is refused
    (daemonset,) = [d for d in workloads if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    for broken in ({"mountPropagation": "Both"}, {"propagation": "Bidirectional"}):
        wrong = copy.deepcopy(daemonset)
        container = wrong["spec"]["template"]["spec"]["containers"][0]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "kubelet-dir")
        mount.pop("mountPropagation")
        mount.update(broken)
        with pytest.raises(ApiException) as refused:
            apply(cluster, wrong, dry_run=True)
        # an unknown field: server-side apply cannot type the patch (a 500 that says so)
        body = str(refused.value.body)
        assert refused.value.status in (400, 422) or "field not declared in schema" in body, body
    assert pod["containers"][0]["volumeMounts"]  # the original stays as rendered


def test_each_csi_account_may_do_exactly_what_the_chart_grants(
    csi_apis: dict[str, Any],
) -> None:
    """Asked of the API server's authorizer for every verb on every resource above, in the
    release's namespace, `default` and a tenant's, by name and not: the controller's account
    may do exactly what its rendered roles say (Leases by name, in its namespace only), the
    node plugin's create and patch Events (its health watcher's, on pods) and nothing else."""
    docs = render()
    rules = {
        "csi-controller": granted(docs, "flexhub-csi-controller"),
        "csi-node": granted(docs, "flexhub-csi-node"),
    }
    assert rules["csi-node"] == [("", "events", {"create", "patch"}, None, None)]
    assert len(rules["csi-controller"]) > 15
    wrong = []
    allowed_somewhere = set()
    for component, api in csi_apis.items():
        for group, resource in RESOURCES:
            places = [""] if resource in CLUSTER_SCOPED else [NAMESPACE, "default", "team-x"]
            for verb in VERBS:
                for ns in places:
                    for name in NAMES:
                        expected = want(rules[component], group, resource, verb, ns, name)
                        if allowed(api, group, resource, verb, ns, name) != expected:
                            wrong.append((component, group, resource, verb, ns, name, expected))
                        if expected:
                            allowed_somewhere.add((component, resource))
    assert not wrong, "(component, group, resource, verb, namespace, name, should be allowed)"
    # the check is not empty: the controller may do its work
    assert {r for c, r in allowed_somewhere if c == "csi-controller"} >= {
        "persistentvolumes",
        "persistentvolumeclaims/status",
        "volumesnapshotcontents/status",
        "leases",
    }


def test_the_csi_tokens_on_real_requests(cluster: Cluster, csi_apis: dict[str, Any]) -> None:
    """Each token is its account, and real calls go as the chart says: the controller lists
    PVs and reads the CSINodes, never a Secret; the node plugin's token reads nothing (it may
    only write Events)."""
    for component, api in csi_apis.items():
        review = client.AuthenticationV1Api(api).create_self_subject_review(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
        )
        assert review.status.user_info.username == username(component)
    controller = client.CoreV1Api(csi_apis["csi-controller"])
    controller.list_persistent_volume()
    # raw: the client cannot read back a CSINode whose drivers are null (no plugin registered)
    csinodes = client.StorageV1Api(csi_apis["csi-controller"]).list_csi_node(_preload_content=False)
    assert csinodes.status == 200
    node = client.CoreV1Api(csi_apis["csi-node"])
    refused = {}
    for what, call in {
        "controller: Secrets": lambda: controller.list_namespaced_secret(NAMESPACE),
        "node: PVs": lambda: node.list_persistent_volume(),
        "node: its node": lambda: node.list_node(),
        "node: Secrets": lambda: node.list_namespaced_secret(NAMESPACE),
    }.items():
        try:
            call()
            refused[what] = 200
        except ApiException as exc:
            refused[what] = exc.status
    assert refused == dict.fromkeys(refused, 403)


def test_no_account_of_the_chart_may_write_a_configmap_in_its_namespace(
    cluster: Cluster, accounts: Accounts, csi_apis: dict[str, Any]
) -> None:
    """The CSI controller trusts the records of converted volumes (ConfigMaps of flexhub's
    namespace, flexhub/csi/adopted.py) because only administrators may write them there: no
    account of the chart, FlexVolume's or CSI's, may create, update or patch one; the CSI
    controller's may get and delete them, nothing else (no list, no other namespace)."""
    apis = {
        **csi_apis,
        "node-agent": client_of(cluster, mint_token(cluster, "flexhub", 600)),
        "provisioner": client_of(cluster, mint_token(cluster, "flexhub-provisioner", 600)),
    }
    found = {}
    try:
        for component, api in apis.items():
            for verb in ("create", "update", "patch", "get", "delete", "list"):
                for ns in (NAMESPACE, "default"):
                    if allowed(api, "", "configmaps", verb, ns, "flexhub-volume-x"):
                        found.setdefault(component, []).append(f"{verb} in {ns}")
    finally:
        for component in ("node-agent", "provisioner"):
            apis[component].close()
    assert found == {"csi-controller": [f"get in {NAMESPACE}", f"delete in {NAMESPACE}"]}
