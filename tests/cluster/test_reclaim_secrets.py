"""A released PV's ``secretRef`` is read for its reclaim only when it names a Secret of the
driver's type, as kubelet demands for a mount: a hand-edited PV (anyone who may patch PVs,
the node agent's service account too) cannot make the provisioner read an arbitrary Secret and
hand it to a backend (which would send it to the PV's server).

The controller runs in-process against the real API server; the backend is a recording one
(this is about what the controller hands a backend, not about any storage).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

import pytest

from flexhub.errors import FlexhubError
from flexhub.provisioner import pvs
from flexhub.provisioner.controller import Controller
from flexhub.volume import Secrets
from tests.cluster.cluster import DRIVER, Cluster
from tests.cluster.kube import eventually, namespace

pytestmark = [pytest.mark.cluster, pytest.mark.root]


class _Recording:
    """Records each reclaim call's secrets (what a real backend would send to its server)."""

    expands_storage = False

    def __init__(self) -> None:
        self.calls: list[dict[str, str]] = []

    def reclaim(
        self, options: Mapping[str, str], reclaim: Mapping[str, str], secrets: Secrets
    ) -> None:
        self.calls.append({key: secrets[key].reveal() for key in secrets})


def _released_pv(cluster: Cluster, secret_ns: str, secret: str, **extra: str) -> str:
    name = f"pvc-{uuid.uuid4()}"
    record = {"backend": "rec", "onDelete": "delete", "reclaimOn": "provisioner", "node": ""}
    record.update(extra)
    cluster.core.create_persistent_volume(
        {
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
    )

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
    controller = Controller(cluster.api, lambda _name: backend, lambda sc: sc)  # type: ignore[arg-type,return-value]
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
    controller = Controller(cluster.api, lambda _name: backend, lambda sc: sc)  # type: ignore[arg-type,return-value]
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
    controller = Controller(cluster.api, lambda _name: backend, lambda sc: sc)  # type: ignore[arg-type,return-value]
    try:
        controller.sync(f"volume/{name}")
        assert backend.calls == []
        pv: Any = cluster.core.read_persistent_volume(name)
        assert pvs.FINALIZER in (pv.metadata.finalizers or [])
    finally:
        cluster.core.patch_persistent_volume(name, {"metadata": {"finalizers": None}})
        cluster.core.delete_persistent_volume(name)
