"""The PV half of the provisioner's controller: a Released PV's storage reclaimed (here, or
by its node's agent), a bound claim's storage grown, each only on a PV this provisioner
sealed. :class:`~flexhub.provisioner.controller.Controller` is this plus the claim half and
the loop.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from flexhub.errors import FlexhubError, InvalidOptions
from flexhub.provisioner import pvs
from flexhub.provisioner.events import CountingRecorder
from flexhub.provisioner.pvapi import (
    backend_record,
    event_text,
    finish_reclaim,
    get,
    pointer,
    read_record,
    remove_finalizer,
    seconds_since,
)
from flexhub.provisioner.seal import ANN_SEAL, Sealer, sealed_content
from flexhub.provisioning import Provisioning
from flexhub.volume import Secrets

LOG = logging.getLogger(__name__)

__all__ = [
    "MISTAKE_RETRY",
    "NODE_AGENT_GRACE",
    "NODE_GONE_RETRY",
    "SECRET_TYPE",
    "Later",
    "Volumes",
]

#: The type kubelet demands of a FlexVolume PV's Secret: the driver's name.
SECRET_TYPE = "k8s/flexhub"
#: How soon a claim whose StorageClass is wrong is looked at again.
MISTAKE_RETRY = 60.0
#: How often a released PV whose node is gone is reported again.
NODE_GONE_RETRY = 600.0
#: How long a PV reclaimed on its node may stay Released before the provisioner says that
#: no node agent seems to run there.
NODE_AGENT_GRACE = 600.0


class Later(Exception):
    """Look at this key again in ``seconds`` (a mistake an operator fixes, a grace period),
    not with the error backoff."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"again in {seconds:.0f} s")
        self.seconds = seconds


class Volumes:
    """What the controller does with PVs; its state is the controller's."""

    api: Any
    core: Any
    storage: Any
    sealer: Sealer
    events: CountingRecorder
    backend_for: Callable[[str], Provisioning]
    name: str
    #: when this instance first saw a node-reclaimed PV Released (by name)
    _released: dict[str, float]

    def _ours(self, pv: Mapping[str, Any]) -> bool:
        annotations = pv["metadata"].get("annotations") or {}
        return (
            annotations.get(pvs.ANN_PROVISIONED_BY) == self.name and pvs.ANN_RECLAIM in annotations
        )

    def sync_volume(self, name: str) -> None:
        pv = self._get(self.core.read_persistent_volume, name)
        if pv is None or (pv.get("status") or {}).get("phase") != "Released":
            self._released.pop(name, None)
        if pv is None or not self._ours(pv):
            return
        if pvs.FINALIZER not in (pv["metadata"].get("finalizers") or []):
            return
        if pv["spec"].get("persistentVolumeReclaimPolicy") != "Delete":
            remove_finalizer(self.core, pv)  # Retain now: the storage stays, so may the PV go
            return
        if (pv.get("status") or {}).get("phase") != "Released":
            return
        record = read_record(pv)
        where = record.get("reclaimOn", "")
        if where not in ("provisioner", "node"):
            # a record this version does not know (a newer flexhub's, or an edited one):
            # reclaiming it here could remove storage the way its writer never meant
            self.events.volume(
                pv,
                "Warning",
                "VolumeFailedDelete",
                f"reclaim record names reclaimOn {where[:40]!r}: this flexhub does not know "
                "where to reclaim it (upgrade the provisioner)",
            )
            raise Later(MISTAKE_RETRY)
        if where == "node":
            node = record.get("node", "")
            if self._label_node(pv, node):
                raise Later(NODE_AGENT_GRACE)  # its agent sees it only now: its grace first
            if self._get(self.core.read_node, node) is None:
                self.events.volume(
                    pv,
                    "Warning",
                    "NodeGone",
                    f"node {node!r} is gone: the storage on it was not "
                    "reclaimed; the PV stays Released until you delete it",
                )
                raise Later(NODE_GONE_RETRY)
            self._agent_overdue(pv, node)
            return  # the flexhub pod of that node reclaims it
        self._check_seal(pv, "reclaim its storage")
        backend = self.backend_for(record["backend"])
        options = dict(pv["spec"]["flexVolume"].get("options") or {})
        try:
            backend.reclaim(options, backend_record(pv), self._volume_secrets(pv, record))
        except FlexhubError as exc:
            self.events.volume(pv, "Warning", "VolumeFailedDelete", event_text(exc))
            raise
        finish_reclaim(self.core, pv)
        LOG.info("reclaimed %s (%s, onDelete %s)", name, record["backend"], record["onDelete"])

    def _label_node(self, pv: Mapping[str, Any], node: str) -> bool:
        """Label a node-reclaimed PV with its node (one made before PVs were labelled), so
        that its node's agent, which watches only its own node's label, sees it; whether it
        was labelled now."""
        wanted = pvs.node_label(node)
        if (pv["metadata"].get("labels") or {}).get(pvs.NODE_LABEL) == wanted or not node:
            return False
        self.core.patch_persistent_volume(
            pv["metadata"]["name"],
            {"metadata": {"labels": {pvs.NODE_LABEL: wanted}}},
            _request_timeout=30,
        )
        return True

    def _agent_overdue(self, pv: Mapping[str, Any], node: str) -> None:
        """A PV its node's agent should have reclaimed long ago: never a silent leak (no agent
        there: ``nodeAgent.enabled`` off, or the node outside the DaemonSet's selector)."""
        since = seconds_since((pv.get("status") or {}).get("lastPhaseTransitionTime"))
        if since is None:  # an API server without the field: since this instance saw it
            first = self._released.setdefault(pv["metadata"]["name"], time.monotonic())
            since = time.monotonic() - first
        if since < NODE_AGENT_GRACE:
            raise Later(NODE_AGENT_GRACE - since + 1)
        self.events.volume(
            pv,
            "Warning",
            "NodeAgentMissing",
            f"Released {since / 60:.0f} min ago and not reclaimed: no flexhub node agent "
            f"reclaims on node {node!r} (is nodeAgent enabled, and does the flexhub "
            "DaemonSet run on that node?)",
        )
        raise Later(NODE_GONE_RETRY)

    def _volume_secrets(self, pv: Mapping[str, Any], record: Mapping[str, str]) -> Secrets:
        """The Secret the storage side authenticates with: the class's, named in the record
        (the class may be gone; iSCSI's holds the target host's key, which nodes never get),
        else the one the PV's ``secretRef`` names."""
        ref: Mapping[str, str] | None = pv["spec"]["flexVolume"].get("secretRef")
        if record.get("classSecret"):
            namespace, _, name = record["classSecret"].partition("/")
            ref = {"namespace": namespace, "name": name}
        if not ref:
            return Secrets()
        secret = self._get(
            self.core.read_namespaced_secret, ref["name"], ref.get("namespace") or "default"
        )
        if secret is None:
            raise FlexhubError(f"Secret {ref.get('namespace')}/{ref['name']} not found")
        if secret.get("type") != SECRET_TYPE:
            # kubelet mounts a PV only with a Secret of the driver's type: a secretRef naming
            # another (a hand-edited PV) must not hand an unrelated Secret to a backend
            raise FlexhubError(
                f"Secret {ref.get('namespace')}/{ref['name']} has type "
                f"{str(secret.get('type'))[:80]!r}, not {SECRET_TYPE!r}: refusing to reclaim"
            )
        return Secrets(encoded=dict(secret.get("data") or {}))

    def _expand(self, pvc: Mapping[str, Any]) -> None:
        """Grow storage the provisioner holds (a LUN) when its claim asks for more.

        Only for the claim the PV is bound to (``claimRef``: namespace, name and uid; any
        claim may name any PV in ``spec.volumeName``), of a class that allows expansion, and
        for a PV that still carries this provisioner's seal. For every backend, a growth past
        the bound the PV carries (the backend's ``check_expansion``: loopfile's ``maxSize``)
        is an ``ExpansionRefused`` Event on the claim."""
        volume = pvc["spec"]["volumeName"]
        pv = self._get(self.core.read_persistent_volume, volume)
        if pv is None or not self._ours(pv):
            return
        record = read_record(pv)
        backend = self.backend_for(record["backend"])
        meta = pvc["metadata"]
        ref = pv["spec"].get("claimRef") or {}
        if (ref.get("namespace"), ref.get("name"), ref.get("uid")) != (
            meta["namespace"],
            meta["name"],
            meta["uid"],
        ) or (pv.get("status") or {}).get("phase") != "Bound":
            return  # not this claim's volume: another tenant's, or not bound to it yet
        wanted = pvs.claim_from(pvc).size
        if wanted <= int(record.get("size", "0")):
            return
        options = dict(pv["spec"]["flexVolume"].get("options") or {})
        try:
            check = getattr(backend, "check_expansion", None)  # Provisioning's (a no-op)
            if check is not None:
                check(options, wanted)
        except InvalidOptions as exc:
            # the node's expandfs refuses it too (it reads the same options): said early here
            self.events.claim(pvc, "Warning", "ExpansionRefused", event_text(exc))
            raise Later(MISTAKE_RETRY) from None
        if not getattr(backend, "expands_storage", False):
            return  # the node grows it (a loop file), or nothing enforces its size (NFS)
        class_name = pvc["spec"].get("storageClassName") or ""
        sc = self._get(self.storage.read_storage_class, class_name) if class_name else None
        if (
            sc is None
            or not sc.get("allowVolumeExpansion")
            or class_name != pv["spec"].get("storageClassName")
        ):
            self.events.claim(
                pvc,
                "Warning",
                "ExpansionRefused",
                f"StorageClass {class_name[:80]!r} does not allow volume expansion",
            )
            raise Later(MISTAKE_RETRY)
        self._check_seal(pv, "grow its storage")
        secrets = self._volume_secrets(pv, record)
        grown = backend.expand_storage(options, backend_record(pv), wanted, secrets)
        record["size"] = str(max(grown, wanted))
        self._reseal(pv, record)
        self.events.claim(
            pvc,
            "Normal",
            "StorageExpanded",
            f"flexhub grew the {record['backend']} storage to {pvs.quantity(grown)}",
        )

    def _reseal(self, pv: Mapping[str, Any], record: Mapping[str, str]) -> None:
        """Write the grown ``record`` and seal it again, only onto a PV whose sealed fields
        are still as read before the growth (which may take long): other fields (the
        controller-manager's capacity, the status) may change meanwhile; an administrator's
        fix (sealed again) may not be rolled back, so then this raises and the next sync
        reads it again (and grows again: a no-op)."""
        from kubernetes.client.rest import ApiException

        before = sealed_content(pv)
        text = json.dumps(record, sort_keys=True)
        name = pv["metadata"]["name"]
        for _ in range(5):
            annotations = {**(pv["metadata"].get("annotations") or {}), pvs.ANN_RECLAIM: text}
            resealed = {**pv, "metadata": {**pv["metadata"], "annotations": annotations}}
            patch = [
                {
                    "op": "test",
                    "path": "/metadata/resourceVersion",
                    "value": pv["metadata"]["resourceVersion"],
                },
                {"op": "add", "path": f"/metadata/annotations/{pointer(pvs.ANN_RECLAIM)}",
                 "value": text},
                {"op": "add", "path": f"/metadata/annotations/{pointer(ANN_SEAL)}",
                 "value": self.sealer.seal(resealed)},
            ]  # fmt: skip
            try:
                self.core.patch_persistent_volume(name, patch, _request_timeout=30)
                return
            except ApiException as exc:
                if exc.status not in (409, 422):  # a failed JSON-patch test is a 422
                    raise
            fresh = self._get(self.core.read_persistent_volume, name)
            if fresh is None or sealed_content(fresh) != before:
                raise FlexhubError(
                    f"PV {name} changed while its storage grew: read again, grown again"
                )
            pv = fresh
        raise FlexhubError(f"PV {name}: it changes under every try; sealed again later")

    def _check_seal(self, pv: Mapping[str, Any], what: str) -> None:
        """Refuse (an Event, a slow retry) to act with the provisioner's rights on a PV whose
        record or options are not what this provisioner wrote and sealed."""
        if self.sealer.sealed(pv):
            return
        self.events.volume(
            pv,
            "Warning",
            "VolumeUnsealed",
            f"flexhub will not {what}: the PV's options or reclaim record are not as this "
            "provisioner wrote them (edited, or written by a flexhub that did not seal its PVs); "
            f"check them, then run: flexhub provisioner-seal {pv['metadata']['name']} "
            "--namespace <the provisioner's>",
        )
        raise Later(NODE_GONE_RETRY)

    # ----------------------------------------------------------------------------- API

    def _get(self, read: Callable[..., Any], *args: str) -> dict[str, Any] | None:
        return get(self.api, read, *args)
