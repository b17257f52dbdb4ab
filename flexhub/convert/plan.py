"""The objects ``flexhub convert`` writes, as pure functions of the objects it read.

A FlexVolume PV of driver ``k8s/flexhub`` and its bound claim become a CSI PV of driver
``flexhub.csi.k8s.io`` and a claim bound to it, pointing at the same storage:

* ``volumeAttributes`` are the FlexVolume ``options`` (strings, ``backend`` included), less
  ``mountOptions``, which move to ``spec.mountOptions`` (the CSI node joins them back into the
  options before validating, :mod:`flexhub.csi.volumes`), so the CSI node resolves exactly the
  storage (and node-side volume id, journal keys and locks) the FlexVolume driver resolved.
  The claim's namespace goes to ``flexhub.csi/namespace`` (loopfile's per-namespace areas).
* ``volumeHandle`` is ``<backend>:<uid of the original claim>``: the form the CSI controller
  gives the volumes it makes (``<backend>:<uid>``), unique, and stable across reruns.
* ``secretRef`` becomes ``nodeStageSecretRef`` and ``nodePublishSecretRef`` (same Secret; CSI
  puts no constraint on its type).
* capacity, access modes, volume mode, node affinity, labels and annotations are kept (less
  what the binder and kubectl own); ``pv.kubernetes.io/provisioned-by`` and the claim's
  ``volume.kubernetes.io/storage-provisioner`` name the CSI driver when they were set.
* the reclaim policy is ``Retain`` when written: the CSI controller reclaims only volumes it
  holds a record of, and a converted volume has one only once convert wrote it
  (:mod:`flexhub.convert.adopt`: a PV the FlexVolume provisioner reclaimed gets its ``Delete``
  back after that, and its ``pv.kubernetes.io/provisioned-by`` names the CSI driver; any other
  keeps ``Retain``). The original policy is kept in :data:`ANN_RECLAIM_POLICY`, the FlexVolume
  reclaim record in ``flexhub/reclaim``.

Rollback writes the saved objects back (:func:`flex_pv`, :func:`flex_claim`): the same
objects less what the API server owns.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from flexhub.errors import ConvertError

__all__ = [
    "ANN_CONVERTED_FROM",
    "ANN_RECLAIM_POLICY",
    "CSI_DRIVER",
    "FLEX_DRIVER",
    "backup_name",
    "check_flex_pair",
    "csi_claim",
    "csi_pv",
    "flex_claim",
    "flex_pv",
    "volume_handle",
]

#: The FlexVolume driver flexhub answers for, and the CSI driver it moves to (the same
#: values as ``flexhub.DRIVER_NAME`` and ``flexhub.csi.DRIVER_NAME``, which imports nothing).
FLEX_DRIVER = "k8s/flexhub"
CSI_DRIVER = "flexhub.csi.k8s.io"
#: On the CSI PV and claim: the uid of the claim they were converted from.
ANN_CONVERTED_FROM = "flexhub/converted-from"
#: On the CSI PV: the reclaim policy the FlexVolume PV had.
ANN_RECLAIM_POLICY = "flexhub/converted-reclaim-policy"
ANN_PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
_STORAGE_PROVISIONER = (
    "volume.kubernetes.io/storage-provisioner",
    "volume.beta.kubernetes.io/storage-provisioner",
)
#: Annotations the PV controller (binder) or kubectl own: never copied onto a new object.
_BINDER = (
    "pv.kubernetes.io/bind-completed",
    "pv.kubernetes.io/bound-by-controller",
    "kubectl.kubernetes.io/last-applied-configuration",
)
#: The FlexVolume provisioner's finalizer: removed from the old PV once it is Retain (as the
#: provisioner does), never put on a CSI PV (no one would remove it).
FLEX_FINALIZER = "flexhub/reclaim"
_CONTEXT_NAMESPACE = "flexhub.csi/namespace"


def backup_name(namespace: str, claim: str) -> str:
    """The ConfigMap holding the saved objects of claim ``namespace/claim``."""
    digest = hashlib.sha256(f"{namespace}/{claim}".encode()).hexdigest()[:20]
    return f"flexhub-convert-{digest}"


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


#: Option keys kubelet merges over its own (the PV's options come last) and the FlexVolume
#: driver reads: under CSI they are the source's ``readOnly`` and ``fsType``.
_READ_WRITE = "kubernetes.io/readwrite"
_FS_TYPE = "kubernetes.io/fsType"
#: Credentials written into a PV's options (the driver reads them as kubelet's secret keys).
_INLINE_SECRET = "kubernetes.io/secret/"


def check_flex_pair(pv: Mapping[str, Any], pvc: Mapping[str, Any]) -> None:
    """Refuse (one line) a PV that is not flexhub's FlexVolume PV bound to ``pvc``."""
    ns, name = _meta(pvc).get("namespace", ""), _meta(pvc).get("name", "")
    pv_name = _meta(pv).get("name", "")
    flex = (pv.get("spec") or {}).get("flexVolume")
    if not flex:
        kind = "a CSI PV" if (pv.get("spec") or {}).get("csi") else "not a FlexVolume PV"
        raise ConvertError(f"PV {pv_name} of claim {ns}/{name} is {kind}: nothing to convert")
    if flex.get("driver") != FLEX_DRIVER:
        raise ConvertError(
            f"PV {pv_name} is a FlexVolume of driver {str(flex.get('driver'))[:80]!r}, "
            f"not {FLEX_DRIVER!r}: not flexhub's"
        )
    options = flex.get("options") or {}
    if not options.get("backend"):
        raise ConvertError(f"PV {pv_name} names no backend (option 'backend')")
    if not all(isinstance(v, str) for v in options.values()):
        raise ConvertError(f"PV {pv_name}: every option must be a string")
    inline = sorted(k for k in options if str(k).startswith(_INLINE_SECRET))
    if inline:
        raise ConvertError(
            f"PV {pv_name} carries credentials in its options ({', '.join(inline)[:120]}): "
            "convert copies no secret; move them into the Secret its secretRef names first"
        )
    ref = (pv.get("spec") or {}).get("claimRef") or {}
    if (ref.get("namespace"), ref.get("name"), ref.get("uid")) != (
        ns,
        name,
        _meta(pvc).get("uid"),
    ):
        raise ConvertError(f"PV {pv_name} is not bound to claim {ns}/{name}")
    if not ((pv.get("spec") or {}).get("capacity") or {}).get("storage"):
        raise ConvertError(f"PV {pv_name} has no capacity")


def volume_handle(pv: Mapping[str, Any], pvc: Mapping[str, Any]) -> str:
    """``<backend>:<uid of the original claim>``."""
    options = pv["spec"]["flexVolume"].get("options") or {}
    return f"{options['backend']}:{_meta(pvc)['uid']}"


def _annotations(obj: Mapping[str, Any]) -> dict[str, str]:
    annotations = dict(_meta(obj).get("annotations") or {})
    for key in _BINDER:
        annotations.pop(key, None)
    return annotations


def csi_pv(
    pv: Mapping[str, Any], pvc: Mapping[str, Any], new_claim_uid: str, storage_class: str = ""
) -> dict[str, Any]:
    """The CSI PV replacing ``pv`` (bound to ``pvc``), pre-bound to the new claim's uid."""
    check_flex_pair(pv, pvc)
    spec = pv["spec"]
    flex = spec["flexVolume"]
    attributes = {str(k): str(v) for k, v in (flex.get("options") or {}).items()}
    mount_options = [o for o in attributes.pop("mountOptions", "").split(",") if o]
    attributes.setdefault(_CONTEXT_NAMESPACE, _meta(pvc)["namespace"])
    source: dict[str, Any] = {
        "driver": CSI_DRIVER,
        "volumeHandle": volume_handle(pv, pvc),
        "volumeAttributes": attributes,
    }
    read_write, option_fs_type = attributes.pop(_READ_WRITE, ""), attributes.pop(_FS_TYPE, "")
    if option_fs_type or flex.get("fsType"):
        source["fsType"] = option_fs_type or flex["fsType"]  # kubelet merges options last
    if flex.get("readOnly") or read_write == "ro":
        source["readOnly"] = True
    ref = flex.get("secretRef")
    if ref and ref.get("name"):
        secret = {"name": ref["name"], "namespace": ref.get("namespace") or _meta(pvc)["namespace"]}
        source["nodeStageSecretRef"] = dict(secret)
        source["nodePublishSecretRef"] = dict(secret)
    annotations = _annotations(pv)
    if ANN_PROVISIONED_BY in annotations:
        annotations[ANN_PROVISIONED_BY] = CSI_DRIVER
    annotations[ANN_CONVERTED_FROM] = _meta(pvc)["uid"]
    annotations[ANN_RECLAIM_POLICY] = spec.get("persistentVolumeReclaimPolicy") or "Retain"
    new_spec: dict[str, Any] = {
        "capacity": dict(spec["capacity"]),
        "accessModes": list(spec.get("accessModes") or ["ReadWriteOnce"]),
        "persistentVolumeReclaimPolicy": "Retain",
        "volumeMode": spec.get("volumeMode") or "Filesystem",
        "claimRef": {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "namespace": _meta(pvc)["namespace"],
            "name": _meta(pvc)["name"],
            "uid": new_claim_uid,
        },
        "csi": source,
    }
    sc = storage_class or spec.get("storageClassName") or ""
    if sc:
        new_spec["storageClassName"] = sc
    if mount_options or spec.get("mountOptions"):
        new_spec["mountOptions"] = [*spec.get("mountOptions", []), *mount_options]
    if spec.get("nodeAffinity"):
        new_spec["nodeAffinity"] = copy.deepcopy(spec["nodeAffinity"])
    metadata: dict[str, Any] = {"name": _meta(pv)["name"], "annotations": annotations}
    if _meta(pv).get("labels"):
        metadata["labels"] = dict(_meta(pv)["labels"])
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": metadata, "spec": new_spec}


def _claim(
    pvc: Mapping[str, Any], volume: str, storage_class: str, annotations: dict[str, str]
) -> dict[str, Any]:
    spec = pvc.get("spec") or {}
    new_spec: dict[str, Any] = {
        "accessModes": list(spec.get("accessModes") or ["ReadWriteOnce"]),
        "resources": copy.deepcopy(spec.get("resources") or {}),
        "volumeMode": spec.get("volumeMode") or "Filesystem",
        "volumeName": volume,
    }
    if storage_class:
        new_spec["storageClassName"] = storage_class
    elif "storageClassName" in spec:
        new_spec["storageClassName"] = spec["storageClassName"]  # "" (no class) stays ""
    if spec.get("selector"):
        new_spec["selector"] = copy.deepcopy(spec["selector"])
    metadata: dict[str, Any] = {
        "name": _meta(pvc)["name"],
        "namespace": _meta(pvc)["namespace"],
        "annotations": annotations,
    }
    if _meta(pvc).get("labels"):
        metadata["labels"] = dict(_meta(pvc)["labels"])
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata,
        "spec": new_spec,
    }


def csi_claim(
    pvc: Mapping[str, Any], pv: Mapping[str, Any], storage_class: str = ""
) -> dict[str, Any]:
    """The claim replacing ``pvc``: same name, spec and metadata, naming the PV by name."""
    check_flex_pair(pv, pvc)
    annotations = _annotations(pvc)
    for key in _STORAGE_PROVISIONER:
        if key in annotations:
            annotations[key] = CSI_DRIVER
    annotations[ANN_CONVERTED_FROM] = _meta(pvc)["uid"]
    return _claim(pvc, _meta(pv)["name"], storage_class, annotations)


def flex_claim(saved_pvc: Mapping[str, Any], saved_pv: Mapping[str, Any]) -> dict[str, Any]:
    """The FlexVolume claim as saved, to write back on rollback."""
    annotations = _annotations(saved_pvc)
    annotations[ANN_CONVERTED_FROM] = _meta(saved_pvc)["uid"]
    return _claim(saved_pvc, _meta(saved_pv)["name"], "", annotations)


def flex_pv(saved_pv: Mapping[str, Any], new_claim_uid: str) -> dict[str, Any]:
    """The FlexVolume PV as saved, pre-bound to the rolled-back claim's uid, with its
    original reclaim policy and finalizers (the FlexVolume provisioner's among them)."""
    spec = copy.deepcopy(dict(saved_pv["spec"]))
    ref = dict(spec.get("claimRef") or {})
    spec["claimRef"] = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "namespace": ref.get("namespace"),
        "name": ref.get("name"),
        "uid": new_claim_uid,
    }
    meta = _meta(saved_pv)
    metadata: dict[str, Any] = {"name": meta["name"], "annotations": _annotations(saved_pv)}
    if meta.get("labels"):
        metadata["labels"] = dict(meta["labels"])
    finalizers = [f for f in meta.get("finalizers") or [] if f == FLEX_FINALIZER]
    if finalizers:
        metadata["finalizers"] = finalizers
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": metadata, "spec": spec}


def saved_text(obj: Mapping[str, Any]) -> str:
    """An object as saved in the backup (JSON, keys sorted; status left out)."""
    return json.dumps({k: v for k, v in obj.items() if k != "status"}, sort_keys=True)
