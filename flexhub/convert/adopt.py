"""The reclaim policy across a convert: the record that lets the CSI controller reclaim a
converted volume, and the checks before convert writes it.

The CSI controller reclaims only volumes it holds a record of. For a FlexVolume PV the
FlexVolume provisioner made (its ``flexhub/reclaim`` record under the provisioner's seal) and
whose policy is ``Delete``, convert writes that record (:func:`record_body`: the ConfigMap
``flexhub-volume-<uid>`` of flexhub's namespace, read by :mod:`flexhub.csi.adopted`) before
the CSI PV exists, and gives the CSI PV its ``Delete`` back once it is bound. The record is
built from the saved FlexVolume PV, and only when its seal holds: the provisioner's own check
before it acts with its rights (:mod:`flexhub.provisioner.seal`), since the CSI controller
will act on the record with its own.

A PV without a reclaim record (written by hand: no FlexVolume provisioner ever reclaimed it)
keeps ``Retain`` under CSI, as does one whose policy was ``Retain``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from flexhub.errors import ConvertError, FlexhubError

__all__ = [
    "ANN_DELETION_SECRET_NAME",
    "ANN_DELETION_SECRET_NAMESPACE",
    "CONTROLLER_LEASE",
    "adopt_into",
    "check_controller",
    "check_sealed",
    "reclaimed",
    "record_body",
]

#: The PV annotations external-provisioner reads the Secret of ``DeleteVolume`` from.
ANN_DELETION_SECRET_NAME = "volume.kubernetes.io/provisioner-deletion-secret-name"
ANN_DELETION_SECRET_NAMESPACE = "volume.kubernetes.io/provisioner-deletion-secret-namespace"
#: The FlexVolume provisioner's own keys of a reclaim record (the rest is the backend's).
_PROVISIONER_KEYS = ("backend", "reclaimOn", "node", "size", "classSecret")


def _annotations(pv: Mapping[str, Any]) -> Mapping[str, Any]:
    return (pv.get("metadata") or {}).get("annotations") or {}


def reclaimed(pv: Mapping[str, Any]) -> bool:
    """Whether the FlexVolume PV ``pv`` is one its storage goes with: ``Delete``, with the
    FlexVolume provisioner's reclaim record."""
    from flexhub.provisioner.pvs import ANN_RECLAIM

    spec = pv.get("spec") or {}
    return spec.get("persistentVolumeReclaimPolicy") == "Delete" and bool(
        _annotations(pv).get(ANN_RECLAIM)
    )


def check_sealed(pv: Mapping[str, Any], key: bytes | None) -> None:
    """Refuse (one line) a :func:`reclaimed` PV the provisioner's seal under ``key`` does
    not cover as it is now (``key`` ``None``: flexhub's namespace holds no sealing key)."""
    from flexhub.provisioner.seal import KEY_SECRET, Sealer

    name = (pv.get("metadata") or {}).get("name", "")
    fix = (
        "check its options and reclaim record, then seal it (flexhub provisioner-seal), or "
        "set its reclaim policy to Retain, and run flexhub convert again"
    )
    if key is None:
        raise ConvertError(
            f"PV {name} is reclaimed on delete, and flexhub's namespace holds no sealing key "
            f"(Secret {KEY_SECRET}) to check its reclaim record with: {fix}"
        )
    if not Sealer(key).sealed(pv):
        raise ConvertError(
            f"PV {name} is reclaimed on delete, and its reclaim record or options are not "
            f"under the provisioner's seal (edited since it was made?): {fix}"
        )


#: The Lease csi-provisioner holds in the CSI controller's namespace (its leader election,
#: named from the driver: ``flexhub.csi.k8s.io`` with dashes).
CONTROLLER_LEASE = "flexhub-csi-k8s-io"


#: Seconds since csi-provisioner last renewed its Lease beyond which no controller is taken
#: to run (it renews every 26 s at the most by default, and holds it 137 s).
LEASE_FRESH = 600.0


def check_controller(pv: Mapping[str, Any], namespace: str, age: float | None) -> None:
    """Refuse (one line) to hand a :func:`reclaimed` PV to CSI when no CSI controller runs
    in ``namespace``: its csi-provisioner's Lease :data:`CONTROLLER_LEASE` is not there or
    was last renewed ``age`` seconds ago, more than :data:`LEASE_FRESH` (a Lease outlives an
    uninstalled controller). The record would be read by none, and Delete would leave the
    storage behind."""
    if age is None or age > LEASE_FRESH:
        name = (pv.get("metadata") or {}).get("name", "")
        raise ConvertError(
            f"PV {name} is reclaimed on delete, and no CSI controller of flexhub runs in "
            f"namespace {namespace} (no Lease {CONTROLLER_LEASE} of its csi-provisioner renewed "
            f"in the last {LEASE_FRESH:.0f} s) to "
            "read its record: install CSI mode there, or pass --backup-namespace with the "
            "namespace it runs in, or set the PV's reclaim policy to Retain; then run "
            "flexhub convert again"
        )


def _record(pv: Mapping[str, Any], pvc: Mapping[str, Any], handle: str) -> dict[str, Any]:
    """The CSI controller's record of the converted volume (:mod:`flexhub.csi.records`)."""
    from flexhub.provisioner.pvapi import backend_record
    from flexhub.provisioner.pvs import parse_quantity

    try:
        found = backend_record(pv)
    except FlexhubError as exc:
        raise ConvertError(exc.message) from None
    flex = pv["spec"]["flexVolume"]
    options = {str(k): str(v) for k, v in (flex.get("options") or {}).items()}
    if found.get("backend") != options.get("backend"):
        raise ConvertError(
            f"PV {pv['metadata']['name']}: its reclaim record's backend is not its options'"
        )
    if found.get("reclaimOn", "") not in ("node", "provisioner"):
        # as the FlexVolume provisioner refuses it: a writer it does not know meant another way
        raise ConvertError(
            f"PV {pv['metadata']['name']}: its reclaim record's reclaimOn "
            f"{found.get('reclaimOn', '')[:40]!r} is not node or provisioner: not handed to CSI"
        )
    try:
        size = int(found.get("size") or parse_quantity(str(pv["spec"]["capacity"]["storage"])))
    except (ValueError, KeyError):
        raise ConvertError(f"PV {pv['metadata']['name']}: its size is not a number") from None
    return {
        "name": pv["metadata"]["name"],
        "volume_id": handle,
        "backend": options["backend"],
        "parameters": {},
        "options": options,
        "reclaim": {k: v for k, v in found.items() if k not in _PROVISIONER_KEYS},
        "size": size,
        "fs_type": str(flex.get("fsType") or ""),
        "node": found.get("node", ""),
        "namespace": pvc["metadata"]["namespace"],
        "source": "",
    }


def record_body(pv: Mapping[str, Any], pvc: Mapping[str, Any], handle: str) -> dict[str, Any]:
    """The ConfigMap holding the record of the volume ``handle`` (``<backend>:<uid>``)."""
    from flexhub.csi.records import (
        ADOPTION_LABELS,
        ADOPTION_RECORD_KEY,
        adoption_name,
        uid_of_volume,
    )

    record = _record(pv, pvc, handle)
    meta = pvc["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": adoption_name(uid_of_volume(handle)),
            "labels": dict(ADOPTION_LABELS),
            "annotations": {
                "flexhub/volume": handle,
                "flexhub/converted-claim": f"{meta['namespace']}/{meta['name']}",
            },
        },
        "data": {ADOPTION_RECORD_KEY: json.dumps(record, sort_keys=True)},
    }


def adopt_into(csi_pv: dict[str, Any], pv: Mapping[str, Any]) -> None:
    """Make the CSI PV ``csi_pv`` external-provisioner's to delete: its ``provisioned-by``,
    and the Secret of ``DeleteVolume`` (annotations) and of ``ControllerExpandVolume``
    (``spec.csi``): the one the FlexVolume provisioner reclaims and grows with, the class
    Secret its reclaim record names, else the PV's ``secretRef`` (both under the seal)."""
    from flexhub.convert.plan import ANN_PROVISIONED_BY, CSI_DRIVER
    from flexhub.provisioner.pvapi import read_record

    annotations = csi_pv["metadata"].setdefault("annotations", {})
    annotations[ANN_PROVISIONED_BY] = CSI_DRIVER
    try:
        secret = read_record(pv).get("classSecret", "")
    except FlexhubError as exc:
        raise ConvertError(exc.message) from None
    ref = pv["spec"]["flexVolume"].get("secretRef") or {}
    if not secret and ref.get("name"):  # the provisioner's own default namespace
        secret = f"{ref.get('namespace') or 'default'}/{ref['name']}"
    namespace, _, name = secret.partition("/")
    if namespace and name:
        annotations[ANN_DELETION_SECRET_NAMESPACE] = namespace
        annotations[ANN_DELETION_SECRET_NAME] = name
        csi_pv["spec"]["csi"]["controllerExpandSecretRef"] = {
            "namespace": namespace,
            "name": name,
        }
