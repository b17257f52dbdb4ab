"""What the node plugin keeps of each ``NodePublishVolume``: the target, its volume and the
pod the kubelet published it for, so that the health watcher (:mod:`flexhub.csi.healthevents`)
can name the pod of a volume turned abnormal.

``<state_dir>/csi/published/<sha256(target)[:32]>.json`` (0600), written once the target is
published (again on an idempotent retry), removed before it is unpublished. Never a secret
and never an option value: the volume id, the staging and target paths, the PV's name and the
pod's name, namespace and uid.

The pod comes only from the kubelet: with ``podInfoOnMount: true`` in the CSIDriver it adds
``csi.storage.k8s.io/pod.name``, ``pod.namespace`` and ``pod.uid`` to the volume context of a
publish (never of a stage), over the root-only CSI socket. It is believed only when

* the target path is the kubelet's for that pod (``.../pods/<uid>/volumes/kubernetes.io~csi/
  <pv>/mount``, or ``.../plugins/kubernetes.io/csi/volumeDevices/publish/<pv>/<uid>`` for a
  raw block volume) and its uid is the context's, and
* the volume context of the stage carried none of those keys (the kubelet adds them to a
  publish alone: at stage they are the PV author's, who could name any pod with them while
  the CSIDriver says ``podInfoOnMount: false``).

Otherwise the publish is recorded without a pod (no Event names one) and a warning says why,
once per publish.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from flexhub.csi.records import _write_json, remove_record
from flexhub.errors import StateError

__all__ = ["POD_KEYS", "PodRef", "Published", "PublishedTargets", "pod_of_publish"]

LOG = logging.getLogger(__name__)

#: The volume context keys the kubelet adds to a publish with ``podInfoOnMount: true``.
POD_NAME = "csi.storage.k8s.io/pod.name"
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_UID = "csi.storage.k8s.io/pod.uid"
POD_KEYS = (
    POD_NAME,
    POD_NAMESPACE,
    POD_UID,
    "csi.storage.k8s.io/serviceAccount.name",
    "csi.storage.k8s.io/ephemeral",
)
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a DNS subdomain
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS label
_UID = re.compile(r"[0-9A-Za-z][-0-9A-Za-z]{0,63}")  # a uuid; a static pod's is a hash
_MOUNT_TARGET = re.compile(r"/pods/(?P<uid>[^/]+)/volumes/kubernetes\.io~csi/(?P<pv>[^/]+)/mount")
_BLOCK_TARGET = re.compile(
    r"/plugins/kubernetes\.io/csi/volumeDevices/publish/(?P<pv>[^/]+)/(?P<uid>[^/]+)"
)


@dataclass(frozen=True)
class PodRef:
    """A pod as the kubelet named it."""

    name: str
    namespace: str
    uid: str


@dataclass(frozen=True)
class Published:
    """One published target: its volume, where it is staged, the PV's name (``""`` when the
    target is no kubelet path) and its pod (``None``: not known, or not believed)."""

    target: str
    volume_id: str
    staging: str
    pv: str
    pod: PodRef | None


def target_parts(target: str) -> tuple[str, str]:
    """``(pv name, pod uid)`` of a kubelet target path; ``("", "")`` for any other path."""
    match = _MOUNT_TARGET.search(target) or _BLOCK_TARGET.search(target)
    if match is None or match.end() != len(target):
        return "", ""
    return match["pv"], match["uid"]


def pod_of_publish(
    volume_id: str,
    target: str,
    context: Mapping[str, str],
    staged_context: Mapping[str, str] | None,
) -> PodRef | None:
    """The pod a publish is for, when the kubelet said so and the target path agrees
    (module doc); ``None`` otherwise, with one warning when what was given is not believed."""
    given = [context.get(k, "") for k in (POD_NAME, POD_NAMESPACE, POD_UID)]
    if not any(given):
        return None  # podInfoOnMount off: nothing to believe
    name, namespace, uid = given
    _, path_uid = target_parts(target)
    why = ""
    if staged_context is not None and any(k in staged_context for k in POD_KEYS):
        why = "the stage's volume context already named a pod (the PV's attributes, not kubelet)"
    elif not (_NAME.fullmatch(name) and _NAMESPACE.fullmatch(namespace) and _UID.fullmatch(uid)):
        why = "the pod's name, namespace or uid is malformed"
    elif not path_uid:
        why = "the target is not a kubelet pod path"
    elif path_uid != uid:
        why = "the pod uid is not the target path's"
    if why:
        LOG.warning(
            "publish of %s on %s: pod identity not believed, no Event will name a pod: %s",
            volume_id,
            target,
            why,
        )
        return None
    return PodRef(name, namespace, uid)


class PublishedTargets:
    """The records under ``<state_dir>/csi/published`` (module doc)."""

    def __init__(self, state_dir: Path) -> None:
        self.directory = state_dir / "csi" / "published"

    def _path(self, target: str) -> Path:
        return self.directory / f"{hashlib.sha256(target.encode()).hexdigest()[:32]}.json"

    def put(self, entry: Published) -> None:
        pod = entry.pod
        data = {
            "target": entry.target,
            "volume_id": entry.volume_id,
            "staging": entry.staging,
            "pv": entry.pv,
            "pod": None if pod is None else [pod.name, pod.namespace, pod.uid],
        }
        _write_json(self.directory, self._path(entry.target), data, f"record of {entry.target}")

    def get(self, target: str) -> Published | None:
        try:
            found = _decode(json.loads(self._path(target).read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StateError(f"publish record of {target} unreadable: {exc}") from None
        return found if found.target == target else None

    def all(self) -> list[Published]:
        """Every record, by target; an unreadable one is skipped (and logged)."""
        found = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                found.append(_decode(json.loads(path.read_text())))
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as exc:
                LOG.warning("publish record %s unreadable, skipped: %s", path.name, exc)
        return sorted(found, key=lambda p: p.target)

    def delete(self, target: str) -> None:
        """Remove ``target``'s record; none is no write (:func:`remove_record`: a target
        published before the records were kept, on a read-only state disk)."""
        remove_record(self._path(target), f"the publish record of {target}")


def _decode(data: dict[str, object]) -> Published:
    pod = data["pod"]
    ref = None
    if pod is not None:
        if not (isinstance(pod, list) and len(pod) == 3):
            raise ValueError("pod is not [name, namespace, uid]")
        ref = PodRef(str(pod[0]), str(pod[1]), str(pod[2]))
    return Published(
        str(data["target"]), str(data["volume_id"]), str(data["staging"]), str(data["pv"]), ref
    )
