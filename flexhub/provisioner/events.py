"""Events on claims and PVs, as ``kubectl describe`` shows them to their authors."""

from __future__ import annotations

import datetime
import logging
import uuid
from collections.abc import Mapping
from typing import Any

LOG = logging.getLogger(__name__)

__all__ = ["Recorder"]


class Recorder:
    """Write core/v1 Events; a failure to write one is logged, never raised."""

    def __init__(self, core: Any, component: str, instance: str = "") -> None:
        self.core = core
        self.component = component
        self.instance = instance

    def claim(self, pvc: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        self._emit(
            pvc, "PersistentVolumeClaim", pvc["metadata"]["namespace"], kind, reason, message
        )

    def volume(self, pv: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        # A cluster-scoped object's Events live in the default namespace.
        self._emit(pv, "PersistentVolume", "default", kind, reason, message)

    def _emit(
        self,
        obj: Mapping[str, Any],
        object_kind: str,
        namespace: str,
        kind: str,
        reason: str,
        message: str,
    ) -> None:
        meta = obj["metadata"]
        now = datetime.datetime.now(datetime.UTC)
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": object_kind,
                "name": meta["name"],
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": kind,
            "source": {"component": self.component},
            "reportingComponent": self.component,
            "reportingInstance": self.instance or self.component,
            "firstTimestamp": now.isoformat(),
            "lastTimestamp": now.isoformat(),
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(namespace, event, _request_timeout=10)
        except Exception as exc:
            LOG.warning(
                "could not record event %s on %s/%s: %s", reason, object_kind, meta["name"], exc
            )
