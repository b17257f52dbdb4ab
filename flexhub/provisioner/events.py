"""Events on claims, PVs and pods, as ``kubectl describe`` shows them to their authors (pods:
the CSI node plugin's health watcher, :mod:`flexhub.csi.healthevents`).

Aggregated as client-go's recorder does (:class:`CountingRecorder`, the provisioner's): the
same reason and message on the same object again patches the Event written before
(``count`` + 1, ``lastTimestamp``) instead of writing a new one, and each object may write
:data:`BURST` Events at once, then one per :data:`REFILL` seconds (the rest are dropped, and
logged at debug). A thousand claims of a broken class therefore cost a thousand Event
objects, counted, not one per retry (up to :data:`REMEMBERED` objects at once).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

LOG = logging.getLogger(__name__)

__all__ = ["CountingRecorder", "Recorder", "api_error"]

#: Events an object may write at once, then one per REFILL seconds (client-go's spam filter).
BURST = 25
REFILL = 300.0
#: Objects (and Events) remembered for aggregation; the least recently used are forgotten
#: first (past that many objects retried at once, a repeat is a new Event again).
REMEMBERED = 20_000


class _Bucket:
    __slots__ = ("at", "tokens")

    def __init__(self, now: float) -> None:
        self.tokens = float(BURST)
        self.at = now

    def take(self, now: float) -> bool:
        self.tokens = min(float(BURST), self.tokens + (now - self.at) / REFILL)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class Recorder:
    """Write core/v1 Events; a failure to write one is logged, never raised."""

    def __init__(
        self,
        core: Any,
        component: str,
        instance: str = "",
        clock: Callable[[], float] = time.monotonic,
        count: bool = True,
        host: str = "",
        timeout: float = 10,
    ) -> None:
        """:param count: a repeat patches the Event written before (``False``: a new Event,
        the rate limit alone: the node agent, whose token may not patch Events, which in
        ``default`` are every node's and PV's).
        :param host: the Event source's ``host`` (a node plugin's node).
        :param timeout: seconds each API call may take."""
        self.core = core
        self.count = count
        self.component = component
        self.instance = instance
        self.host = host
        self.timeout = timeout
        self._clock = clock
        self._lock = threading.Lock()
        #: (object, reason, message) -> [namespace, Event name, count]
        self._written: OrderedDict[tuple[str, ...], list[Any]] = OrderedDict()
        #: object -> its rate limit
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def claim(self, pvc: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        self._emit(
            pvc, "PersistentVolumeClaim", pvc["metadata"]["namespace"], kind, reason, message
        )

    def volume(self, pv: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        # A cluster-scoped object's Events live in the default namespace.
        self._emit(pv, "PersistentVolume", "default", kind, reason, message)

    def pod(self, meta: Mapping[str, Any], kind: str, reason: str, message: str) -> bool:
        """An Event on the pod of ``meta`` (its name, namespace and uid), in its namespace;
        whether it was written or counted (``False``: the API refused it, or rate limit)."""
        return self._emit({"metadata": meta}, "Pod", meta["namespace"], kind, reason, message)

    def _emit(
        self,
        obj: Mapping[str, Any],
        object_kind: str,
        namespace: str,
        kind: str,
        reason: str,
        message: str,
    ) -> bool:
        meta = obj["metadata"]
        subject = f"{object_kind}/{meta.get('namespace') or ''}/{meta['name']}/{meta.get('uid')}"
        message = message[:1024]
        key = (subject, kind, reason, message)
        with self._lock:
            bucket = self._buckets.pop(subject, None) or _Bucket(self._clock())
            self._buckets[subject] = bucket
            while len(self._buckets) > REMEMBERED:
                self._buckets.popitem(last=False)
            if not bucket.take(self._clock()):
                LOG.debug("event %s on %s dropped (rate limit)", reason, subject)
                return False
            seen = self._written.pop(key, None)
            if seen is not None:
                seen[2] += 1
                self._written[key] = seen
            while len(self._written) > REMEMBERED:
                self._written.popitem(last=False)
        now = datetime.datetime.now(datetime.UTC).isoformat()
        if seen is not None and self._count(seen, now):
            return True
        event_name = f"{meta['name'][:200]}.{uuid.uuid4().hex[:12]}"  # a name is at most 253
        event: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": event_name, "namespace": namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": object_kind,
                "name": meta["name"],
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": self.component, **({"host": self.host} if self.host else {})},
            "reportingComponent": self.component,
            "reportingInstance": self.instance or self.component,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(namespace, event, _request_timeout=self.timeout)
        except Exception as exc:
            LOG.warning(
                "could not record event %s on %s/%s: %s",
                reason,
                object_kind,
                meta["name"],
                api_error(exc),
            )
            return False
        with self._lock:
            self._written[key] = [namespace, event_name, 1]
        return True

    def _count(self, seen: list[Any], now: str) -> bool:
        """Count one more on the Event written before: not here (a repeat is a new Event,
        under the rate limit alone; see :class:`CountingRecorder`)."""
        return False


class CountingRecorder(Recorder):
    """A :class:`Recorder` whose repeats patch the Event written before (``count``,
    ``lastTimestamp``): the provisioner's. The node agent's is a plain :class:`Recorder`:
    its token (on every node) may not patch Events, which in ``default`` are every node's
    and every PV's."""

    def _count(self, seen: list[Any], now: str) -> bool:
        """False when the Event is gone (expired, or deleted): a new one is written then."""
        namespace, name, count = seen
        try:
            self.core.patch_namespaced_event(
                name,
                namespace,
                {"count": count, "lastTimestamp": now},
                _request_timeout=self.timeout,
            )
        except Exception as exc:
            LOG.debug(
                "could not count event %s/%s (%s): writing a new one",
                namespace,
                name,
                api_error(exc),
            )
            return False
        return True


def api_error(exc: BaseException) -> str:
    """An API call's failure on one line: an ``ApiException``'s status and reason (never its
    headers or body), else the error's type and text (a connection error names the server,
    never the request's token)."""
    from flexhub.errors import one_line

    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return f"{status} {one_line(str(getattr(exc, 'reason', '') or ''), 100)}".rstrip()
    return f"{type(exc).__name__}: {one_line(str(exc), 300)}"
