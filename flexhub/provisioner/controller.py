"""The provisioner's control loop: claims become PVs, released PVs give their storage back.

Two watches (claims, PVs) feed one work queue; a few workers sync keys, one key never by
two at once, reading the object fresh from the API server before acting (never from a cache
that may be stale). A sync that fails is retried with per-key backoff; a claim with a
StorageClass mistake is retried slowly (an operator fixes the class, the claim then
provisions). This module is the loop and the claim half; the PV half (reclaim, growth) is
:mod:`flexhub.provisioner.volumes`.

Safe without the leader election (``--leader-elect=false``, or two leaders during a handover):
the PV is named ``pvc-<claim uid>``, a backend's provision finds what an earlier one made for
that uid, a PV that already exists (AlreadyExists) counts as done, a failed PV save is
retried (the storage is never deleted for it), a claim holds ``flexhub/provisioning`` while
its storage may lack a PV (deleted then, its storage is found again and reclaimed), and a
PV's storage is reclaimed only while the PV holds flexhub's finalizer, which is removed
after the backend confirmed the reclaim.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, NoReturn

from flexhub.errors import FlexhubError, InvalidOptions, NoRoom, NotSupported
from flexhub.node.checkpoints import checkpoint
from flexhub.provisioner import pvs
from flexhub.provisioner.events import CountingRecorder
from flexhub.provisioner.pvapi import (
    CLAIM_FINALIZER,
    api_reason,
    backend_record,
    event_text,
    hold_claim,
    let_claim_go,
    read_record,
)
from flexhub.provisioner.queue import WorkQueue, watch_forever
from flexhub.provisioner.seal import ANN_SEAL, Sealer
from flexhub.provisioner.volumes import MISTAKE_RETRY, SECRET_TYPE, Later, Volumes
from flexhub.provisioning import Claim, Provisioned, Provisioning
from flexhub.volume import Secrets

LOG = logging.getLogger(__name__)

__all__ = ["DRIVER", "MISTAKE_RETRY", "Controller", "Later"]

DRIVER = "k8s/flexhub"
#: How many keys are synced at once (one key never twice at once).
WORKERS = 4
#: A node name as the API server accepts one (a DNS subdomain).
_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class Controller(Volumes):
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
        except Later as later:
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
        from kubernetes.client.rest import ApiException

        try:
            # from here until the PV is saved, storage may exist that no PV names: a claim
            # deleted meanwhile waits for _undo to remove it
            pvc = hold_claim(self.api, self.core, pvc)
        except ApiException as exc:
            message = f"flexhub could not hold the claim (finalizer {CLAIM_FINALIZER}): "
            if exc.status == 403:
                message += "the provisioner's account may not patch claims (its RBAC)"
            self.events.claim(
                pvc, "Warning", "ProvisioningFailed", event_text(message + api_reason(exc))
            )
            raise
        claim = pvs.claim_from(pvc)  # its annotations as frozen by the hold
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
        earlier call made for the claim's uid, from the claim's annotations as frozen when
        it was held) and deleted: no PV ever named it, so no pod wrote to it, whatever the
        class's onDelete or reclaim policy; then the claim may go. With a PV saved, the PV's
        own reclaim takes care of the storage."""
        meta = pvc["metadata"]
        where = f"claim {meta['namespace']}/{meta['name']}"
        if self._get(self.core.read_persistent_volume, f"pvc-{meta['uid']}") is not None:
            let_claim_go(self.core, pvc)
            return
        spec_of = pvc["spec"]
        class_name = spec_of.get("storageClassName") or ""
        sc = self._get(self.storage.read_storage_class, class_name) if class_name else None
        try:
            if spec_of.get("volumeName"):
                # bound to a PV once (gone since): its storage is that PV's, which may hold
                # data; never deleted here
                raise InvalidOptions(f"the claim names PV {spec_of['volumeName'][:80]!r}")
            if sc is None or sc.get("provisioner") != self.name:
                raise InvalidOptions(f"StorageClass {class_name[:80]!r} is gone")
            refused = self._never_held(pvc, sc)
            if refused:  # provisioning never held such a claim: nothing was made for it
                LOG.info("%s: %s: nothing to undo", where, refused)
                let_claim_go(self.core, pvc)
                return
            spec = replace(self.read_class(sc), on_delete="delete")
            claim = pvs.claim_from(pvc)
        except InvalidOptions as exc:
            self._leftover(pvc, exc)
            return
        if spec.reclaim_on != "provisioner":
            let_claim_go(self.core, pvc)  # made on its node at a first mount: nothing yet
            return
        try:
            backend = self.backend_for(spec.backend)
            secrets = self._class_secrets(pvc, spec)
            try:
                made = backend.provision(claim, spec.parameters, secrets)
            except (InvalidOptions, NoRoom, NotSupported) as exc:  # refused: none made
                self._leftover(pvc, exc)
                return
            pv = self._pv(claim, sc, spec, made)
            backend.reclaim(
                dict(pv["spec"]["flexVolume"].get("options") or {}),
                backend_record(pv),
                self._volume_secrets(pv, read_record(pv)),
            )
        except (FlexhubError, Later) as exc:
            self.events.claim(
                pvc,
                "Warning",
                "ProvisioningLeftover",
                event_text(f"the claim waits until flexhub can delete its storage: {exc}"),
            )
            raise
        LOG.info("%s deleted before its PV was saved: its %s storage deleted", where, spec.backend)
        self.events.claim(
            pvc,
            "Normal",
            "ProvisioningUndone",
            f"the claim was deleted before its PV was saved: flexhub deleted the "
            f"{spec.backend} storage its backend had (or would have) made for it",
        )
        let_claim_go(self.core, pvc)

    def _never_held(self, pvc: Mapping[str, Any], sc: Mapping[str, Any]) -> str:
        """Why provisioning refuses ``pvc`` before holding it ('' when it does not)."""
        spec = pvc["spec"]
        if spec.get("dataSourceRef") or spec.get("dataSource"):
            return "a dataSource"
        if spec.get("selector"):
            return "a selector"
        if spec.get("volumeMode") == "Block":
            return "volumeMode Block"
        annotations = pvc["metadata"].get("annotations") or {}
        if sc.get("volumeBindingMode") == "WaitForFirstConsumer" and not annotations.get(
            pvs.ANN_SELECTED_NODE
        ):
            return "no node selected"
        return ""

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
        raise Later(MISTAKE_RETRY)

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


def _in_topology(labels: Mapping[str, str], terms: list[Any]) -> bool:
    """Whether a node's labels satisfy one of a StorageClass's ``allowedTopologies`` terms
    (every ``matchLabelExpressions`` entry of that term: the label's value is listed)."""
    for term in terms:
        expressions = (term or {}).get("matchLabelExpressions") or []
        if all(labels.get(e.get("key")) in (e.get("values") or []) for e in expressions):
            return True
    return False
