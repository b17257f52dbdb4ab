"""The CSI controller's snapshot RPCs (``CreateSnapshot``, ``DeleteSnapshot``, ``GetSnapshot``,
``ListSnapshots``), a part of :class:`~flexhub.csi.controller.ControllerService`: what they
keep and how a restore uses it is :mod:`flexhub.csi.snapshots`."""

from __future__ import annotations

import logging
from typing import Any

import grpc

from flexhub.csi.proto import csi_pb2
from flexhub.csi.records import UID, uid_of_volume
from flexhub.csi.snapshots import new_record, snapshot_message, snapshot_uid, uid_of_snapshot
from flexhub.csi.status import CsiError, rpc
from flexhub.csi.volumes import invalid, secrets_of
from flexhub.errors import InvalidOptions, NoRoom

__all__ = ["SnapshotRpcs"]

LOG = logging.getLogger(__name__)


class SnapshotRpcs:
    """The snapshot RPCs; the controller gives them ``records``, ``snapshots``, ``in_flight``,
    ``_backend``, ``_on_its_node`` and ``_record``."""

    records: Any
    snapshots: Any
    intents: Any
    in_flight: Any

    def _backend(self, name: str) -> Any:
        raise NotImplementedError

    def _on_its_node(self, backend: Any, node: str, what: str) -> None:
        raise NotImplementedError

    def _record(self, uid: str, volume_id: str) -> tuple[Any, bool]:
        raise NotImplementedError

    @rpc
    def CreateSnapshot(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.name:
            raise invalid("name is required")
        if not request.source_volume_id:
            raise invalid("source_volume_id is required")
        uid = snapshot_uid(request.name)
        with self.in_flight.hold(uid):
            existing = self.snapshots.get(uid)
            if existing is not None:
                if existing["source_volume_id"] != request.source_volume_id:
                    raise CsiError(
                        grpc.StatusCode.ALREADY_EXISTS,
                        f"snapshot {request.name[:200]!r} exists of another volume",
                    )
                self.intents.delete(uid)  # one a call killed after recording left
                return csi_pb2.CreateSnapshotResponse(snapshot=snapshot_message(existing))
            intent = self.intents.get(uid)
            if intent is not None and intent["source_volume_id"] != request.source_volume_id:
                raise CsiError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"snapshot {request.name[:200]!r} was begun of another volume",
                )
            vuid = uid_of_volume(request.source_volume_id)
            source, _ = self._record(vuid, request.source_volume_id)  # a converted one too
            if source is None:
                raise CsiError(
                    grpc.StatusCode.NOT_FOUND, f"no volume {request.source_volume_id[:200]!r}"
                )
            backend = self._backend(source.backend)
            if not type(backend).snapshots:
                raise invalid(f"backend {source.backend} cannot make snapshots")
            self._on_its_node(backend, source.node, f"volume {source.volume_id}")
            with self.in_flight.hold(vuid):  # first: an ABORTED call writes no intent
                wrote = intent is None
                if wrote:
                    intent = {"name": request.name, "source_volume_id": source.volume_id}
                    self.intents.put(uid, intent)
                try:
                    record = self._snapshot_of(source, backend, uid, request.name, request.secrets)
                except (InvalidOptions, NoRoom):
                    # refused: this call made nothing; an intent a killed call left stays (what
                    # that call made may exist)
                    if wrote:
                        self.intents.delete(uid)
                    raise
            return csi_pb2.CreateSnapshotResponse(snapshot=snapshot_message(record))

    def _snapshot_of(
        self, source: Any, backend: Any, uid: str, name: str, secrets: Any
    ) -> dict[str, Any]:
        """The backend's snapshot ``snap-<uid>`` of the volume record ``source`` (made, or
        found as a killed call made it), recorded; its intent removed."""
        made = backend.snapshot(
            source.options,
            source.backend_reclaim(),
            f"snap-{uid}",
            source.namespace,
            secrets_of(secrets),
        )
        record = new_record(name, uid, source, dict(made), source.node)
        self.snapshots.put(uid, record)
        self.intents.delete(uid)
        LOG.info(
            "snapshot %s of %s: %d bytes, %s",
            record["snapshot_id"],
            source.volume_id,
            record["size"],
            made.get("how", "copied"),
        )
        return record

    def _forget_intents(self, source: Any) -> None:
        """Before the volume record ``source`` is deleted (its in-flight hold taken, so no
        CreateSnapshot of it is running): the intents of its snapshots whose calls were killed
        before they recorded one are removed, and each is named in the log. Nothing is made
        here: a snapshot such a call may have left on the storage (``snap-<uid>``) is the
        operator's to remove (docs/csi.md, Known limits); Kubernetes keeps a claim whose
        snapshot is being made from deletion (the snapshot controller's finalizer)."""
        for uid in self.intents.uids():
            intent = self.intents.get(uid)
            if intent is None or intent["source_volume_id"] != source.volume_id:
                continue
            LOG.warning(
                "CreateSnapshot %r of %s never finished: its intent is removed with the volume; "
                "if snapshot snap-%s exists on the volume's storage, remove it by hand",
                str(intent.get("name", ""))[:200],
                source.volume_id,
                uid,
            )
            self.intents.delete(uid)

    @rpc
    def DeleteSnapshot(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.snapshot_id:
            raise invalid("snapshot_id is required")
        uid = uid_of_snapshot(request.snapshot_id)
        if not uid:
            LOG.info("%s was never made here: nothing to delete", request.snapshot_id[:200])
            return csi_pb2.DeleteSnapshotResponse()
        with self.in_flight.hold(uid):
            record = self.snapshots.get(uid)
            if record is None or record["snapshot_id"] != request.snapshot_id:
                return csi_pb2.DeleteSnapshotResponse()
            self.intents.delete(uid)  # one a call killed after recording left
            backend = self._backend(record["backend"])
            self._on_its_node(backend, record["node"], f"snapshot {record['snapshot_id']}")
            backend.delete_snapshot(record["record"], secrets_of(request.secrets))
            self.snapshots.delete(uid)
            LOG.info("deleted snapshot %s", record["snapshot_id"])
        return csi_pb2.DeleteSnapshotResponse()

    @rpc
    def GetSnapshot(self, request: Any, context: grpc.ServicerContext) -> Any:
        """One snapshot this controller made, as ``ListSnapshots`` lists it; ``NOT_FOUND``
        for any other id."""
        if not request.snapshot_id:
            raise invalid("snapshot_id is required")
        uid = uid_of_snapshot(request.snapshot_id)
        record = self.snapshots.get(uid) if uid else None
        if record is None or record["snapshot_id"] != request.snapshot_id:
            raise CsiError(
                grpc.StatusCode.NOT_FOUND, f"snapshot {request.snapshot_id[:200]} not found"
            )
        return csi_pb2.GetSnapshotResponse(snapshot=snapshot_message(record))

    @rpc
    def ListSnapshots(self, request: Any, context: grpc.ServicerContext) -> Any:
        """The snapshots this controller made, by uid, paged as ``ListVolumes``; filtered
        by ``snapshot_id`` or ``source_volume_id`` (an unknown one: an empty list)."""
        if request.max_entries < 0:
            raise invalid("max_entries must not be negative")
        token = request.starting_token
        if token and not UID.fullmatch(token):
            raise CsiError(grpc.StatusCode.ABORTED, f"starting_token {token[:80]!r} is not ours")
        if request.snapshot_id:
            one = uid_of_snapshot(request.snapshot_id)
            uids = [one] if one and one > token else []
        else:
            uids = [u for u in self.snapshots.uids() if u > token]
        records = []
        for uid in uids:
            record = self.snapshots.get(uid)
            if record is None:
                continue
            if request.snapshot_id and record["snapshot_id"] != request.snapshot_id:
                continue
            if request.source_volume_id and record["source_volume_id"] != request.source_volume_id:
                continue
            records.append((uid, record))
        page = records[: request.max_entries] if request.max_entries else records
        more = request.max_entries and len(records) > len(page)
        return csi_pb2.ListSnapshotsResponse(
            entries=[
                csi_pb2.ListSnapshotsResponse.Entry(snapshot=snapshot_message(r)) for _, r in page
            ],
            next_token=page[-1][0] if more else "",
        )
