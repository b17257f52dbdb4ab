"""flexhub's CSI controller on the cluster tier, driven by the stock kubernetes-csi sidecars
(tests/cluster/sidecars.py): a claim of a CSI StorageClass is provisioned by csi-provisioner's
CreateVolume, expanded by csi-resizer's ControllerExpandVolume, snapshotted through the
snapshot controller and csi-snapshotter, restored into a new claim, and its storage reclaimed
when the claims go; the sidecars do it all with their accounts' rights (no 403 in the audit
log), never the admin's.

The class binds Immediately, its allowed topology the one node: the node plugin does not
register with the kubelet on this tier yet, so no CSINode carries flexhub's topology key and a
WaitForFirstConsumer claim could not be provisioned (csi-provisioner needs the selected node's
CSINode topology); with Immediate binding csi-provisioner sends the class's allowed topology,
and flexhub makes the volume on that node.

The tests run in order on one claim (each step is the next one's input), so that the tier
stays within CI's time budget.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from flexhub.csi import TOPOLOGY_NODE_KEY
from flexhub.csi.controller import volume_uid
from tests.cluster import sidecars
from tests.cluster.accounts import Accounts, forbidden
from tests.cluster.cluster import NODE, Cluster
from tests.cluster.kube import eventually, namespace
from tests.cluster.sidecars import SNAPSHOTS, node_affinity

pytestmark = [pytest.mark.cluster, pytest.mark.root]

CLASS = "flexhub-csi-loopfile"
SNAPSHOT_CLASS = "flexhub-csi-loopfile-snapshots"
#: What the steps share: the namespace, the claims' PV names.
STATE: dict[str, Any] = {}


@pytest.fixture(scope="module")
def csi(
    cluster: Cluster, accounts: Accounts, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[sidecars.Csi]:
    with sidecars.running(cluster, accounts.kubeconfig("csi-controller"), tmp_path_factory) as csi:
        yield csi


@pytest.fixture(scope="module")
def ns(cluster: Cluster, csi: sidecars.Csi) -> str:
    name = namespace(cluster, "csi")
    with contextlib.suppress(ApiException):
        cluster.storage.delete_storage_class(CLASS)
    cluster.storage.create_storage_class(
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": CLASS},
            "provisioner": sidecars.DRIVER,
            "parameters": {"backend": "loopfile"},
            "reclaimPolicy": "Delete",
            "allowVolumeExpansion": True,
            "volumeBindingMode": "Immediate",
            # csi-provisioner sends an Immediate claim the topologies of the nodes whose
            # CSINode has the driver (none here: "no available topology found"), else the
            # class's allowed ones: the node, as an operator pins a node-local class.
            "allowedTopologies": [
                {"matchLabelExpressions": [{"key": TOPOLOGY_NODE_KEY, "values": [NODE]}]}
            ],
        }
    )
    return name


def _earlier(key: str) -> Any:
    """What an earlier step made (it failed if there is none: say so, not a KeyError)."""
    if key not in STATE:
        pytest.fail(f"an earlier step failed: no {key}", pytrace=False)
    return STATE[key]


def test_claim_is_provisioned_by_create_volume(
    cluster: Cluster, csi: sidecars.Csi, ns: str
) -> None:
    """csi-provisioner sees the claim of flexhub's CSI class, calls CreateVolume, and makes
    a PV bound to it: CSI source of flexhub's driver, the volume id ``loopfile:<uid>`` derived
    from the PV's name, the node affinity of the node flexhub made it on, flexhub's record."""
    claim = cluster.core.create_namespaced_persistent_volume_claim(
        ns, sidecars.claim("data", "64Mi", CLASS)
    )
    pv = sidecars.bound_pv(cluster, csi, ns, "data")
    assert pv.metadata.name == f"pvc-{claim.metadata.uid}"
    assert pv.spec.csi.driver == sidecars.DRIVER
    assert pv.spec.csi.volume_handle == f"loopfile:{volume_uid(pv.metadata.name)}"
    assert pv.spec.claim_ref.name == "data" and pv.spec.claim_ref.namespace == ns
    assert pv.spec.capacity["storage"] == "64Mi"
    assert pv.spec.persistent_volume_reclaim_policy == "Delete"
    assert pv.metadata.annotations["pv.kubernetes.io/provisioned-by"] == sidecars.DRIVER
    assert node_affinity(pv) == [(TOPOLOGY_NODE_KEY, [NODE])]
    record = json.loads(sidecars.record(csi, "volumes", pv.spec.csi.volume_handle).read_text())
    # the claim's namespace reached CreateVolume (--extra-create-metadata), and the node
    assert (record["namespace"], record["node"], record["size"]) == (ns, NODE, 64 << 20)
    STATE["ns"], STATE["pv"] = ns, pv.metadata.name


def test_claim_is_expanded_by_controller_expand_volume(cluster: Cluster, csi: sidecars.Csi) -> None:
    """A larger request of the claim: csi-resizer calls ControllerExpandVolume and the PV's
    capacity grows to the request (the filesystem grows at the node's next stage)."""
    ns = _earlier("ns")
    cluster.core.patch_namespaced_persistent_volume_claim(
        "data", ns, {"spec": {"resources": {"requests": {"storage": "96Mi"}}}}
    )

    def grown() -> bool:
        pv = cluster.core.read_persistent_volume(_earlier("pv"))
        return bool(pv.spec.capacity["storage"] == "96Mi")

    eventually("the PV grown to 96Mi", grown, timeout=90)

    # loopfile is a block backend: node_expansion_required, the filesystem grows on the node
    def pending() -> Any:
        pvc = cluster.core.read_namespaced_persistent_volume_claim("data", ns)
        types = {c.type for c in pvc.status.conditions or []}
        return pvc if "FileSystemResizePending" in types else None

    pvc = eventually("the claim's FileSystemResizePending", pending, timeout=30)
    assert pvc.status.capacity["storage"] == "64Mi"
    record = json.loads(
        sidecars.record(csi, "volumes", f"loopfile:{volume_uid(_earlier('pv'))}").read_text()
    )
    assert record["size"] == 96 << 20, record


def test_snapshot_becomes_ready(cluster: Cluster, csi: sidecars.Csi) -> None:
    """A VolumeSnapshot of the claim in a class of flexhub's driver: the snapshot controller
    makes its content, csi-snapshotter calls CreateSnapshot, and it becomes readyToUse with
    flexhub's snapshot id and record (a never-mounted volume copies as an empty file)."""
    ns, custom = _earlier("ns"), sidecars.custom_objects(cluster)
    group, version = SNAPSHOTS
    with contextlib.suppress(ApiException):
        custom.delete_cluster_custom_object(group, version, "volumesnapshotclasses",
                                            SNAPSHOT_CLASS)  # fmt: skip
    custom.create_cluster_custom_object(group, version, "volumesnapshotclasses", {
        "apiVersion": f"{group}/{version}", "kind": "VolumeSnapshotClass",
        "metadata": {"name": SNAPSHOT_CLASS}, "driver": sidecars.DRIVER,
        "deletionPolicy": "Delete",
    })  # fmt: skip
    snap = sidecars.snapshot_ready(cluster, ns, "snap", "data", SNAPSHOT_CLASS, timeout=90)
    content = custom.get_cluster_custom_object(
        group, version, "volumesnapshotcontents", snap["status"]["boundVolumeSnapshotContentName"]
    )
    handle = content["status"]["snapshotHandle"]
    assert content["spec"]["driver"] == sidecars.DRIVER
    assert handle.startswith("loopfile:snapshot:"), handle
    assert sidecars.record(csi, "snapshots", handle).is_file()
    # The volume was never mounted: its copy is an empty file of the size it was made with
    # (the node grows a file at its next stage, FileSystemResizePending above), so that is
    # the size a restore needs.
    assert snap["status"]["restoreSize"] == "64Mi"
    STATE["snapshot"] = handle


def test_claim_from_snapshot_is_provisioned(cluster: Cluster, csi: sidecars.Csi) -> None:
    """A claim whose dataSource is the snapshot: CreateVolume from it makes a new volume of
    the claim's size (larger than the snapshot's) on the snapshot's node, bound to the new
    claim."""
    ns = _earlier("ns")
    cluster.core.create_namespaced_persistent_volume_claim(
        ns, sidecars.claim("restored", "96Mi", CLASS, snapshot="snap")
    )
    pv = sidecars.bound_pv(cluster, csi, ns, "restored")
    assert pv.spec.csi.driver == sidecars.DRIVER
    assert pv.spec.csi.volume_handle == f"loopfile:{volume_uid(pv.metadata.name)}"
    assert pv.metadata.name != _earlier("pv")
    assert pv.spec.capacity["storage"] == "96Mi"
    record = json.loads(sidecars.record(csi, "volumes", pv.spec.csi.volume_handle).read_text())
    assert (record["node"], record["size"]) == (NODE, 96 << 20), record
    assert node_affinity(pv) == [(TOPOLOGY_NODE_KEY, [NODE])]
    STATE["restored"] = pv.metadata.name


def test_deleted_claims_and_snapshot_are_reclaimed(cluster: Cluster, csi: sidecars.Csi) -> None:
    """The snapshot and both claims deleted: DeleteSnapshot and DeleteVolume remove flexhub's
    records and the storage, and the PVs and the snapshot's content go."""
    ns, custom = _earlier("ns"), sidecars.custom_objects(cluster)
    group, version = SNAPSHOTS
    cluster.core.delete_namespaced_persistent_volume_claim("restored", ns)
    custom.delete_namespaced_custom_object(group, version, ns, "volumesnapshots", "snap")
    cluster.core.delete_namespaced_persistent_volume_claim("data", ns)
    records = [
        sidecars.record(csi, "volumes", f"loopfile:{volume_uid(_earlier('pv'))}"),
        sidecars.record(csi, "volumes", f"loopfile:{volume_uid(_earlier('restored'))}"),
        sidecars.record(csi, "snapshots", _earlier("snapshot")),
    ]

    def gone() -> bool:
        names = {pv.metadata.name for pv in cluster.core.list_persistent_volume().items}
        contents = custom.list_cluster_custom_object(group, version, "volumesnapshotcontents")
        return (
            not ({_earlier("pv"), _earlier("restored")} & names)
            and not contents["items"]
            and not any(r.exists() for r in records)
        )

    eventually("PVs, content and records gone", gone, timeout=90)
    left = [str(p) for p in csi.loopfile_root.rglob("*") if p.is_file()]
    assert left == [], left


def test_sidecars_were_never_refused(cluster: Cluster, csi: sidecars.Csi) -> None:
    """The sidecars' accounts made their calls (the audit log holds them) and the API server
    refused none (no 403): their RBAC is enough for everything above."""
    events = sidecars.audited(cluster, csi)
    users = {e["user"]["username"] for e in events}
    assert users == {sidecars.username(c) for c in sidecars.ACCOUNTS}, users
    assert forbidden(events) == []
