"""The CSI controller's snapshots and clones, through the optional snapshot methods of the
provisioning API (:attr:`~flexhub.provisioning.Provisioning.snapshots`).

``CreateSnapshot`` derives the snapshot's uid from the request's name (uuid5, as volumes), so a
retry finds what the first call made (the backend's snapshot is named after it too, so a call
killed before it recorded anything is found again: :class:`SnapshotIntents`); the snapshot
id is ``<backend>:snapshot:<uid>``, and what the backend returned is kept in
``<state_dir>/csi/snapshots/<uid>.json`` (0600, never a secret). A snapshot of a node-local
volume (loopfile) is made and deleted by the plugin of the volume's node, and a volume
restored or cloned from it is made on that node, with that node as its topology: the
scheduler cannot place its first pod elsewhere (csi-driver-host-path's restore deadlock under
``WaitForFirstConsumer``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc

from flexhub.csi.proto import csi_pb2
from flexhub.csi.records import UID, UidRecords
from flexhub.csi.status import CsiError

__all__ = [
    "SnapshotIntents",
    "SnapshotRecords",
    "copy_options",
    "snapshot_id",
    "snapshot_message",
    "snapshot_uid",
]

LOG = logging.getLogger(__name__)

_NAMESPACE = uuid.UUID("0b6a3c1e-7d42-5f0e-a1c9-3e8d5b2f4a61")
_KEYS = ("name", "snapshot_id", "source_volume_id", "backend", "record", "size", "created", "node")


def snapshot_uid(name: str) -> str:
    """The uid of a CreateSnapshot name: the same name, the same uid."""
    return str(uuid.uuid5(_NAMESPACE, name))


def snapshot_id(backend: str, uid: str) -> str:
    return f"{backend}:snapshot:{uid}"


def uid_of_snapshot(text: str) -> str:
    """The uid of ``<backend>:snapshot:<uid>`` (``""`` for an id not of that shape)."""
    head, _, uid = text.rpartition(":")
    return uid if head.endswith(":snapshot") and UID.fullmatch(uid) else ""


class SnapshotRecords(UidRecords[dict[str, Any]]):
    """The records under ``<state_dir>/csi/snapshots``: plain JSON objects of :data:`_KEYS`."""

    kind = "snapshot"

    def __init__(self, state_dir: Path) -> None:
        super().__init__(state_dir / "csi" / "snapshots")

    def _decode(self, data: dict[str, Any]) -> dict[str, Any]:
        return {k: data[k] for k in _KEYS}

    def put(self, uid: str, record: dict[str, Any]) -> None:
        self._put(uid, record)


class SnapshotIntents(UidRecords[dict[str, Any]]):
    """``<state_dir>/csi/snapshot-intents``: a snapshot asked of the backend and not yet
    recorded (``name``, ``source_volume_id``), written before the backend is called and
    removed once the record is. One left behind is a call killed in between, whose snapshot
    may exist: its retry must be of the same volume (``ALREADY_EXISTS`` otherwise), and the
    deletion of that volume records the snapshot first (never an orphan)."""

    kind = "snapshot intent"

    def __init__(self, state_dir: Path) -> None:
        super().__init__(state_dir / "csi" / "snapshot-intents")

    def _decode(self, data: dict[str, Any]) -> dict[str, Any]:
        return {"name": str(data["name"]), "source_volume_id": str(data["source_volume_id"])}

    def put(self, uid: str, intent: dict[str, Any]) -> None:
        self._put(uid, intent)


def snapshot_message(record: dict[str, Any]) -> Any:
    """The CSI ``Snapshot`` of a record."""
    from google.protobuf.timestamp_pb2 import Timestamp

    created = Timestamp()
    created.FromNanoseconds(int(float(record["created"]) * 1e9))
    return csi_pb2.Snapshot(
        size_bytes=int(record["size"]),
        snapshot_id=record["snapshot_id"],
        source_volume_id=record["source_volume_id"],
        creation_time=created,
        ready_to_use=True,
    )


def new_record(name: str, uid: str, source: Any, made: dict[str, str], node: str) -> dict[str, Any]:
    """The record of a snapshot the backend ``made`` of the volume record ``source``."""
    if not made.get("size", "").isdigit():
        raise CsiError(grpc.StatusCode.INTERNAL, f"backend {source.backend} gave no snapshot size")
    return {
        "name": name,
        "snapshot_id": snapshot_id(source.backend, uid),
        "source_volume_id": source.volume_id,
        "backend": source.backend,
        "record": dict(made),
        "size": int(made["size"]),
        "created": time.time(),
        "node": node,
    }


def copy_options(options: Mapping[str, str], fs_types: Iterable[str]) -> dict[str, str]:
    """The options of a volume made from a snapshot or a volume: a copy of its source's
    filesystem, UUID included. The kernel refuses to mount an xfs whose UUID a mounted one
    has ("Filesystem has duplicate UUID"), and a copy is often mounted beside its source (a
    pod still uses it), so an xfs copy mounts with ``nouuid``; ext3 and ext4 check no UUID."""
    if "xfs" not in fs_types:
        return dict(options)
    given = [o for o in options.get("mountOptions", "").split(",") if o]
    if "nouuid" in given:
        return dict(options)
    return {**options, "mountOptions": ",".join([*given, "nouuid"])}
