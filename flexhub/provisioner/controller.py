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

from flexhub.errors import FlexhubError, InvalidOptions, one_line
from flexhub.node.checkpoints import checkpoint
from flexhub.provisioner import pvs
from flexhub.provisioner.events import CountingRecorder
from flexhub.provisioner.queue import WorkQueue, watch_forever
from flexhub.provisioner.seal import ANN_SEAL, Sealer, sealed_content
from flexhub.provisioning import Provisioning
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
#: A provisioned PV's name: ``pvc-<claim uid>``.
_PV_NAME = re.compile(r"pvc-([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")


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
            LOG.warning("%s: %s (again in %.0f s)", key, _one_line(exc), delay)
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
        if pvc is None or pvc["metadata"].get("deletionTimestamp"):
            return
        if pvc["spec"].get("volumeName"):
            self._expand(pvc)
            return
        if not self._owns_claim(pvc):
            return
        uid = pvc["metadata"]["uid"]
        source = pvc["spec"].get("dataSourceRef") or pvc["spec"].get("dataSource")
        if self._get(self.core.read_persistent_volume, f"pvc-{uid}") is not None:
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
        try:
            made = backend.provision(claim, spec.parameters, secrets)
        except InvalidOptions as exc:
            self._failed(pvc, str(exc))
        except FlexhubError as exc:
            self.events.claim(pvc, "Warning", "ProvisioningFailed", _one_line(exc))
            raise
        checkpoint("provisioner-made")  # test hook: a crash between the storage and the PV
        if made.secret is None and spec.secret is not None:
            made = made.replace(secret=spec.secret)  # the class's Secret
        if made.secret is not None:
            self._check_pv_secret(pvc, made.secret)
        hostname = self._hostname(made.node) if made.node else ""
        pv = pvs.build_pv(
            claim,
            class_name,
            sc.get("reclaimPolicy") or "Delete",
            spec.backend,
            spec.on_delete,
            spec.reclaim_on,
            made,
            self.driver,
            self.name,
            hostname,
            spec.secret,
        )
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
            return
        LOG.info("provisioned %s for claim %s/%s", pv["metadata"]["name"], namespace, name)
        self.events.claim(
            pvc,
            "Normal",
            "ProvisioningSucceeded",
            f"Successfully provisioned volume {pv['metadata']['name']}",
        )

    def _failed(self, pvc: Mapping[str, Any], message: str) -> NoReturn:
        """A mistake an operator must fix: an Event naming it, and a slow retry."""
        LOG.warning(
            "claim %s/%s: %s", pvc["metadata"]["namespace"], pvc["metadata"]["name"], message
        )
        self.events.claim(pvc, "Warning", "ProvisioningFailed", _one_line(message))
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
        for a PV that still carries this provisioner's seal. For every backend, a growth past
        the bound the PV carries (the backend's ``check_expansion``: loopfile's ``maxSize``)
        is an ``ExpansionRefused`` Event on the claim."""
        volume = pvc["spec"]["volumeName"]
        pv = self._get(self.core.read_persistent_volume, volume)
        if pv is None or not self._ours(pv):
            return
        record = _record(pv)
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
            self.events.claim(pvc, "Warning", "ExpansionRefused", _one_line(exc))
            raise _Later(MISTAKE_RETRY) from None
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
            raise _Later(MISTAKE_RETRY)
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
                {"op": "add", "path": f"/metadata/annotations/{_pointer(pvs.ANN_RECLAIM)}",
                 "value": text},
                {"op": "add", "path": f"/metadata/annotations/{_pointer(ANN_SEAL)}",
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
        record = _record(pv)
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
            self.events.volume(pv, "Warning", "VolumeFailedDelete", _one_line(exc))
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
        since = _seconds_since((pv.get("status") or {}).get("lastPhaseTransitionTime"))
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


def get(api: Any, read: Callable[..., Any], *args: str) -> dict[str, Any] | None:
    """``read(*args)`` as a plain dict, or None when the object does not exist."""
    from kubernetes.client.rest import ApiException

    try:
        found = read(*args, _request_timeout=30)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    plain: dict[str, Any] = api.sanitize_for_serialization(found)
    return plain


def _in_topology(labels: Mapping[str, str], terms: list[Any]) -> bool:
    """Whether a node's labels satisfy one of a StorageClass's ``allowedTopologies`` terms
    (every ``matchLabelExpressions`` entry of that term: the label's value is listed)."""
    for term in terms:
        expressions = (term or {}).get("matchLabelExpressions") or []
        if all(labels.get(e.get("key")) in (e.get("values") or []) for e in expressions):
            return True
    return False


def _pointer(key: str) -> str:
    """``key`` as one JSON-pointer segment (``flexhub/seal`` → ``flexhub~1seal``)."""
    return key.replace("~", "~0").replace("/", "~1")


def api_reason(exc: Any) -> str:
    """The API server's own message of an ``ApiException`` (its Status body), one line;
    never the HTTP headers."""
    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        body = {}
    message = body.get("message") if isinstance(body, dict) else None
    return _one_line(message or f"{exc.status} {exc.reason}")


def _seconds_since(stamp: object) -> float | None:
    import datetime

    if not isinstance(stamp, str | datetime.datetime):
        return None
    try:
        when = (
            stamp
            if isinstance(stamp, datetime.datetime)
            else datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        )
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return (datetime.datetime.now(datetime.UTC) - when).total_seconds()


def _record(pv: Mapping[str, Any]) -> dict[str, str]:
    raw = (pv["metadata"].get("annotations") or {}).get(pvs.ANN_RECLAIM, "{}")
    try:
        record = json.loads(raw)
    except ValueError:
        raise FlexhubError(
            f"PV {pv['metadata']['name']}: annotation {pvs.ANN_RECLAIM} is not JSON"
        ) from None
    if not isinstance(record, dict) or "backend" not in record:
        raise FlexhubError(
            f"PV {pv['metadata']['name']}: annotation {pvs.ANN_RECLAIM} names no backend"
        )
    found = {str(k): str(v) for k, v in record.items()}
    uid = found.get("claimUid")
    if uid is not None and pv["metadata"]["name"] != f"pvc-{uid}":
        # the PV's name cannot be edited, its annotation can: a record naming another
        # claim's directory (its uid) would make this PV's reclaim delete that one
        raise FlexhubError(
            f"PV {pv['metadata']['name']}: annotation {pvs.ANN_RECLAIM} names claim uid "
            f"{uid[:80]!r}, not this PV's: refusing to reclaim"
        )
    return found


def backend_record(pv: Mapping[str, Any]) -> dict[str, str]:
    """The PV's reclaim record as its backend's reclaim and expansion get it: checked by
    :func:`_record`, and with the ``claimUid`` the PV's name holds when the record has none
    (one saved before its backend wrote it), so the backend's own check that the PV's options
    name this claim's storage (an iSCSI iqn ``...:pvc-<uid>``) runs on every PV. The name of
    a PV cannot be edited; its options and annotations can."""
    record = _record(pv)
    found = _PV_NAME.fullmatch(str(pv["metadata"]["name"]))
    if "claimUid" not in record and found is not None:
        record["claimUid"] = found.group(1)
    return record


def finish_reclaim(core: Any, pv: Mapping[str, Any]) -> None:
    """The storage is gone: delete the PV object, then let it go (remove the finalizer).
    Interrupted in between, the next sync reclaims again (a no-op) and finishes."""
    from kubernetes.client.rest import ApiException

    name = pv["metadata"]["name"]
    if not pv["metadata"].get("deletionTimestamp"):
        try:
            core.delete_persistent_volume(name, _request_timeout=30)
        except ApiException as exc:
            if exc.status != 404:
                raise
    for _ in range(5):  # the API server itself updates a PV just deleted: read, try again
        fresh = get(core.api_client, core.read_persistent_volume, name)
        if fresh is None or pvs.FINALIZER not in (fresh["metadata"].get("finalizers") or []):
            return
        try:
            remove_finalizer(core, fresh)
            return
        except ApiException as exc:
            if exc.status not in (409, 422):
                raise
    raise FlexhubError(
        f"PV {name}: could not remove the finalizer {pvs.FINALIZER} (it changes "
        "under every try); retried"
    )


def remove_finalizer(core: Any, pv: Mapping[str, Any]) -> None:
    """Remove flexhub's finalizer with a compare-and-swap on the PV's resourceVersion."""
    finalizers = [f for f in pv["metadata"].get("finalizers") or [] if f != pvs.FINALIZER]
    patch = [
        {
            "op": "test",
            "path": "/metadata/resourceVersion",
            "value": pv["metadata"]["resourceVersion"],
        },
        {"op": "replace", "path": "/metadata/finalizers", "value": finalizers},
    ]
    core.patch_persistent_volume(pv["metadata"]["name"], patch, _request_timeout=30)


def _one_line(error: object) -> str:
    """An Event's or log line's text: the errors module's folding, at an Event's length."""
    return one_line(str(error), limit=400)


__all__ += ["api_reason", "backend_record", "finish_reclaim", "get", "remove_finalizer"]
