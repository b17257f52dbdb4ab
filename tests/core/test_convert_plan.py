"""``flexhub convert``'s pure transforms: a FlexVolume PV of flexhub and its claim to the CSI
PV and claim (flexhub/convert/plan.py), the saved objects back, and what is refused."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from flexhub.convert import plan
from flexhub.errors import ConvertError

CLAIM_UID = "0b7c7a55-1f0e-4a2b-9c1d-5e6f7a8b9c0d"


def _provisioned() -> tuple[dict[str, Any], dict[str, Any]]:
    """A PV as flexhub's provisioner writes it (flexhub/provisioner/pvs.py), bound, and its
    claim as the API server serves them."""
    record = {"backend": "loopfile", "node": "n1", "onDelete": "delete", "reclaimOn": "node"}
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": f"pvc-{CLAIM_UID}",
            "uid": "pv-uid-1",
            "resourceVersion": "42",
            "labels": {"flexhub/reclaim-node": "n1"},
            "annotations": {
                "pv.kubernetes.io/provisioned-by": "flexhub",
                "flexhub/reclaim": json.dumps(record, sort_keys=True),
                "pv.kubernetes.io/bound-by-controller": "yes",
            },
            "finalizers": ["kubernetes.io/pv-protection", "flexhub/reclaim"],
        },
        "spec": {
            "capacity": {"storage": "320Mi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": "loop-xfs",
            "volumeMode": "Filesystem",
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": "team",
                "name": "data",
                "uid": CLAIM_UID,
                "resourceVersion": "40",
            },
            "nodeAffinity": {
                "required": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {
                                    "key": "kubernetes.io/hostname",
                                    "operator": "In",
                                    "values": ["n1"],
                                }
                            ]
                        }
                    ]
                }
            },
            "flexVolume": {
                "driver": "k8s/flexhub",
                "fsType": "xfs",
                "options": {
                    "backend": "loopfile",
                    "file": f"provisioned/pvc-{CLAIM_UID}.img",
                    "size": "335544320",
                    "mountOptions": "noatime,nodev",
                },
                "secretRef": {"name": "creds"},
            },
        },
        "status": {"phase": "Bound"},
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": "data",
            "namespace": "team",
            "uid": CLAIM_UID,
            "labels": {"app": "db"},
            "annotations": {
                "volume.kubernetes.io/storage-provisioner": "flexhub",
                "volume.beta.kubernetes.io/storage-provisioner": "flexhub",
                "pv.kubernetes.io/bind-completed": "yes",
                "team/owner": "alice",
            },
            "finalizers": ["kubernetes.io/pvc-protection"],
        },
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "320Mi"}},
            "storageClassName": "loop-xfs",
            "volumeMode": "Filesystem",
            "volumeName": f"pvc-{CLAIM_UID}",
        },
        "status": {"phase": "Bound"},
    }
    return pv, pvc


def test_a_provisioned_pv_becomes_a_csi_pv_of_the_same_storage() -> None:
    pv, pvc = _provisioned()
    new = plan.csi_pv(pv, pvc, "new-claim-uid")
    spec = new["spec"]
    assert new["metadata"]["name"] == pv["metadata"]["name"]
    assert spec["csi"] == {
        "driver": "flexhub.csi.k8s.io",
        "volumeHandle": f"loopfile:{CLAIM_UID}",
        "fsType": "xfs",
        "volumeAttributes": {
            "backend": "loopfile",
            "file": f"provisioned/pvc-{CLAIM_UID}.img",
            "size": "335544320",
            "flexhub.csi/namespace": "team",
        },
        "nodeStageSecretRef": {"name": "creds", "namespace": "team"},
        "nodePublishSecretRef": {"name": "creds", "namespace": "team"},
    }
    assert spec["mountOptions"] == ["noatime", "nodev"]
    assert spec["capacity"] == {"storage": "320Mi"}
    assert spec["accessModes"] == ["ReadWriteOnce"]
    assert spec["storageClassName"] == "loop-xfs"
    assert spec["volumeMode"] == "Filesystem"
    assert spec["nodeAffinity"] == pv["spec"]["nodeAffinity"]
    assert spec["claimRef"] == {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "namespace": "team",
        "name": "data",
        "uid": "new-claim-uid",
    }
    # the controller has no record of it: DeleteVolume would leak the storage silently
    assert spec["persistentVolumeReclaimPolicy"] == "Retain"
    annotations = new["metadata"]["annotations"]
    assert annotations["pv.kubernetes.io/provisioned-by"] == "flexhub.csi.k8s.io"
    assert annotations[plan.ANN_RECLAIM_POLICY] == "Delete"
    assert annotations[plan.ANN_CONVERTED_FROM] == CLAIM_UID
    assert annotations["flexhub/reclaim"] == pv["metadata"]["annotations"]["flexhub/reclaim"]
    assert "pv.kubernetes.io/bound-by-controller" not in annotations
    assert new["metadata"]["labels"] == {"flexhub/reclaim-node": "n1"}
    assert "finalizers" not in new["metadata"]  # no one would remove flexhub/reclaim
    assert "flexVolume" not in spec and "status" not in new


def test_the_claim_keeps_its_spec_and_names_the_pv() -> None:
    pv, pvc = _provisioned()
    new = plan.csi_claim(pvc, pv)
    assert new["metadata"]["name"] == "data" and new["metadata"]["namespace"] == "team"
    assert new["metadata"]["labels"] == {"app": "db"}
    annotations = new["metadata"]["annotations"]
    assert annotations["volume.kubernetes.io/storage-provisioner"] == "flexhub.csi.k8s.io"
    assert annotations["volume.beta.kubernetes.io/storage-provisioner"] == "flexhub.csi.k8s.io"
    assert annotations["team/owner"] == "alice"
    assert "pv.kubernetes.io/bind-completed" not in annotations
    assert new["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "320Mi"}},
        "storageClassName": "loop-xfs",
        "volumeMode": "Filesystem",
        "volumeName": f"pvc-{CLAIM_UID}",
    }
    assert "uid" not in new["metadata"] and "finalizers" not in new["metadata"]


def test_a_storage_class_moves_both() -> None:
    pv, pvc = _provisioned()
    assert plan.csi_claim(pvc, pv, "csi-loop")["spec"]["storageClassName"] == "csi-loop"
    assert plan.csi_pv(pv, pvc, "u", "csi-loop")["spec"]["storageClassName"] == "csi-loop"


def test_a_hand_written_pv_gets_no_provisioner_annotations() -> None:
    pv, pvc = _provisioned()
    pv["metadata"]["annotations"] = {}
    pvc["metadata"]["annotations"] = {}
    del pv["spec"]["flexVolume"]["secretRef"]
    pv["spec"]["flexVolume"]["readOnly"] = True
    new = plan.csi_pv(pv, pvc, "u")
    assert "pv.kubernetes.io/provisioned-by" not in new["metadata"]["annotations"]
    assert (
        "volume.kubernetes.io/storage-provisioner"
        not in (plan.csi_claim(pvc, pv)["metadata"]["annotations"])
    )
    assert "nodeStageSecretRef" not in new["spec"]["csi"]
    assert new["spec"]["csi"]["readOnly"] is True


def test_rollback_objects_are_the_saved_ones() -> None:
    pv, pvc = _provisioned()
    back = plan.flex_pv(pv, "again-uid")
    assert back["spec"]["flexVolume"] == pv["spec"]["flexVolume"]
    assert back["spec"]["persistentVolumeReclaimPolicy"] == "Delete"
    assert back["spec"]["claimRef"]["uid"] == "again-uid"
    assert "resourceVersion" not in back["spec"]["claimRef"]
    assert back["metadata"]["finalizers"] == ["flexhub/reclaim"]
    assert "uid" not in back["metadata"] and "resourceVersion" not in back["metadata"]
    assert (
        back["metadata"]["annotations"]["flexhub/reclaim"]
        == (pv["metadata"]["annotations"]["flexhub/reclaim"])
    )
    claim = plan.flex_claim(pvc, pv)
    assert claim["spec"]["storageClassName"] == "loop-xfs"
    assert claim["metadata"]["annotations"]["volume.kubernetes.io/storage-provisioner"] == (
        "flexhub"
    )


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda pv, pvc: pv["spec"].pop("flexVolume"), "not a FlexVolume PV"),
        (
            lambda pv, pvc: pv["spec"].update(
                csi={"driver": "x", "volumeHandle": "h"}, flexVolume=None
            ),
            "is a CSI PV",
        ),
        (lambda pv, pvc: pv["spec"]["flexVolume"].update(driver="acme/nfs"), "not flexhub's"),
        (lambda pv, pvc: pv["spec"]["flexVolume"]["options"].pop("backend"), "names no backend"),
        (lambda pv, pvc: pv["spec"]["claimRef"].update(uid="other"), "is not bound to claim"),
        (lambda pv, pvc: pv["spec"].pop("capacity"), "has no capacity"),
    ],
)
def test_what_is_not_a_flexhub_pair_is_refused(change: Any, error: str) -> None:
    pv, pvc = _provisioned()
    change(pv, pvc)
    before = copy.deepcopy((pv, pvc))
    with pytest.raises(ConvertError, match=error):
        plan.csi_pv(pv, pvc, "u")
    assert (pv, pvc) == before


def test_the_backup_name_is_per_claim_and_a_config_map_name() -> None:
    name = plan.backup_name("team", "data")
    assert name == plan.backup_name("team", "data") != plan.backup_name("team", "data2")
    assert len(plan.backup_name("n" * 63, "c" * 253)) <= 63
    assert plan.backup_name("a", "b-c") != plan.backup_name("a-b", "c")
