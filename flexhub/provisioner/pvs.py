"""The PersistentVolume the provisioner writes for a claim, and what it reads back from one.

Everything a later reclaim needs is on the PV itself: the options (as the node driver reads
them), the ``flexhub/reclaim`` annotation (backend, onDelete, where reclaim runs, the node,
the backend's own record) and the Secret reference. A StorageClass changed or deleted after
provisioning changes nothing for the volumes made from it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from flexhub.errors import InvalidOptions
from flexhub.provisioning import Claim, Provisioned

__all__ = [
    "ANN_FROZEN",
    "ANN_PROVISIONED_BY",
    "ANN_RECLAIM",
    "ANN_SELECTED_NODE",
    "FINALIZER",
    "NODE_LABEL",
    "build_pv",
    "claim_from",
    "frozen_annotations",
    "node_label",
    "quantity",
    "reclaim_record",
]

ANN_PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
ANN_STORAGE_PROVISIONER = "volume.kubernetes.io/storage-provisioner"
ANN_STORAGE_PROVISIONER_BETA = "volume.beta.kubernetes.io/storage-provisioner"
ANN_SELECTED_NODE = "volume.kubernetes.io/selected-node"
#: The backend, onDelete, where reclaim runs, the node, and the backend's record (JSON).
ANN_RECLAIM = "flexhub/reclaim"
#: Held on every PV whose storage flexhub reclaims: removed only once the storage is gone.
FINALIZER = "flexhub/reclaim"
HOSTNAME_LABEL = "kubernetes.io/hostname"
#: On a PV whose storage its node reclaims: that node (:func:`node_label`), so that each
#: node agent watches only its own node's PVs (a label selector), not every PV.
NODE_LABEL = "flexhub/reclaim-node"
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


def node_label(node: str) -> str:
    """The :data:`NODE_LABEL` value of ``node``: its name when a label value can hold it
    (63 characters), else ``h-`` and a digest of it (node names may have 253)."""
    if _LABEL_VALUE.fullmatch(node):
        return node
    return "h-" + hashlib.sha256(node.encode()).hexdigest()[:60]


def parse_quantity(text: str) -> int:
    """Bytes of a Kubernetes quantity (``64Mi``, ``1G``, ``1.5Gi``, ``1e9``), rounded up."""
    from kubernetes.utils import parse_quantity as parse

    try:
        value: Decimal = parse(text)
    except ValueError:
        raise InvalidOptions(f"size {text!r} is not a quantity") from None
    return math.ceil(value)


def quantity(size: int) -> str:
    """``size`` bytes as the plainest exact quantity (``64Mi``, ``10Gi``, ``1000``)."""
    for suffix, unit in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if size and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


#: The claim's annotations as they were when its storage was first asked for (JSON), so that
#: a retry, or the reclaim of a claim deleted before its PV, derives the same storage even if
#: an annotation a ``pathPattern`` uses was edited since. The claim's author may edit it as
#: any annotation: it only ever names that claim's own storage (its uid is not in it).
ANN_FROZEN = "flexhub/provisioning-annotations"
#: Not frozen: the scheduler may pick another node after a failure; kubectl's copy is large.
_NOT_FROZEN = (
    ANN_SELECTED_NODE,
    ANN_FROZEN,
    "kubectl.kubernetes.io/last-applied-configuration",
)


def frozen_annotations(pvc: Mapping[str, Any]) -> str:
    """The :data:`ANN_FROZEN` value for a claim as it is now."""
    annotations = pvc["metadata"].get("annotations") or {}
    kept = {k: v for k, v in annotations.items() if k not in _NOT_FROZEN}
    return json.dumps(kept, sort_keys=True)


def claim_from(pvc: Mapping[str, Any]) -> Claim:
    """The :class:`Claim` of a PVC (a plain dict as the API serves it), with its annotations
    as frozen in :data:`ANN_FROZEN` when they were (the selected node always as it is now)."""
    meta, spec = pvc["metadata"], pvc["spec"]
    requests = (spec.get("resources") or {}).get("requests") or {}
    if "storage" not in requests:
        raise InvalidOptions("the claim requests no storage (spec.resources.requests.storage)")
    annotations = dict(meta.get("annotations") or {})
    try:
        frozen = json.loads(annotations.get(ANN_FROZEN, "null"))
    except ValueError:
        frozen = None
    if isinstance(frozen, dict) and all(isinstance(v, str) for v in frozen.values()):
        node = annotations.get(ANN_SELECTED_NODE)
        annotations = {str(k): v for k, v in frozen.items() if k not in _NOT_FROZEN}
        if node is not None:
            annotations[ANN_SELECTED_NODE] = node
    return Claim(
        uid=meta["uid"],
        namespace=meta["namespace"],
        name=meta["name"],
        size=parse_quantity(str(requests["storage"])),
        access_modes=tuple(spec.get("accessModes") or ("ReadWriteOnce",)),
        annotations=annotations,
        labels=dict(meta.get("labels") or {}),
        selected_node=annotations.get(ANN_SELECTED_NODE, ""),
    )


def reclaim_record(
    backend: str,
    on_delete: str,
    reclaim_on: str,
    made: Provisioned,
    size: int,
    class_secret: tuple[str, str] | None = None,
) -> dict[str, str]:
    record = dict(made.reclaim)
    if class_secret is not None:  # what reclaim and expansion authenticate with, by name only
        record["classSecret"] = f"{class_secret[0]}/{class_secret[1]}"
    record.update(
        {
            "backend": backend,
            "onDelete": on_delete,
            "reclaimOn": reclaim_on,
            "node": made.node,
            "size": str(size),
        }
    )
    return record


def build_pv(
    claim: Claim,
    class_name: str,
    reclaim_policy: str,
    backend: str,
    on_delete: str,
    reclaim_on: str,
    made: Provisioned,
    driver: str,
    provisioner: str,
    node_hostname: str = "",
    class_secret: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """The PV for ``claim``: pre-bound to it (``claimRef`` with its uid), the binder then
    completes the binding."""
    size = max(made.size, claim.size)
    options = {"backend": backend, **dict(made.options)}
    source: dict[str, Any] = {"driver": driver, "options": options}
    if made.fs_type:
        source["fsType"] = made.fs_type
    if made.secret is not None:
        source["secretRef"] = {"namespace": made.secret[0], "name": made.secret[1]}
    annotations = {
        ANN_PROVISIONED_BY: provisioner,
        ANN_RECLAIM: json.dumps(
            reclaim_record(backend, on_delete, reclaim_on, made, size, class_secret),
            sort_keys=True,
        ),
    }
    spec: dict[str, Any] = {
        "capacity": {"storage": quantity(size)},
        "accessModes": list(claim.access_modes),
        "persistentVolumeReclaimPolicy": reclaim_policy,
        "storageClassName": class_name,
        "volumeMode": "Filesystem",
        "claimRef": {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "namespace": claim.namespace,
            "name": claim.name,
            "uid": claim.uid,
        },
        "flexVolume": source,
    }
    if made.node:
        spec["nodeAffinity"] = {
            "required": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {
                                "key": HOSTNAME_LABEL,
                                "operator": "In",
                                "values": [node_hostname or made.node],
                            }
                        ]
                    }
                ]
            }
        }
    metadata: dict[str, Any] = {"name": claim.volume_name, "annotations": annotations}
    if reclaim_on == "node" and made.node:
        metadata["labels"] = {NODE_LABEL: node_label(made.node)}
    if reclaim_policy == "Delete":
        metadata["finalizers"] = [FINALIZER]
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": metadata, "spec": spec}
