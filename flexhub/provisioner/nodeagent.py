"""The node side of provisioning: a node's flexhub pod reclaims the storage that lives on it.

A loop file exists only on its node, so the provisioner cannot remove it. The node agent (in
the flexhub DaemonSet pod, ``flexhub daemonset --node-agent``, or ``flexhub node-agent``)
watches the PVs labelled with this node (``flexhub/reclaim-node``, which the provisioner
sets) and reclaims those made by flexhub whose record says ``reclaimOn: node`` and names
this node, once they are Released with reclaim policy Delete: the backend's
``reclaim`` runs here (it refuses while this node still uses the file), then the PV object is
deleted and flexhub's finalizer removed. A failure is an Event on the PV and a retry.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from flexhub.errors import FlexhubError
from flexhub.provisioner import pvs
from flexhub.provisioner.events import Recorder
from flexhub.provisioner.pvapi import (
    backend_record,
    event_text,
    finish_reclaim,
    get,
    remove_finalizer,
)
from flexhub.provisioner.queue import WorkQueue, watch_forever

LOG = logging.getLogger(__name__)

__all__ = ["NodeAgent"]


class NodeAgent:
    def __init__(
        self,
        api: Any,
        node: str,
        reclaim: Callable[[str, Mapping[str, str], Mapping[str, str]], None],
        name: str = "flexhub",
    ) -> None:
        """:param reclaim: ``reclaim(backend, options, record)`` on this node."""
        from kubernetes import client

        self.api = api
        self.core = client.CoreV1Api(api)
        self.node = node
        self.reclaim = reclaim
        self.name = name
        self.events = Recorder(self.core, component=f"{name}-node", instance=node)
        self.queue = WorkQueue()
        self.stop = threading.Event()

    def feed(self) -> threading.Thread:
        thread = threading.Thread(
            target=watch_forever,
            name="watch-volumes",
            daemon=True,
            args=(
                self.core.list_persistent_volume,
                self._queue_key,
                self._key_if_mine,
                self.stop,
                "volumes",
            ),
            # only this node's PVs (the provisioner labels them): the API server filters, so
            # N agents cost N watches of their own PVs, not N copies of every PV change
            kwargs={"label_selector": f"{pvs.NODE_LABEL}={pvs.node_label(self.node)}"},
        )
        thread.start()
        return thread

    def _queue_key(self, key: str, event: object) -> None:
        if not key:
            return
        if event is None:  # listed: a key in backoff keeps it
            self.queue.add_listed(key)
        else:
            self.queue.add(key)

    def _key_if_mine(self, obj: Any) -> str:
        """The PV's name when the watched object may be this node's to reclaim, else "": every
        node watches every PV, so the others are dropped here, before any request."""
        meta = obj["metadata"] if isinstance(obj, dict) else obj.metadata
        name = meta["name"] if isinstance(meta, dict) else meta.name
        annotations = (
            meta.get("annotations") if isinstance(meta, dict) else meta.annotations
        ) or {}
        raw = annotations.get(pvs.ANN_RECLAIM, "")
        if annotations.get(pvs.ANN_PROVISIONED_BY) != self.name or not raw:
            return ""
        try:
            record = json.loads(raw)
        except ValueError:
            return ""
        mine = isinstance(record, dict) and record.get("node") == self.node
        return str(name) if mine and record.get("reclaimOn") == "node" else ""

    def run(self) -> None:
        while not self.stop.is_set():
            key = self.queue.get(timeout=1)
            if key is None:
                continue
            try:
                self.sync(key)
            except Exception as exc:
                delay = self.queue.retry(key)
                LOG.warning("PV %s: %s (again in %.0f s)", key, event_text(exc), delay)
            else:
                self.queue.forget(key)
            finally:
                self.queue.done(key)

    def sync(self, name: str) -> None:
        pv = get(self.api, self.core.read_persistent_volume, name)
        if pv is None:
            return
        annotations = pv["metadata"].get("annotations") or {}
        if (
            annotations.get(pvs.ANN_PROVISIONED_BY) != self.name
            or pvs.ANN_RECLAIM not in annotations
        ):
            return
        if pvs.FINALIZER not in (pv["metadata"].get("finalizers") or []):
            return
        # the same record the provisioner's reclaim gets: checked, and with the claim's uid
        # from the PV's name (which cannot be edited) when the record has none
        record = backend_record(pv)
        if record.get("reclaimOn") != "node" or record.get("node") != self.node:
            return
        if pv["spec"].get("persistentVolumeReclaimPolicy") != "Delete":
            remove_finalizer(self.core, pv)
            return
        if (pv.get("status") or {}).get("phase") != "Released":
            return
        options = dict(pv["spec"]["flexVolume"].get("options") or {})
        try:
            self.reclaim(record["backend"], options, record)
        except FlexhubError as exc:
            self.events.volume(
                pv, "Warning", "VolumeFailedDelete", f"on {self.node}: {event_text(exc)}"
            )
            raise
        finish_reclaim(self.core, pv)
        LOG.info("reclaimed %s on %s (onDelete %s)", name, self.node, record.get("onDelete"))
