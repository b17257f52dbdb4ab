"""What the provisioner reclaims with its own rights comes only from what it wrote: a PV
edited after it was sealed (anyone who may patch PVs, the node agent's service account too)
is refused before any Secret is read or any backend called; and even on a sealed PV, a
``secretRef`` is read only when it names a Secret of the driver's type, as kubelet demands
for a mount.

The controller runs in-process against the real API server; the backend is a recording one
(this is about what the controller hands a backend, not about any storage).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Mapping
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from flexhub.errors import FlexhubError
from flexhub.provisioner import pvs
from flexhub.provisioner.controller import Controller, Later
from flexhub.provisioner.seal import ANN_SEAL, Sealer
from flexhub.volume import Secrets
from tests.cluster.cluster import DRIVER, Cluster
from tests.cluster.kube import eventually, namespace

pytestmark = [pytest.mark.cluster, pytest.mark.root]
SEALER = Sealer(b"k" * 32)


class _Recording:
    """Records each reclaim call's secrets (what a real backend would send to its server)."""

    expands_storage = True

    def __init__(self) -> None:
        self.calls: list[dict[str, str]] = []
        self.grown: list[int] = []

    def expand_storage(
        self, options: Mapping[str, str], reclaim: Mapping[str, str], size: int, s: Secrets
    ) -> int:
        self.grown.append(size)
        return size

    def reclaim(
        self, options: Mapping[str, str], reclaim: Mapping[str, str], secrets: Secrets
    ) -> None:
        self.calls.append({key: secrets[key].reveal() for key in secrets})


def _released_pv(cluster: Cluster, secret_ns: str, secret: str, **extra: str) -> str:
    name = f"pvc-{uuid.uuid4()}"
    record = {"backend": "rec", "onDelete": "delete", "reclaimOn": "provisioner", "node": ""}
    record.update(extra)
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": name,
            "annotations": {
                pvs.ANN_PROVISIONED_BY: "flexhub",
                pvs.ANN_RECLAIM: json.dumps(record),
            },
            "finalizers": [pvs.FINALIZER],
        },
        "spec": {
            "capacity": {"storage": "1Mi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Delete",
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": secret_ns,
                "name": "gone",
                "uid": str(uuid.uuid4()),
            },
            "flexVolume": {
                "driver": DRIVER,
                "options": {"backend": "rec"},
                "secretRef": {"namespace": secret_ns, "name": secret},
            },
        },
    }
    body["metadata"]["annotations"][ANN_SEAL] = SEALER.seal(body)
    cluster.core.create_persistent_volume(body)

    def released() -> bool:
        pv = cluster.core.read_persistent_volume(name)
        return bool(pv.status and pv.status.phase == "Released")

    eventually(f"{name} Released", released, timeout=60)
    return name


def test_reclaim_never_reads_a_secret_of_another_type(cluster: Cluster) -> None:
    ns = namespace(cluster, "reclaim-secret")
    cluster.core.create_namespaced_secret(
        ns,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "db-admin"},
            "type": "Opaque",
            "stringData": {"username": "admin", "password": "not-for-flexhub"},
        },
    )
    name = _released_pv(cluster, ns, "db-admin")
    backend = _Recording()
    controller = Controller(cluster.api, lambda _name: backend, lambda sc: sc, sealer=SEALER)  # type: ignore[arg-type,return-value]
    try:
        with pytest.raises(FlexhubError, match="type"):
            controller.sync_volume(name)
        assert backend.calls == []  # the Opaque Secret reached no backend
        pv: Any = cluster.core.read_persistent_volume(name)
        assert pvs.FINALIZER in (pv.metadata.finalizers or [])  # nothing reclaimed
    finally:
        cluster.core.patch_persistent_volume(name, {"metadata": {"finalizers": None}})
        cluster.core.delete_persistent_volume(name)


def test_reclaim_refuses_a_record_naming_another_claims_uid(cluster: Cluster) -> None:
    """nfs and cifs remove the recorded directory when its name holds the record's
    ``claimUid``: an edited record naming another claim's uid must reach no backend."""
    ns = namespace(cluster, "reclaim-uid")
    cluster.core.create_namespaced_secret(
        ns,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "share"},
            "type": DRIVER,
            "stringData": {"username": "u", "password": "p"},
        },
    )
    victim = str(uuid.uuid4())
    name = _released_pv(cluster, ns, "share", claimUid=victim, path=f"{ns}-db-pvc-{victim}")
    backend = _Recording()
    controller = Controller(cluster.api, lambda _name: backend, lambda sc: sc, sealer=SEALER)  # type: ignore[arg-type,return-value]
    try:
        with pytest.raises(FlexhubError, match="claim uid"):
            controller.sync_volume(name)
        assert backend.calls == []
        pv: Any = cluster.core.read_persistent_volume(name)
        assert pvs.FINALIZER in (pv.metadata.finalizers or [])
    finally:
        cluster.core.patch_persistent_volume(name, {"metadata": {"finalizers": None}})
        cluster.core.delete_persistent_volume(name)


@pytest.mark.parametrize("where", ["somewhere-new", ""])
def test_reclaim_leaves_a_record_of_an_unknown_place_alone(cluster: Cluster, where: str) -> None:
    """A PV whose record says ``reclaimOn`` is neither ``provisioner`` nor ``node`` (a newer
    flexhub wrote it, during a downgrade, or it was edited) is not reclaimed here."""
    ns = namespace(cluster, "reclaim-where")
    cluster.core.create_namespaced_secret(
        ns,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "share"},
            "type": DRIVER,
            "stringData": {"username": "u", "password": "p"},
        },
    )
    name = _released_pv(cluster, ns, "share", reclaimOn=where)
    backend = _Recording()
    controller = Controller(cluster.api, lambda _name: backend, lambda sc: sc, sealer=SEALER)  # type: ignore[arg-type,return-value]
    try:
        controller.sync(f"volume/{name}")
        assert backend.calls == []
        pv: Any = cluster.core.read_persistent_volume(name)
        assert pvs.FINALIZER in (pv.metadata.finalizers or [])
    finally:
        cluster.core.patch_persistent_volume(name, {"metadata": {"finalizers": None}})
        cluster.core.delete_persistent_volume(name)


def test_reclaim_refuses_a_pv_edited_after_it_was_sealed(cluster: Cluster) -> None:
    """The confused deputy: a PV writer points a sealed PV's Secret at another namespace's
    flexhub Secret and its server at their own host. The provisioner may read that Secret,
    the writer may not: it reads no Secret, calls no backend, keeps the finalizer, and says
    why in a VolumeUnsealed Event."""
    ns = namespace(cluster, "reclaim-sealed")
    cluster.core.create_namespaced_secret(
        ns,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "share"},
            "type": DRIVER,
            "stringData": {"username": "u", "password": "p"},
        },
    )
    other_ns = namespace(cluster, "sealed-team-b")
    cluster.core.create_namespaced_secret(
        other_ns,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "share"},
            "type": DRIVER,
            "stringData": {"username": "team-b", "password": "team-b's"},
        },
    )
    name = _released_pv(cluster, ns, "share", classSecret=f"{ns}/share")
    # The API server keeps a PV's source (options, secretRef) immutable; its annotations are
    # not: the record is pointed at another namespace's Secret.
    record = json.loads(
        cluster.core.read_persistent_volume(name).metadata.annotations[pvs.ANN_RECLAIM]
    )
    honest = json.dumps(record)
    record["classSecret"] = f"{other_ns}/share"
    cluster.core.patch_persistent_volume(
        name, {"metadata": {"annotations": {pvs.ANN_RECLAIM: json.dumps(record)}}}
    )
    backend = _Recording()
    controller = Controller(cluster.api, lambda _name: backend, lambda sc: sc, sealer=SEALER)  # type: ignore[arg-type,return-value]
    try:
        with pytest.raises(Later):
            controller.sync_volume(name)
        assert backend.calls == []
        pv: Any = cluster.core.read_persistent_volume(name)
        assert pvs.FINALIZER in (pv.metadata.finalizers or [])
        seen = cluster.core.list_namespaced_event(
            "default", field_selector=f"involvedObject.name={name}"
        )
        assert [e.reason for e in seen.items] == ["VolumeUnsealed"]
        # put back as the provisioner wrote it, it is reclaimed with the right Secret
        cluster.core.patch_persistent_volume(
            name, {"metadata": {"annotations": {pvs.ANN_RECLAIM: honest}}}
        )
        controller.sync_volume(name)
        assert backend.calls == [{"username": "u", "password": "p"}]  # its own, not team-b's
        eventually(f"{name} gone", lambda: not cluster.core.list_persistent_volume(
            field_selector=f"metadata.name={name}").items, timeout=30)  # fmt: skip
    finally:
        with contextlib.suppress(ApiException):  # gone already on the success path
            cluster.core.patch_persistent_volume(name, {"metadata": {"finalizers": None}})
            cluster.core.delete_persistent_volume(name)


def test_a_claim_naming_another_claims_pv_never_grows_it(cluster: Cluster) -> None:
    """Any namespace user may write another tenant's PV name into a new claim's
    ``spec.volumeName``: the controller grows only the claim the PV is bound to (its
    ``claimRef`` uid), and only as far as that claim asks."""
    victim_ns, evil_ns = namespace(cluster, "grow-victim"), namespace(cluster, "grow-evil")
    cluster.storage.create_storage_class(
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": f"rec-{victim_ns}"},
            "provisioner": "flexhub",
            "allowVolumeExpansion": True,
        }
    )
    claim = cluster.core.create_namespaced_persistent_volume_claim(
        victim_ns,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "db"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": f"rec-{victim_ns}",
                "resources": {"requests": {"storage": "1Mi"}},
            },
        },
    )
    name = f"pvc-{claim.metadata.uid}"
    record = {"backend": "rec", "onDelete": "delete", "reclaimOn": "provisioner", "node": "",
              "size": str(1 << 20), "claimUid": claim.metadata.uid}  # fmt: skip
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": name,
            "annotations": {pvs.ANN_PROVISIONED_BY: "flexhub", pvs.ANN_RECLAIM: json.dumps(record)},
        },
        "spec": {
            "capacity": {"storage": "1Mi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": f"rec-{victim_ns}",
            "claimRef": {"namespace": victim_ns, "name": "db", "uid": claim.metadata.uid},
            "flexVolume": {"driver": DRIVER, "options": {"backend": "rec"}},
        },
    }
    body["metadata"]["annotations"][ANN_SEAL] = SEALER.seal(body)
    cluster.core.create_persistent_volume(body)
    eventually(
        "bound",
        lambda: cluster.core.read_persistent_volume(name).status.phase == "Bound",
        timeout=60,
    )
    cluster.core.create_namespaced_persistent_volume_claim(
        evil_ns,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "grow"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": f"rec-{victim_ns}",
                "volumeName": name,
                "resources": {"requests": {"storage": "100Ti"}},
            },
        },
    )
    backend = _Recording()
    controller = Controller(cluster.api, lambda _name: backend, lambda sc: sc, sealer=SEALER)  # type: ignore[arg-type,return-value]
    try:
        controller.sync_claim(evil_ns, "grow")
        assert backend.grown == []
        # the claim it is bound to grows it (the API server lets a bound claim ask for more)
        cluster.core.patch_namespaced_persistent_volume_claim(
            "db", victim_ns, {"spec": {"resources": {"requests": {"storage": "2Mi"}}}}
        )
        controller.sync_claim(victim_ns, "db")
        assert backend.grown == [2 << 20]
        pv: Any = cluster.api.sanitize_for_serialization(cluster.core.read_persistent_volume(name))
        assert json.loads(pv["metadata"]["annotations"][pvs.ANN_RECLAIM])["size"] == str(2 << 20)
        assert SEALER.sealed(pv)
    finally:
        cluster.core.delete_persistent_volume(name)
        cluster.storage.delete_storage_class(f"rec-{victim_ns}")
