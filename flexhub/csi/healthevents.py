"""The node plugin's health watcher: a volume turned abnormal is a Warning Event on its pod.

Kubelet v1.37.2 makes no Event of a CSI volume's health (its stats code keeps an event
recorder it never uses; the health manager only writes pod status behind an alpha gate), so
the node plugin does what kubernetes-csi's external-health-monitor node agent did: a daemon
thread, every ``--health-interval`` seconds (0: off), walks the targets this node published
(:mod:`flexhub.csi.published`), checks each as ``NodeGetVolumeHealth`` does
(:meth:`flexhub.csi.node.NodeService.health_of`: one bounded stat of the staging and the
publish path) and, when a volume healthy at the last check (or never checked) is abnormal,
writes one core/v1 Event on the pod the kubelet published it for:

* type ``Warning``, reason ``VolumeConditionAbnormal``, involvedObject the Pod (name,
  namespace, uid), in the pod's namespace; source component ``flexhub-csi-node``, host the
  node id; message ``Volume <pv>: <reason>: <condition message>`` on one line, at most 1024
  characters: the PV's name, flexhub's own condition text (paths) and a block backend's
  (iSCSI's names the target IQN, LUN and portals, the volume's options), never a secret.
* While it stays abnormal with the same conditions (the same reasons, whatever their text:
  a stat that still hangs says so in other words), no new Event at each check: the same
  Event is counted again (``count`` + 1, ``lastTimestamp``) at most every :data:`REPEAT`
  seconds (10 min). Other reasons are a new transition at once. Healthy again forgets it:
  the next trouble is a transition again (the Event of the same message, if the API server
  still holds it, counted up, as client-go's recorder aggregates).
* A target whose volume has a call in flight is skipped for the round, and a target
  unpublished while it was checked is forgotten (its record goes before the unmount). A
  record whose target has no mount and no path (its removal failed at the unpublish: a
  read-only state disk then; the pod is gone) is removed, and names no pod.
* A target whose pod is unknown (``podInfoOnMount`` off, or not believed) gets no Event.

Each check is bounded (:data:`flexhub.csi.node.STAT_BOUND` per volume, and a path whose stat
still hangs answers at once), each API call by :data:`API_TIMEOUT`; an API error is logged on
one line (status and reason, never the token) and the Event is tried again next round; no
error stops the thread. The writing, the counting and the per-pod rate limit are the
provisioner's :class:`~flexhub.provisioner.events.CountingRecorder`'s.

The API client comes from ``--kubeconfig`` or the pod's service account; with neither the
watcher logs one line and stays off (``NodeGetVolumeHealth`` is unchanged). ``kubernetes`` is
imported here only, and only when the watcher starts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from flexhub.csi.published import Published
from flexhub.errors import StateError, one_line

__all__ = ["COMPONENT", "REASON", "HealthWatcher", "events_api", "start"]

LOG = logging.getLogger(__name__)

REASON = "VolumeConditionAbnormal"
COMPONENT = "flexhub-csi-node"
#: Seconds between two counts of the same abnormal condition of a target.
REPEAT = 600.0
#: Seconds an Event's create or patch may take.
API_TIMEOUT = 10
#: The longest Event message written.
MESSAGE_LIMIT = 1024


class _Node(Protocol):
    """What the watcher needs of :class:`flexhub.csi.node.NodeService`."""

    published: Any
    in_flight: Any

    def health_of(self, volume_id: str, paths: list[Path]) -> Any: ...

    def unpublished(self, target: Path) -> bool: ...


class HealthWatcher:
    """Checks the published targets of ``node`` and writes Events through ``recorder``
    (a :class:`~flexhub.provisioner.events.Recorder`); :meth:`check` is one round."""

    def __init__(
        self,
        node: _Node,
        recorder: Any,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.recorder = recorder
        self.interval = interval
        self._clock = clock
        #: target -> (its conditions' reasons, its Event's message, when it was last written
        #: or counted)
        self._abnormal: dict[str, tuple[tuple[str, ...], str, float]] = {}
        self._unnamed: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="health-events", daemon=True)
        self._thread.start()
        LOG.info("health events: checking published volumes every %g s", self.interval)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception as exc:  # a bug or an OS error: logged, the next round runs
                LOG.error("health events: round failed: %s", one_line(repr(exc), 300))

    def check(self) -> None:
        """One round over every published target (module doc)."""
        try:
            published = self.node.published.all()
        except OSError as exc:
            LOG.warning("health events: cannot list the publish records: %s", exc.strerror)
            return
        targets = {p.target for p in published}
        for gone in set(self._abnormal) - targets:
            del self._abnormal[gone]
        self._unnamed &= targets
        for entry in published:
            if self._stop.is_set():
                return
            try:
                self._check_one(entry)
            except Exception as exc:  # one target's trouble never ends the round
                LOG.error("health events: %s: %s", entry.target, one_line(repr(exc), 300))

    def _check_one(self, entry: Published) -> None:
        if entry.pod is None:
            if entry.target not in self._unnamed:
                self._unnamed.add(entry.target)
                LOG.info("health events: %s names no pod: no Event for it", entry.target)
            return
        if self.node.in_flight.busy(entry.volume_id):
            return  # the kubelet is publishing or unpublishing it: next round
        health = self.node.health_of(entry.volume_id, [Path(entry.staging), Path(entry.target)])
        conditions = [(e.reason, e.message) for e in health.health_statuses]
        if not conditions:
            if self._abnormal.pop(entry.target, None) is not None:
                LOG.info("health events: %s is healthy again", entry.target)
            return
        if self.node.published.get(entry.target) != entry:
            return  # unpublished (or published anew) while it was checked
        if self.node.unpublished(Path(entry.target)):
            # a record whose removal failed at its unpublish (a read-only state disk then):
            # its pod and target are gone, no Event names it
            self._abnormal.pop(entry.target, None)
            try:
                self.node.published.delete(entry.target)
            except StateError as exc:
                LOG.warning("health events: %s: %s", entry.target, exc.message)
                return
            LOG.info("health events: %s is published no more: its record removed", entry.target)
            return
        now = self._clock()
        reasons = tuple(sorted(reason for reason, _ in conditions))
        seen = self._abnormal.get(entry.target)
        if seen is not None and seen[0] == reasons:
            if now - seen[2] < REPEAT:
                return
            message = seen[1]  # the same Event counted again, whatever the text says now
        else:
            text = "; ".join(f"{reason}: {message}" for reason, message in conditions)
            message = one_line(f"Volume {entry.pv}: {text}", MESSAGE_LIMIT)
        pod = entry.pod
        meta = {"name": pod.name, "namespace": pod.namespace, "uid": pod.uid}
        if self.recorder.pod(meta, "Warning", REASON, message):
            self._abnormal[entry.target] = (reasons, message, now)
            LOG.warning("health events: %s/%s: %s", pod.namespace, pod.name, one_line(message, 300))


def events_api(kubeconfig: Path | None) -> Any:
    """A ``CoreV1Api`` from ``kubeconfig``, else the pod's service account; ``None`` (and one
    line logged, never the file's content) when there is neither or it cannot be loaded."""
    from flexhub.csi.kubeapi import core_api

    return core_api(kubeconfig, "health events off")


def start(node: _Node, node_id: str, interval: float, kubeconfig: Path | None) -> Any:
    """Start the watcher of ``node`` (``None``: off, ``interval`` 0 or no API client)."""
    if interval <= 0:
        LOG.info("health events off (--health-interval 0)")
        return None
    core = events_api(kubeconfig)
    if core is None:
        return None
    from flexhub.provisioner.events import CountingRecorder

    recorder = CountingRecorder(core, COMPONENT, node_id, host=node_id, timeout=API_TIMEOUT)
    watcher = HealthWatcher(node, recorder, interval)
    watcher.start()
    return watcher
