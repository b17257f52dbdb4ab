"""The provisioner's control loop: claims become PVs, released PVs give their storage back.

Two watches (claims, PVs) feed one work queue; one worker syncs one key at a time, reading
the object fresh from the API server before it acts (never from a cache that may be stale).
A sync that fails is retried with per-key backoff; a claim with a StorageClass mistake is
retried slowly (an operator fixes the class, the claim then provisions).

Safe without the leader election (``--leader-elect=false``, or two leaders during a handover):
the PV is named ``pvc-<claim uid>``, a backend's provision finds what an earlier one made for
that uid, a PV that already exists (AlreadyExists) counts as done, a failed PV save is
retried (the storage is never deleted for it), and a PV's storage is reclaimed only while the
PV holds flexhub's finalizer, which is removed after the backend confirmed the reclaim.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from flexhub.errors import FlexhubError, InvalidOptions
from flexhub.node.checkpoints import checkpoint
from flexhub.provisioner import pvs
from flexhub.provisioner.events import CountingRecorder
from flexhub.provisioner.pvapi import (
    CLAIM_FINALIZER,
    api_reason,
    backend_record,
    event_text,
    finish_reclaim,
    get,
    hold_claim,
    let_claim_go,
    pointer,
    read_record,
    remove_finalizer,
    seconds_since,
)
from flexhub.provisioner.queue import WorkQueue, watch_forever
from flexhub.provisioner.seal import ANN_SEAL, Sealer, sealed_content
from flexhub.provisioning import Claim, Provisioned, Provisioning
from flexhub.volume import Secrets

LOG = logging.getLogger(__name__)

__all__ = ["DRIVER", "Controller"]

DRIVER = "k8s/flexhub"
#: The type kubelet demands of a FlexVolume PV's Secret: the driver's name.
SECRET_TYPE = DRIVER
#: How soon a claim whose StorageClass is wrong is looked at again.
MISTAKE_RETRY = 60.0
#: How often a released PV whose node is gone is reported again.
NODE_GONE_RETRY = 600.0
#: How long a PV reclaimed on its node may stay Released before the provisioner says that
#: no node agent seems to run there.
NODE_AGENT_GRACE = 600.0
#: How many keys are synced at once (one key never twice at once).
WORKERS = 4
#: A node name as the API server accepts one (a DNS subdomain).
_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class Controller:
    """Provision and reclaim for the StorageClasses whose ``provisioner`` is ``name``."""

    def __init__(
        self,
        api: Any,
        backend_for: Callable[[str], Provisioning],
        read_class: Callable[[Mapping[str, Any]], Any],
        name: str = "flexhub",
        driver: str = DRIVER,
        identity: str = "",
        *,
        sealer: Sealer,
        core: Any = None,
        storage: Any = None,
        workers: int = WORKERS,
    ) -> None:
        """:param sealer: seals the PVs this provisioner writes and checks them before it acts
            on one with its own rights (:mod:`flexhub.provisioner.seal`).
        :param core, storage: the API groups (default: the kubernetes client's over ``api``).
        """
        from kubernetes import client

        self.api = api
        self.core = client.CoreV1Api(api) if core is None else core
        self.storage = client.StorageV1Api(api) if storage is None else storage
        self.sealer = sealer
        self.workers = workers
        #: when this instance first saw a node-reclaimed PV Released (by name)
        self._released: dict[str, float] = {}
        self.backend_for = backend_for
        self.read_class = read_class
        self.name = name
        self.driver = driver
        self.events = CountingRecorder(
            self.core, component=f"{name}-provisioner", instance=identity
        )
        self.queue = WorkQueue()
        self.stop = threading.Event()

    # ----------------------------------------------------------------------------- loop

    def feed(self) -> list[threading.Thread]:
        """Start the watches (daemon threads) that queue claim and PV keys."""
        feeders = [
            (
                "claims",
                self.core.list_persistent_volume_claim_for_all_namespaces,
                lambda o: (
                    f"claim/{o['metadata']['namespace']}/{o['metadata']['name']}"
                    if isinstance(o, dict)
                    else f"claim/{o.metadata.namespace}/{o.metadata.name}"
                ),
            ),
            (
                "volumes",
                self.core.list_persistent_volume,
                lambda o: (
                    f"volume/{o['metadata']['name']}"
                    if isinstance(o, dict)
                    else f"volume/{o.metadata.name}"
                ),
            ),
        ]
        threads = []
        for what, list_fn, key_of in feeders:
            thread = threading.Thread(
                target=watch_forever,
                name=f"watch-{what}",
                daemon=True,
                args=(list_fn, self._queue_key, key_of, self.stop, what),
            )
            thread.start()
            threads.append(thread)
        return threads

    def _queue_key(self, key: str, event: object) -> None:
        """A watch event queues its key now; a (re)list queues only keys not waiting already,
        so that a key in backoff keeps it."""
        if event is None:
            self.queue.add_listed(key)
        else:
            self.queue.add(key)

    def run(self, leading: threading.Event | None = None) -> None:
        """Sync keys with :attr:`workers` threads until :attr:`stop` is set: a long call
        (a LUN zeroed, a large tree removed) holds one worker, not the cluster."""
        threads = [
            threading.Thread(target=self._work, args=(leading,), name=f"worker-{n}", daemon=True)
            for n in range(max(1, self.workers) - 1)
        ]
        for thread in threads:
            thread.start()
        self._work(leading)
        for thread in threads:
            thread.join()

    def _work(self, leading: threading.Event | None) -> None:
        while not self.stop.is_set():
            key = self.queue.get(timeout=1)
            if key is None:
                continue
            try:
                if leading is not None and not leading.is_set():
                    self.queue.add(key, 1)
                    continue
                self.sync(key)
            finally:
                self.queue.done(key)

    def sync(self, key: str) -> None:
        kind, _, rest = key.partition("/")
        try:
            if kind == "claim":
                namespace, _, name = rest.partition("/")
                self.sync_claim(namespace, name)
            else:
                self.sync_volume(rest)
        except _Later as later:
            self.queue.add(key, later.seconds)
            return
        except Exception as exc:
            delay = self.queue.retry(key)
            LOG.warning("%s: %s (again in %.0f s)", key, event_text(exc), delay)
            return
        self.queue.forget(key)

    # ----------------------------------------------------------------------------- claims

    def _owns_claim(self, pvc: Mapping[str, Any]) -> bool:
        annotations = pvc["metadata"].get("annotations") or {}
        wanted = annotations.get(pvs.ANN_STORAGE_PROVISIONER) or annotations.get(
            pvs.ANN_STORAGE_PROVISIONER_BETA
        )
        return wanted == self.name

    def sync_claim(self, namespace: str, name: str) -> None:
        pvc = self._get(self.core.read_namespaced_persistent_volume_claim, name, namespace)
        if pvc is None:
            return
        uid = pvc["metadata"]["uid"]
        holding = CLAIM_FINALIZER in (pvc["metadata"].get("finalizers") or [])
        if pvc["metadata"].get("deletionTimestamp"):
            if holding:
                self._undo(pvc)
            return
        if pvc["spec"].get("volumeName"):
            if holding and pvc["spec"]["volumeName"] == f"pvc-{uid}":
                let_claim_go(self.core, pvc)  # saved before a crash, bound since
            self._expand(pvc)
            return
        if not self._owns_claim(pvc):
            return
        source = pvc["spec"].get("dataSourceRef") or pvc["spec"].get("dataSource")
        if self._get(self.core.read_persistent_volume, f"pvc-{uid}") is not None:
            if holding:
                let_claim_go(self.core, pvc)
            return  # made already (by us before a crash, or by another instance)
        class_name = pvc["spec"].get("storageClassName") or ""
        sc = self._get(self.storage.read_storage_class, class_name) if class_name else None
        if sc is None:
            self._failed(pvc, f"StorageClass {class_name!r} not found")
        if sc.get("provisioner") != self.name:
            return
        if source:
            # a clone, a snapshot's restore or a populator's volume: made empty, it would
            # start the application on an empty disk and report success
            self._failed(
                pvc,
                f"the claim asks for a copy of {str(source.get('kind'))[:40]} "
                f"{str(source.get('name'))[:80]!r} (dataSource): flexhub's FlexVolume "
                "provisioner makes empty volumes only",
            )
        if pvc["spec"].get("selector"):
            self._failed(
                pvc, "the claim has a selector: flexhub provisions only claims without one"
            )
        try:
            spec = self.read_class(sc)
            if pvc["spec"].get("volumeMode") == "Block":
                raise InvalidOptions(
                    "flexhub volumes are filesystems: volumeMode Block is not supported"
                )
            claim = pvs.claim_from(pvc)
        except InvalidOptions as exc:
            self._failed(pvc, str(exc))
        if sc.get("volumeBindingMode") == "WaitForFirstConsumer" and not claim.selected_node:
            return  # the scheduler has not picked a node yet
        if claim.selected_node:
            self._check_node(pvc, claim.selected_node, sc.get("allowedTopologies") or [])
        secrets = self._class_secrets(pvc, spec)
        self.events.claim(
            pvc,
            "Normal",
            "Provisioning",
            f"flexhub is provisioning a {spec.backend} volume for the claim",
        )
        backend = self.backend_for(spec.backend)
        # from here until the PV is saved, storage may exist that no PV names: a claim
        # deleted meanwhile waits for _undo to remove it
        pvc = hold_claim(self.api, self.core, pvc)
        try:
            made = backend.provision(claim, spec.parameters, secrets)
        except InvalidOptions as exc:
            self._failed(pvc, str(exc))
        except FlexhubError as exc:
            self.events.claim(pvc, "Warning", "ProvisioningFailed", event_text(exc))
            raise
        checkpoint("provisioner-made")  # test hook: a crash between the storage and the PV
        pv = self._pv(claim, sc, spec, made)
        if pv["spec"]["flexVolume"].get("secretRef"):
            ref = pv["spec"]["flexVolume"]["secretRef"]
            self._check_pv_secret(pvc, (ref["namespace"], ref["name"]))
        pv["metadata"]["annotations"][ANN_SEAL] = self.sealer.seal(pv)
        from kubernetes.client.rest import ApiException

        try:
            self.core.create_persistent_volume(pv, _request_timeout=30)
        except ApiException as exc:
            if exc.status in (400, 403, 422):
                # the API server (or an admission webhook) refuses this PV and will refuse it
                # again: its reason,
                # and a slow retry (the storage stays; a PV saved later finds it)
                self._failed(pvc, f"the API server refused the PV: {api_reason(exc)}")
            if exc.status != 409:
                raise  # retried: provision finds the same storage, nothing is deleted
            LOG.info("PV %s exists already: done", pv["metadata"]["name"])
            let_claim_go(self.core, pvc)
            return
        LOG.info("provisioned %s for claim %s/%s", pv["metadata"]["name"], namespace, name)
        let_claim_go(self.core, pvc)
        self.events.claim(
            pvc,
            "Normal",
            "ProvisioningSucceeded",
            f"Successfully provisioned volume {pv['metadata']['name']}",
        )

    def _pv(
        self, claim: Claim, sc: Mapping[str, Any], spec: Any, made: Provisioned
    ) -> dict[str, Any]:
        """The PV of ``claim`` for what its backend ``made`` (not sealed yet)."""
        if made.secret is None and spec.secret is not None:
            made = made.replace(secret=spec.secret)  # the class's Secret
        return pvs.build_pv(
            claim,
            sc["metadata"]["name"],
            sc.get("reclaimPolicy") or "Delete",
            spec.backend,
            spec.on_delete,
            spec.reclaim_on,
            made,
            self.driver,
            self.name,
            self._hostname(made.node) if made.node else "",
            spec.secret,
        )

    def _undo(self, pvc: Mapping[str, Any]) -> None:
        """A claim deleted while it holds :data:`CLAIM_FINALIZER`: its storage may have been
        made without a PV being saved (the provisioner killed in between, the PV refused).
        What its backend made for it is found again (a backend's provision finds what an
        earlier call made for the claim's uid) and reclaimed as its PV would have been, then
        the claim may go. With a PV saved, the PV's own reclaim takes care of the storage."""
        meta = pvc["metadata"]
        where = f"claim {meta['namespace']}/{meta['name']}"
        if self._get(self.core.read_persistent_volume, f"pvc-{meta['uid']}") is not None:
            let_claim_go(self.core, pvc)
            return
        class_name = pvc["spec"].get("storageClassName") or ""
        sc = self._get(self.storage.read_storage_class, class_name) if class_name else None
        try:
            if sc is None or sc.get("provisioner") != self.name:
                raise InvalidOptions(f"StorageClass {class_name[:80]!r} is gone")
            spec = self.read_class(sc)
            claim = pvs.claim_from(pvc)
        except InvalidOptions as exc:
            self._leftover(pvc, exc)
            return
        if spec.reclaim_on != "provisioner" or (sc.get("reclaimPolicy") or "Delete") != "Delete":
            let_claim_go(self.core, pvc)  # made on its node at a first mount, or kept by policy
            return
        secrets = self._class_secrets(pvc, spec)
        backend = self.backend_for(spec.backend)
        try:
            try:
                made = backend.provision(claim, spec.parameters, secrets)
            except InvalidOptions as exc:  # refused as it was at provisioning: none made
                self._leftover(pvc, exc)
                return
            pv = self._pv(claim, sc, spec, made)
            backend.reclaim(
                dict(pv["spec"]["flexVolume"].get("options") or {}),
                backend_record(pv),
                self._volume_secrets(pv, read_record(pv)),
            )
        except FlexhubError as exc:
            self.events.claim(pvc, "Warning", "ProvisioningLeftover", event_text(exc))
            raise
        LOG.info(
            "%s deleted before its PV was saved: its %s storage reclaimed", where, spec.backend
        )
        self.events.claim(
            pvc,
            "Normal",
            "ProvisioningUndone",
            f"the claim was deleted before its PV was saved: flexhub reclaimed the "
            f"{spec.backend} storage it had made for it (onDelete {spec.on_delete})",
        )
        let_claim_go(self.core, pvc)

    def _leftover(self, pvc: Mapping[str, Any], why: Exception) -> None:
        """Nothing says any more what was made for a deleted claim (its class is gone, or
        refuses it): say what to look for, and let the claim go."""
        meta = pvc["metadata"]
        self.events.claim(
            pvc,
            "Warning",
            "ProvisioningLeftover",
            event_text(
                f"{why}: flexhub cannot find what it may have made for this claim; "
                f"look for storage named with its uid {meta['uid']}"
            ),
        )
        LOG.warning("claim %s/%s: %s: anything made for it is left", meta["namespace"],
                    meta["name"], event_text(why))  # fmt: skip
        let_claim_go(self.core, pvc)

    def _failed(self, pvc: Mapping[str, Any], message: str) -> NoReturn:
        """A mistake an operator must fix: an Event naming it, and a slow retry."""
        LOG.warning(
            "claim %s/%s: %s", pvc["metadata"]["namespace"], pvc["metadata"]["name"], message
        )
        self.events.claim(pvc, "Warning", "ProvisioningFailed", event_text(message))
        raise _Later(MISTAKE_RETRY)

    def _class_secrets(self, pvc: Mapping[str, Any], spec: Any) -> Secrets:
        if spec.secret is None:
            return Secrets()
        namespace, name = spec.secret
        secret = self._get(self.core.read_namespaced_secret, name, namespace)
        if secret is None:
            self._failed(pvc, f"Secret {namespace}/{name} (secretNamespace/secretName) not found")
        if secret.get("type") != SECRET_TYPE:
            # the same rule as on reclaim: only Secrets made for flexhub are handed to a backend
            self._failed(
                pvc,
                f"Secret {namespace}/{name} (secretNamespace/secretName) has type "
                f"{str(secret.get('type'))[:80]!r}, not {SECRET_TYPE!r}",
            )
        return Secrets(encoded=dict(secret.get("data") or {}))

    def _check_node(self, pvc: Mapping[str, Any], node: str, allowed: list[Any]) -> None:
        """The claim's ``selected-node`` must name a node that exists, inside the class's
        ``allowedTopologies``: a claim author may write the annotation (the scheduler honours
        both for a pod's claim), and a PV pinned to a node that is not there stays forever."""
        if len(node) > 253 or not _NODE_NAME.fullmatch(node):
            self._failed(
                pvc,
                f"annotation {pvs.ANN_SELECTED_NODE} {node[:80]!r} is not a node name",
            )
        found = self._get(self.core.read_node, node)
        if found is None:
            self._failed(
                pvc, f"annotation {pvs.ANN_SELECTED_NODE} names node {node!r}, which does not exist"
            )
        if allowed and not _in_topology(found["metadata"].get("labels") or {}, allowed):
            self._failed(
                pvc,
                f"annotation {pvs.ANN_SELECTED_NODE} names node {node!r}, outside the "
                "StorageClass's allowedTopologies",
            )

    def _check_pv_secret(self, pvc: Mapping[str, Any], ref: tuple[str, str]) -> None:
        """Warn when the Secret the PV names is not one kubelet will pass (its type must be
        the driver's name). The PV is made anyway: its storage exists now, and a PV is what
        gets it reclaimed; the pod's mount then fails with kubelet's own message."""
        secret = self._get(self.core.read_namespaced_secret, ref[1], ref[0])
        kind = None if secret is None else secret.get("type")
        if kind != SECRET_TYPE:
            found = "does not exist" if secret is None else f"has type {kind!r}"
            self.events.claim(
                pvc,
                "Warning",
                "SecretType",
                f"the PV's Secret {ref[0]}/{ref[1]} {found}: kubelet passes a volume only a "
                f"Secret of type {SECRET_TYPE!r}, so mounts will fail until it is one",
            )

    def _hostname(self, node: str) -> str:
        found = self._get(self.core.read_node, node)
        if found is None:
            return node
        return str((found["metadata"].get("labels") or {}).get(pvs.HOSTNAME_LABEL, node))

    def _expand(self, pvc: Mapping[str, Any]) -> None:
        """Grow storage the provisioner holds (a LUN) when its claim asks for more.

        Only for the claim the PV is bound to (``claimRef``: namespace, name and uid; any
        claim may name any PV in ``spec.volumeName``), of a class that allows expansion, and
        for a PV that still carries this provisioner's seal."""
        volume = pvc["spec"]["volumeName"]
        pv = self._get(self.core.read_persistent_volume, volume)
        if pv is None or not self._ours(pv):
            return
        record = read_record(pv)
        backend = self.backend_for(record["backend"])
        if not getattr(backend, "expands_storage", False):
            return
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
            raise _Later(MISTAKE_RETRY)
        self._check_seal(pv, "grow its storage")
        options = dict(pv["spec"]["flexVolume"].get("options") or {})
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
        raise _Later(NODE_GONE_RETRY)

    # ----------------------------------------------------------------------------- volumes

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
            raise _Later(MISTAKE_RETRY)
        if where == "node":
            node = record.get("node", "")
            if self._label_node(pv, node):
                raise _Later(NODE_AGENT_GRACE)  # its agent sees it only now: its grace first
            if self._get(self.core.read_node, node) is None:
                self.events.volume(
                    pv,
                    "Warning",
                    "NodeGone",
                    f"node {node!r} is gone: the storage on it was not "
                    "reclaimed; the PV stays Released until you delete it",
                )
                raise _Later(NODE_GONE_RETRY)
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
            raise _Later(NODE_AGENT_GRACE - since + 1)
        self.events.volume(
            pv,
            "Warning",
            "NodeAgentMissing",
            f"Released {since / 60:.0f} min ago and not reclaimed: no flexhub node agent "
            f"reclaims on node {node!r} (is nodeAgent enabled, and does the flexhub "
            "DaemonSet run on that node?)",
        )
        raise _Later(NODE_GONE_RETRY)

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

    # ----------------------------------------------------------------------------- API

    def _get(self, read: Callable[..., Any], *args: str) -> dict[str, Any] | None:
        return get(self.api, read, *args)


class _Later(Exception):
    def __init__(self, seconds: float) -> None:
        super().__init__(f"again in {seconds:.0f} s")
        self.seconds = seconds


def _in_topology(labels: Mapping[str, str], terms: list[Any]) -> bool:
    """Whether a node's labels satisfy one of a StorageClass's ``allowedTopologies`` terms
    (every ``matchLabelExpressions`` entry of that term: the label's value is listed)."""
    for term in terms:
        expressions = (term or {}).get("matchLabelExpressions") or []
        if all(labels.get(e.get("key")) in (e.get("values") or []) for e in expressions):
            return True
    return False
