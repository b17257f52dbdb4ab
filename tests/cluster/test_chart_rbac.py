"""The chart's RBAC on a real API server: the accounts the provisioner and the node agent run
with (tests/cluster/accounts.py) may make exactly the calls their code makes
(tests/deploy/test_rbac_calls.py derives them from the source), and a token is refused what
the chart does not give it, with real requests as node root holding the agent's token would
make them."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.cluster.accounts import (
    ACCOUNTS,
    FLEXVOLUME,
    NAMESPACE,
    Accounts,
    audited,
    client_of,
    flexhub_pv,
    forbidden,
    mint_token,
    username,
)
from tests.cluster.cluster import Cluster
from tests.cluster.kube import namespace
from tests.deploy.test_rbac_calls import AHEAD, needed

pytestmark = [pytest.mark.cluster, pytest.mark.root]

#: Every (group, resource) either process touches, or that node root would most like to.
RESOURCES = [
    ("", "persistentvolumes"),
    ("", "persistentvolumeclaims"),
    ("", "secrets"),
    ("", "events"),
    ("", "nodes"),
    ("", "pods"),
    ("", "configmaps"),
    ("", "serviceaccounts"),
    ("storage.k8s.io", "storageclasses"),
    ("coordination.k8s.io", "leases"),
    ("rbac.authorization.k8s.io", "rolebindings"),
    ("admissionregistration.k8s.io", "validatingadmissionpolicies"),
]
VERBS = ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"]
CLUSTER_SCOPED = {"persistentvolumes", "nodes", "storageclasses", "validatingadmissionpolicies"}
NAMES = [None, "flexhub-provisioner", "flexhub-provisioner-key"]


@pytest.fixture(scope="module")
def apis(cluster: Cluster, accounts: Accounts) -> Iterator[dict[str, Any]]:
    """An ApiClient of each component, with a fresh token of its chart account."""
    made = {c: client_of(cluster, mint_token(cluster, a, 3600)) for c, a in ACCOUNTS.items()}
    yield made
    for api in made.values():
        api.close()


def allowed(api: Any, group: str, resource: str, verb: str, ns: str, name: str | None) -> bool:
    review = client.AuthorizationV1Api(api).create_self_subject_access_review(
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {
                "resourceAttributes": {
                    "group": group,
                    "resource": resource,
                    "verb": verb,
                    "namespace": ns,
                    **({"name": name} if name else {}),
                }
            },
        }
    )
    return bool(review.status.allowed)


def test_the_chart_rbac_is_applied_and_each_token_is_its_account(
    cluster: Cluster, accounts: Accounts, apis: dict[str, Any]
) -> None:
    assert sorted(accounts.applied) == sorted(
        [
            f"Namespace//{NAMESPACE}",
            f"ServiceAccount/{NAMESPACE}/flexhub",
            f"ServiceAccount/{NAMESPACE}/flexhub-provisioner",
            "ClusterRole//flexhub-node-agent",
            "ClusterRole//flexhub-provisioner",
            "ClusterRoleBinding//flexhub-node-agent",
            "ClusterRoleBinding//flexhub-provisioner",
            f"Role/{NAMESPACE}/flexhub-provisioner",
            "Role/default/flexhub-node-agent-events",
            f"RoleBinding/{NAMESPACE}/flexhub-provisioner",
            "RoleBinding/default/flexhub-node-agent-events",
            "ValidatingAdmissionPolicy//flexhub-node-agent",
            "ValidatingAdmissionPolicyBinding//flexhub-node-agent",
            # CSI mode (tests/cluster/test_chart_csi.py)
            f"ServiceAccount/{NAMESPACE}/flexhub-csi-controller",
            f"ServiceAccount/{NAMESPACE}/flexhub-csi-node",
            "ClusterRole//flexhub-csi-node-events",
            "ClusterRoleBinding//flexhub-csi-node-events",
            "ClusterRole//flexhub-csi-controller-provisioner",
            "ClusterRole//flexhub-csi-controller-resizer",
            "ClusterRole//flexhub-csi-controller-snapshotter",
            "ClusterRoleBinding//flexhub-csi-controller-provisioner",
            "ClusterRoleBinding//flexhub-csi-controller-resizer",
            "ClusterRoleBinding//flexhub-csi-controller-snapshotter",
            f"Role/{NAMESPACE}/flexhub-csi-controller-leader-election",
            f"RoleBinding/{NAMESPACE}/flexhub-csi-controller-leader-election",
            f"Role/{NAMESPACE}/flexhub-csi-controller-converted-volumes",
            f"RoleBinding/{NAMESPACE}/flexhub-csi-controller-converted-volumes",
            "CSIDriver//flexhub.csi.k8s.io",
        ]
    )
    for component, api in apis.items():
        review = client.AuthenticationV1Api(api).create_self_subject_review(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
        )
        assert review.status.user_info.username == username(component)
    # the API server enforces RBAC: an account with no binding may do nothing of this
    cluster.core.create_namespaced_service_account(NAMESPACE, {"metadata": {"name": "nobody"}})
    try:
        nobody = client_of(cluster, mint_token(cluster, "nobody", 600))
        assert not allowed(nobody, "", "persistentvolumes", "list", "", None)
        with pytest.raises(ApiException) as refused:
            client.CoreV1Api(nobody).list_persistent_volume()
        assert refused.value.status == 403
    finally:
        cluster.core.delete_namespaced_service_account("nobody", NAMESPACE)


def test_each_account_may_make_exactly_the_calls_its_code_makes(apis: dict[str, Any]) -> None:
    """Asked of the API server's own authorizer for every verb on every resource above, in
    the release's namespace, in `default` and in a tenant's, by name and not: allowed is
    exactly what the code's calls need (plus the provisioner's signing key, granted ahead)."""
    expected = needed() | AHEAD
    wrong = []
    for component in FLEXVOLUME:  # CSI mode's accounts: tests/cluster/test_chart_csi.py
        api = apis[component]
        for group, resource in RESOURCES:
            places = [""] if resource in CLUSTER_SCOPED else [NAMESPACE, "default", "team-x"]
            for verb in VERBS:
                for ns in places:
                    for name in NAMES:
                        want = any(
                            (c, g, r, v) == (component, group, resource, verb)
                            and (where is None or where == ns)
                            and (allowed_name is None or allowed_name == name)
                            for c, g, r, v, where, allowed_name in expected
                        )
                        if allowed(api, group, resource, verb, ns, name) != want:
                            wrong.append((component, group, resource, verb, ns, name, want))
    assert not wrong, "(component, group, resource, verb, namespace, name, should be allowed)"


def _refused(call: Callable[[], Any]) -> int:
    try:
        call()
    except ApiException as exc:
        return int(exc.status)
    return 200


@pytest.fixture
def tenant(cluster: Cluster) -> Iterator[str]:
    ns = namespace(cluster, "tenant")
    cluster.core.create_namespaced_secret(
        ns,
        {
            "metadata": {"name": "smb-creds"},
            "type": "k8s/flexhub",
            "stringData": {"username": "u", "password": "p"},
        },
    )
    yield ns
    cluster.core.delete_namespace(ns)


@pytest.fixture
def volume(cluster: Cluster) -> Iterator[str]:
    """A flexhub PV, as the provisioner makes one (with its finalizer); not bound."""
    name = f"pvc-{uuid.uuid4()}"
    flexhub_pv(cluster, name)
    yield name
    with contextlib.suppress(ApiException):
        cluster.core.patch_persistent_volume(name, {"metadata": {"finalizers": None}})
    with contextlib.suppress(ApiException):
        cluster.core.delete_persistent_volume(name)


def test_node_root_with_the_agents_token_is_refused_what_the_chart_does_not_give(
    cluster: Cluster, apis: dict[str, Any], tenant: str, volume: str
) -> None:
    """Real requests with the node agent's token, as root on a node would make them: no
    Secret of any namespace, no PV made or replaced whole, no Event outside `default`, no
    claim, node or Lease (RBAC); no PV's spec (its reclaim policy, its claim), reclaim
    record, labels, owners or other finalizers edited, no PV deleted that is not Released, nothing done to a PV flexhub did not make
    (the chart's admission policy). What it needs still works: an Event on a PV, flexhub's
    finalizer removed as the node agent's own code removes it."""
    from flexhub.provisioner.pvapi import remove_finalizer

    other = f"pv-{uuid.uuid4().hex[:8]}"  # a PV of anyone else (made by an admin)
    cluster.core.create_persistent_volume(
        {
            "metadata": {"name": other, "finalizers": ["example.com/keep"]},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "hostPath": {"path": "/nonexistent"},
            },
        }
    )
    before = len(audited(cluster))
    core = client.CoreV1Api(apis["node-agent"])
    pv = cluster.core.read_persistent_volume(volume)
    assert "kubernetes.io/pv-protection" in pv.metadata.finalizers  # the API server's own
    pv.spec.flex_volume.options["server"] = "evil.example.net"
    event = {
        "metadata": {"name": f"forged.{uuid.uuid4().hex[:8]}"},
        "involvedObject": {"kind": "PersistentVolume", "name": volume},
        "reason": "ProvisioningFailed",
        "message": "run this",
    }
    record = '{"backend":"cifs","classSecret":"team-b/smb-creds","reclaimOn":"provisioner"}'
    patch = core.patch_persistent_volume
    attempts = {
        # RBAC
        "read a tenant's Secret": lambda: core.read_namespaced_secret("smb-creds", tenant),
        "list Secrets": lambda: core.list_secret_for_all_namespaces(),
        "list Secrets of its own namespace": lambda: core.list_namespaced_secret(NAMESPACE),
        "replace a PV whole": lambda: core.replace_persistent_volume(volume, pv),
        "make a PV": lambda: core.create_persistent_volume(
            {"metadata": {"name": f"pvc-{uuid.uuid4()}"}, "spec": pv.spec}
        ),
        "an Event in a tenant's namespace": lambda: core.create_namespaced_event(tenant, event),
        "an Event in its own namespace": lambda: core.create_namespaced_event(NAMESPACE, event),
        "read a claim": lambda: core.list_persistent_volume_claim_for_all_namespaces(),
        "read a node": lambda: core.list_node(),
        "take the provisioner's Lease": lambda: client.CoordinationV1Api(
            apis["node-agent"]
        ).read_namespaced_lease("flexhub-provisioner", NAMESPACE),
        # the admission policy
        "switch a PV's reclaim policy": lambda: patch(
            volume, {"spec": {"persistentVolumeReclaimPolicy": "Retain"}}
        ),
        "bind a PV to a claim of its choosing": lambda: patch(
            volume,
            {"spec": {"claimRef": {"namespace": tenant, "name": "mine", "uid": str(uuid.uuid4())}}},
        ),
        "rewrite a PV's reclaim record": lambda: patch(
            volume, {"metadata": {"annotations": {"flexhub/reclaim": record}}}
        ),
        "label a PV": lambda: patch(volume, {"metadata": {"labels": {"x": "y"}}}),
        # an owner that does not exist: the garbage collector would delete the PV, Bound or not
        "give a PV an owner": lambda: patch(
            volume,
            {
                "metadata": {
                    "ownerReferences": [
                        {
                            "apiVersion": "v1",
                            "kind": "Node",
                            "name": "nope",
                            "uid": "00000000-0000-0000-0000-000000000000",
                        }
                    ]
                }
            },
        ),
        "drop a PV's other finalizer": lambda: patch(
            volume,
            [{"op": "replace", "path": "/metadata/finalizers", "value": ["flexhub/reclaim"]}],
        ),
        "add a finalizer": lambda: patch(
            volume,
            [{"op": "add", "path": "/metadata/finalizers/-", "value": "example.com/x"}],
        ),
        "delete a PV that is not Released": lambda: core.delete_persistent_volume(volume),
        "touch a PV flexhub did not make": lambda: patch(other, {"metadata": {"finalizers": None}}),
        "delete a PV flexhub did not make": lambda: core.delete_persistent_volume(other),
    }
    try:
        answers = {what: _refused(call) for what, call in attempts.items()}
        assert answers == dict.fromkeys(attempts, 403)
        # the server saw every one as this account and refused it (the audit log)
        refused = forbidden(audited(cluster)[before:])
        assert len(refused) == len(attempts) and all(
            r.startswith(username("node-agent") + " ") for r in refused
        ), refused
        # a PV's source (its server, share, options) the API server itself never lets change
        server = {"spec": {"flexVolume": {"options": {"server": "evil.example.net"}}}}
        assert _refused(lambda: patch(volume, server)) == 422
        after = cluster.core.read_persistent_volume(volume)
        assert after.spec.flex_volume.options["server"] == "nfs1.example.com"
        assert after.spec.persistent_volume_reclaim_policy == "Delete"
        assert after.spec.claim_ref is None
        assert "flexhub/reclaim" not in (after.metadata.annotations or {})
        # what the agent needs still works: an Event on a PV in default, flexhub's finalizer
        # removed (a JSON patch of the finalizers, tested on the resourceVersion)
        assert _refused(lambda: core.create_namespaced_event("default", event)) == 200
        remove_finalizer(core, apis["node-agent"].sanitize_for_serialization(after))
        finalizers = cluster.core.read_persistent_volume(volume).metadata.finalizers
        assert finalizers == ["kubernetes.io/pv-protection"]
    finally:
        cluster.core.patch_persistent_volume(other, {"metadata": {"finalizers": None}})
        cluster.core.delete_persistent_volume(other)


def test_the_provisioners_token_does_what_it_needs_and_no_more(
    cluster: Cluster, apis: dict[str, Any], tenant: str
) -> None:
    core = client.CoreV1Api(apis["provisioner"])
    # a class's Secret, in any namespace (cifs credentials)
    assert core.read_namespaced_secret("smb-creds", tenant).type == "k8s/flexhub"
    # its signing key: made once in its own namespace, and read back
    key = {"metadata": {"name": "flexhub-provisioner-key"}, "stringData": {"key": "k"}}
    core.create_namespaced_secret(NAMESPACE, key)
    try:
        assert core.read_namespaced_secret("flexhub-provisioner-key", NAMESPACE).data
        statuses = {
            "a Secret in a tenant's namespace": _refused(
                lambda: core.create_namespaced_secret(tenant, key)
            ),
            "list Secrets": _refused(lambda: core.list_namespaced_secret(tenant)),
            "replace its key": _refused(
                lambda: core.replace_namespaced_secret("flexhub-provisioner-key", NAMESPACE, key)
            ),
            "a Lease elsewhere": _refused(
                lambda: client.CoordinationV1Api(apis["provisioner"]).read_namespaced_lease(
                    "flexhub-provisioner", "default"
                )
            ),
            "a Lease of another name": _refused(
                lambda: client.CoordinationV1Api(apis["provisioner"]).read_namespaced_lease(
                    "kube-scheduler", NAMESPACE
                )
            ),
            "a pod": _refused(lambda: core.list_namespaced_pod(tenant)),
        }
        assert statuses == dict.fromkeys(statuses, 403)
    finally:
        cluster.core.delete_namespaced_secret("flexhub-provisioner-key", NAMESPACE)
