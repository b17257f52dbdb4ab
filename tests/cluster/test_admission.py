"""Scenario 8: deploy/admission-policy.yaml enforced by the real API server.

The fixture applied the file as an operator would (``kubectl apply -f``); here every case of
tests/admission_cases.py is created with a server-side dry run, which runs admission in full
and stores nothing. A rejection must carry the policy's message, as ``kubectl`` would show it.
The example PVs of deploy/examples are admitted.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from kubernetes.client.rest import ApiException

from tests.admission_cases import CASES, INLINE_CASES, POLICY_FILE
from tests.cluster.cluster import Cluster
from tests.cluster.kube import namespace
from tests.conftest import REPO

pytestmark = [pytest.mark.cluster]
KUBELET_KEY_MESSAGE = "flexhub volume options must not set kubernetes.io/ keys"
INLINE_MESSAGE = "inline flexhub volumes of this backend are not allowed in this namespace"


def _dry_run(cluster: Cluster, ns: str, obj: dict[str, Any]) -> str:
    """Create ``obj`` with dryRun=All; return "" when admitted, else the server's message."""
    obj = copy.deepcopy(obj)
    try:
        if obj["kind"] == "PersistentVolume":
            cluster.core.create_persistent_volume(obj, dry_run="All")
        else:
            cluster.core.create_namespaced_pod(ns, obj, dry_run="All")
    except ApiException as exc:
        assert exc.status in (403, 422), f"{exc.status}: {exc.body}"
        return str(exc.body)
    return ""


@pytest.fixture(scope="module")
def labelled(cluster: Cluster) -> str:
    """A namespace where inline volumes are allowed (only the kubelet-key policies apply)."""
    return namespace(cluster, "adm-allowed")


@pytest.fixture(scope="module")
def unlabelled(cluster: Cluster) -> str:
    return namespace(cluster, "adm-default", inline_allowed=False)


#: What the API server's own validation says of a flexVolume option key in the kubernetes.io
#: or k8s.io namespace, of any driver, before any admission policy runs.
RESERVED_MESSAGE = "kubernetes.io and k8s.io namespaces are reserved"


def _sets_reserved_key(obj: dict[str, Any]) -> bool:
    spec = obj["spec"]
    sources = (
        [spec.get("flexVolume")]
        if obj["kind"] == "PersistentVolume"
        else [v.get("flexVolume") for v in spec.get("volumes") or []]
    )
    return any(
        ("." + k.split("/")[0].lower()).endswith((".kubernetes.io", ".k8s.io"))
        for s in sources
        if s
        for k in (s.get("options") or {})
    )


@pytest.mark.parametrize(("name", "obj", "admitted"), CASES, ids=[c[0] for c in CASES])
def test_kubelet_key_volumes_are_refused(
    cluster: Cluster, labelled: str, name: str, obj: dict[str, Any], admitted: bool
) -> None:
    """Every case the kubelet-key policies reject is refused by the real server, and so is
    a kubelet key in a volume of another driver: the server's validation refuses such keys
    in every flexVolume, before admission (so the policies are a second line on a
    conformant server). Every other case is admitted."""
    message = _dry_run(cluster, labelled, obj)
    if admitted and not _sets_reserved_key(obj):
        assert message == ""
    else:
        assert RESERVED_MESSAGE in message and '"code":422' in message, message
        assert "Invalid value" in message


@pytest.mark.parametrize(
    ("name", "obj", "by_default", "nfs_allowed"), INLINE_CASES, ids=[c[0] for c in INLINE_CASES]
)
def test_inline_volume_policy(
    cluster: Cluster,
    unlabelled: str,
    labelled: str,
    name: str,
    obj: dict[str, Any],
    by_default: bool,
    nfs_allowed: bool,
) -> None:
    message = _dry_run(cluster, unlabelled, obj)
    assert (message == "") is by_default, message
    if not by_default:
        assert INLINE_MESSAGE in message, message
    # In a namespace labelled flexhub/inline-volumes=allowed the policy does not apply.
    assert _dry_run(cluster, labelled, obj) == ""


def test_inline_policy_with_an_allow_list(cluster: Cluster, unlabelled: str) -> None:
    """The policy's allowedBackends variable set to ['nfs'] (as the file's comment tells an
    operator to) admits exactly the NFS cases."""
    api = cluster.api
    from kubernetes import client

    admission = client.AdmissionregistrationV1Api(api)
    policy = admission.read_validating_admission_policy("flexhub-inline-volumes")
    original = copy.deepcopy(policy.spec.variables)
    for variable in policy.spec.variables:
        if variable.name == "allowedBackends":
            variable.expression = "['nfs']"
    admission.replace_validating_admission_policy("flexhub-inline-volumes", policy)
    try:
        from tests.cluster.kube import eventually

        nfs_case = next(obj for name, obj, _, allowed in INLINE_CASES if name == "inline nfs")
        eventually(
            "the new allow-list in force",
            lambda: _dry_run(cluster, unlabelled, nfs_case) == "",
            timeout=30,
        )
        for name, obj, _, nfs_allowed in INLINE_CASES:
            assert (_dry_run(cluster, unlabelled, obj) == "") is nfs_allowed, name
    finally:
        policy = admission.read_validating_admission_policy("flexhub-inline-volumes")
        policy.spec.variables = original
        admission.replace_validating_admission_policy("flexhub-inline-volumes", policy)


def test_example_pvs_are_admitted(cluster: Cluster, labelled: str) -> None:
    examples = sorted((REPO / "deploy" / "examples").glob("*.yaml"))
    assert examples
    seen = 0
    for path in examples:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "PersistentVolume":
                assert _dry_run(cluster, labelled, doc) == "", path.name
                seen += 1
    assert seen >= 4


def test_policy_file_is_what_the_server_enforces(cluster: Cluster) -> None:
    """The fixture applied this very file: what the server holds is its policies."""
    from kubernetes import client

    admission = client.AdmissionregistrationV1Api(cluster.api)
    names = {p.metadata.name for p in admission.list_validating_admission_policy().items}
    wanted = {
        d["metadata"]["name"]
        for d in yaml.safe_load_all(POLICY_FILE.read_text())
        if d and d["kind"] == "ValidatingAdmissionPolicy"
    }
    assert wanted <= names
    for name in wanted:
        status = admission.read_validating_admission_policy(name).status
        # The server type-checked every expression against the Pod/PV schema: no warnings.
        assert status is None or not (
            status.type_checking and status.type_checking.expression_warnings
        ), name
