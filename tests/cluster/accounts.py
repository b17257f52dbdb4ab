"""The chart's accounts on the test cluster: flexhub's processes run as deployed.

The Helm chart is rendered with the pinned helm (provisioner, node agent and CSI mode on), and
its Namespace, ServiceAccounts, ClusterRoles, Roles, bindings, the node agent's admission
policy and the CSIDriver are applied to the API server with strict field validation. Each account gets a token from the TokenRequest API (what the
kubelet mounts into a pod) and a kubeconfig holding it, so the provisioner and the node agent
call the API with exactly the rights the chart gives them, never the admin's. The API
server's audit log records every request of those accounts (:func:`forbidden`): a call the
chart does not allow is a 403 there, whatever the process made of it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cluster.cluster import Cluster
from tests.cluster.manifests import apply, documents
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "deploy"))
import render_manifest  # type: ignore[import-not-found]

#: The release the chart is rendered as (the plain manifest's): its namespace holds the
#: accounts and the provisioner's Lease.
NAMESPACE = render_manifest.NAMESPACE
KINDS = ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
         "RoleBinding", "ValidatingAdmissionPolicy",
         "ValidatingAdmissionPolicyBinding", "CSIDriver")  # fmt: skip
#: The chart's account of each process (release flexhub): FlexVolume mode's provisioner and
#: node agent; CSI mode's controller (flexhub csi --mode controller and its sidecars) and node
#: plugin (flexhub csi --mode node).
ACCOUNTS = {
    "provisioner": "flexhub-provisioner",
    "node-agent": "flexhub",
    "csi-controller": "flexhub-csi-controller",
    "csi-node": "flexhub-csi-node",
}
#: The components whose API calls tests/deploy/test_rbac_calls.py derives from the code.
FLEXVOLUME = ("provisioner", "node-agent")
#: The values the accounts are rendered with: every process on, both modes.
VALUES = ("namespace.create=true", "provisioner.enabled=true", "nodeAgent.enabled=true",
          "csi.enabled=true")  # fmt: skip
TOKEN_SECONDS = 24 * 3600


def username(component: str) -> str:
    return f"system:serviceaccount:{NAMESPACE}:{ACCOUNTS[component]}"


@dataclass
class Accounts:
    """The kubeconfig of each process, by component."""

    kubeconfigs: dict[str, Path]
    applied: list[str]

    def kubeconfig(self, component: str) -> Path:
        return self.kubeconfigs[component]


def render(*values: str) -> list[dict[str, Any]]:
    """The chart's documents as the accounts are rendered (:data:`VALUES`), plus ``values``
    (``--set`` each)."""
    return documents(render_manifest.render(render_manifest.helm_binary(), *VALUES, *values))


def rights_documents() -> list[dict[str, Any]]:
    """The chart's objects that give (and limit) flexhub's processes' rights, as rendered."""
    return [d for d in render() if d["kind"] in KINDS]


def install(cluster: Cluster) -> Accounts:
    """Apply the chart's RBAC and policy, mint a token for each account, write their
    kubeconfigs; return once the API server enforces the policy."""
    docs = sorted(rights_documents(), key=lambda d: KINDS.index(d["kind"]))
    applied = []
    for doc in docs:
        apply(cluster, doc)
        meta = doc["metadata"]
        applied.append(f"{doc['kind']}/{meta.get('namespace', '')}/{meta['name']}")
    kubeconfigs = {}
    for component, account in ACCOUNTS.items():
        token = mint_token(cluster, account)
        path = cluster.root / f"{component}.kubeconfig"
        write_kubeconfig(path, cluster.server, token, account)
        kubeconfigs[component] = path
    cluster.service_kubeconfigs.update(kubeconfigs)
    _wait_for_policy(cluster)
    return Accounts(kubeconfigs, applied)


def flexhub_pv(cluster: Cluster, name: str) -> Any:
    """A PV as the provisioner makes one (made by flexhub, its finalizer), of a server that
    does not exist: nothing mounts it."""
    return cluster.core.create_persistent_volume(
        {
            "metadata": {
                "name": name,
                "annotations": {"pv.kubernetes.io/provisioned-by": "flexhub"},
                "finalizers": ["flexhub/reclaim"],
            },
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Delete",
                "flexVolume": {
                    "driver": "k8s/flexhub",
                    "options": {"backend": "nfs", "server": "nfs1.example.com", "share": "/x"},
                },
            },
        }
    )


def _wait_for_policy(cluster: Cluster) -> None:
    """The API server enforces a new policy once it compiled it and its binding: wait until
    the node agent's token is refused a dry-run edit of a flexhub PV's reclaim policy."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    from tests.cluster.kube import eventually

    name = "flexhub-policy-probe"
    flexhub_pv(cluster, name)
    token = mint_token(cluster, ACCOUNTS["node-agent"], 600)
    agent = client.CoreV1Api(client_of(cluster, token))
    edit = {"spec": {"persistentVolumeReclaimPolicy": "Retain"}}

    def refused() -> bool:
        try:
            agent.patch_persistent_volume(name, edit, dry_run="All")
        except ApiException as exc:
            return exc.status == 403
        return False

    try:
        eventually("the node agent's admission policy in force", refused, timeout=60)
    finally:
        cluster.core.patch_persistent_volume(name, {"metadata": {"finalizers": None}})
        cluster.core.delete_persistent_volume(name)


def mint_token(cluster: Cluster, account: str, seconds: int = TOKEN_SECONDS) -> str:
    """A token of ``account`` from the TokenRequest API (as the kubelet gets a pod's)."""
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"audiences": [cluster.server], "expirationSeconds": seconds},
    }
    answer = cluster.core.create_namespaced_service_account_token(account, NAMESPACE, request)
    token: str = answer.status.token
    return token


def write_kubeconfig(path: Path, server: str, token: str, user: str) -> None:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": user,
                "clusters": [
                    {
                        "name": "local",
                        "cluster": {"server": server, "insecure-skip-tls-verify": True},
                    }
                ],
                "users": [{"name": user, "user": {"token": token}}],
                "contexts": [{"name": user, "context": {"cluster": "local", "user": user}}],
            }
        )
    )
    path.chmod(0o600)


def client_of(cluster: Cluster, token: str) -> Any:
    """An ApiClient that calls the test API server with ``token``."""
    from kubernetes import client

    configuration = client.Configuration()
    configuration.host = cluster.server
    configuration.verify_ssl = False
    configuration.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(configuration)


def audit_offset(cluster: Cluster) -> int:
    """Where the audit log ends now: :func:`audited` from here sees only what comes after."""
    try:
        return cluster.audit_log.stat().st_size
    except FileNotFoundError:
        return 0


def audited(
    cluster: Cluster, users: set[str] | None = None, since: int = 0
) -> list[dict[str, Any]]:
    """Every request of ``users`` (default: flexhub's chart accounts) as the API server's audit
    log holds it, from byte ``since`` of the log (:func:`audit_offset`) on."""
    try:
        with open(cluster.audit_log, "rb") as log:
            log.seek(since)
            text = log.read().decode(errors="replace")
    except FileNotFoundError:
        return []
    users = users if users is not None else {username(c) for c in ACCOUNTS}
    found = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:  # a line being written
            continue
        if event.get("user", {}).get("username") in users:
            found.append(event)
    return found


def forbidden(events: list[dict[str, Any]]) -> list[str]:
    """``user verb resource namespace/name`` of each request the API server refused 403."""
    refused = []
    for event in events:
        if (event.get("responseStatus") or {}).get("code") == 403:
            ref = event.get("objectRef") or {}
            refused.append(
                f"{event['user']['username']} {event['verb']} {ref.get('resource')}"
                f"{'/' + ref['subresource'] if ref.get('subresource') else ''} "
                f"{ref.get('namespace', '')}/{ref.get('name', '')}"
            )
    return refused
