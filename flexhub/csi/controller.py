"""The CSI Controller service: volumes made and reclaimed through the provisioning API.

``CreateVolume`` reads its parameters as the FlexVolume provisioner reads a StorageClass
(:func:`flexhub.provisioner.storageclass.read_class`: ``backend`` picks the backend, the rest
is validated against its provision schema and ``check_parameters``), makes a
:class:`~flexhub.provisioning.Claim` whose uid is derived from the request's name (uuid5), so
the volume id (``<backend>:<uid>``) is stable and a retried create finds what the first made,
and calls the backend's ``provision``. ``DeleteVolume`` calls its ``reclaim`` with what
``provision`` returned (:mod:`flexhub.csi.records`). A volume kept on one node (loopfile,
``reclaim_on = "node"``) is made on the node the request's topology prefers (else this
plugin's own node) and is reclaimed only by the plugin of that node. A volume ``flexhub
convert`` moved from FlexVolume has its record in the API instead (:mod:`flexhub.csi.adopted`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

import grpc
from google.protobuf.wrappers_pb2 import Int64Value

from flexhub.config import NodeConfig
from flexhub.csi import TOPOLOGY_NODE_KEY
from flexhub.csi.adopted import Adoptions
from flexhub.csi.proto import csi_pb2, csi_pb2_grpc
from flexhub.csi.records import CONVERTED, UID, VolumeRecord, VolumeRecords, uid_of_volume
from flexhub.csi.snapshotrpcs import SnapshotRpcs
from flexhub.csi.snapshots import (
    SnapshotIntents,
    SnapshotRecords,
    copy_options,
    uid_of_snapshot,
)
from flexhub.csi.status import CsiError, InFlight, rpc
from flexhub.csi.volumes import (
    CONTEXT_FS_TYPE,
    CONTEXT_NAMESPACE,
    check_capability,
    invalid,
    secrets_of,
)
from flexhub.errors import FlexhubError, InvalidOptions

__all__ = ["DEFAULT_SIZE", "ControllerService", "volume_uid"]

LOG = logging.getLogger(__name__)

#: The size of a volume whose request names none (the spec leaves it to the plugin).
DEFAULT_SIZE = 1 << 30
#: uuid5 namespace of the uids derived from CreateVolume names.
_NAMESPACE = uuid.UUID("6f1e6d2a-3c1b-5b8e-9d7a-2f4c8e0b1a53")
_SIDECAR_PREFIX = "csi.storage.k8s.io/"
_Mode = csi_pb2.VolumeCapability.AccessMode.Mode
_ACCESS_MODES = {
    _Mode.SINGLE_NODE_WRITER: "ReadWriteOnce",
    _Mode.SINGLE_NODE_READER_ONLY: "ReadWriteOnce",
    _Mode.SINGLE_NODE_MULTI_WRITER: "ReadWriteOnce",
    _Mode.SINGLE_NODE_SINGLE_WRITER: "ReadWriteOncePod",
    _Mode.MULTI_NODE_READER_ONLY: "ReadOnlyMany",
    _Mode.MULTI_NODE_SINGLE_WRITER: "ReadWriteMany",
    _Mode.MULTI_NODE_MULTI_WRITER: "ReadWriteMany",
}


def volume_uid(name: str) -> str:
    """The claim uid of a CreateVolume name: the same name, the same uid, on every host."""
    return str(uuid.uuid5(_NAMESPACE, name))


def _size(capacity_range: Any) -> int:
    required, limit = capacity_range.required_bytes, capacity_range.limit_bytes
    if required < 0 or limit < 0:
        raise invalid("capacity_range: negative bytes")
    if limit and required > limit:
        raise invalid(f"capacity_range: required_bytes {required} exceeds limit_bytes {limit}")
    if required:
        return int(required)
    return int(min(limit, DEFAULT_SIZE)) if limit else DEFAULT_SIZE


def _fits(size: int, capacity_range: Any) -> bool:
    required, limit = capacity_range.required_bytes, capacity_range.limit_bytes
    return size >= required and (not limit or size <= limit)


def _source_of(request: Any) -> str:
    """The content source a CreateVolume names, as its record keeps it: ``snapshot:<id>``,
    ``volume:<id>`` or ``""`` (none)."""
    if not request.HasField("volume_content_source"):
        return ""
    given = request.volume_content_source
    kind = given.WhichOneof("type")
    if kind == "snapshot":
        return f"snapshot:{given.snapshot.snapshot_id}"
    if kind == "volume":
        return f"volume:{given.volume.volume_id}"
    return "unknown:"


def _resized(record: VolumeRecord, size: int, source: str | None = None) -> VolumeRecord:
    """``record`` at ``size`` (and, given, of ``source``: a converted volume's)."""
    fields = record.to_json()
    fields["size"] = size
    if source is not None:
        fields["source"] = source
    return VolumeRecord(**fields)


class _Source:
    """The content source of a CreateVolume: a snapshot record or a volume record."""

    def __init__(
        self,
        backend: str,
        node: str,
        size: int,
        *,
        snapshot: dict[str, Any] | None = None,
        volume: VolumeRecord | None = None,
    ) -> None:
        self.backend, self.node, self.size = backend, node, size
        self.snapshot, self.volume = snapshot, volume
        self.what = (
            f"snapshot {snapshot['snapshot_id']}"
            if snapshot
            else f"volume {volume and volume.volume_id}"
        )


class ControllerService(SnapshotRpcs, csi_pb2_grpc.ControllerServicer):
    """Controller RPCs for every backend that provisions (mixes in ``Provisioning``)."""

    def __init__(
        self, config: NodeConfig, node_id: str, adoptions: Adoptions | None = None
    ) -> None:
        self.config = config
        self.node_id = node_id
        self.records = VolumeRecords(config.state_dir)
        #: the records of converted volumes (``None``: no API client, none adopted)
        self.adoptions = adoptions
        self.snapshots = SnapshotRecords(config.state_dir)
        self.intents = SnapshotIntents(config.state_dir)
        self.in_flight = InFlight()

    def _backend(self, name: str) -> Any:
        from flexhub.csi.volumes import backend_class
        from flexhub.node import Node
        from flexhub.provisioning import Provisioning

        cls = backend_class(name, self.config)
        if not issubclass(cls, Provisioning):
            raise invalid(f"backend {name!r} cannot provision volumes")
        cls.check_settings(name, self.config.backends.get(name, {}), self.config)
        return cls(Node(self.config, backend=name))

    def _node_of(self, requirements: Any) -> str:
        for topology in [*requirements.preferred, *requirements.requisite]:
            node = topology.segments.get(TOPOLOGY_NODE_KEY, "")
            if node:
                return str(node)
        return self.node_id

    def _record(self, uid: str, volume_id: str) -> tuple[VolumeRecord | None, bool]:
        """``(record of volume_id, whether it is a converted volume's)``: this controller's
        own, else the one ``flexhub convert`` left (:mod:`flexhub.csi.adopted`), its options
        checked against its backend's schema; ``(None, False)``: neither. A converted
        volume's record kept here (grown since: source :data:`CONVERTED`) counts only while
        convert's is there too (a rollback removes that, and the storage is the FlexVolume
        PV's again)."""
        record = self.records.get(uid) if uid else None
        if record is not None and record.volume_id != volume_id:
            return None, False
        if record is not None and (record.source != CONVERTED or self.adoptions is None):
            return record, record.source == CONVERTED
        if self.adoptions is None:
            return None, False
        adopted = self.adoptions.get(volume_id)
        if adopted is None:  # a converted volume kept here stands only with its ConfigMap
            return None, False  # (a rollback removed it: the FlexVolume PV's again)
        if record is not None:
            return record, True
        record = adopted
        from flexhub.driver.loader import load_backend
        from flexhub.driver.validation import validate_options

        try:
            validate_options(load_backend(record.backend, self.config), record.options)
        except FlexhubError as exc:
            raise CsiError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"volume {volume_id}: the converted volume's record is refused: {exc.message}",
            ) from None
        return record, True

    @rpc
    def ControllerGetCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        rpc_type = csi_pb2.ControllerServiceCapability.RPC.Type
        return csi_pb2.ControllerGetCapabilitiesResponse(
            capabilities=[
                csi_pb2.ControllerServiceCapability(
                    rpc=csi_pb2.ControllerServiceCapability.RPC(type=t)
                )
                for t in (
                    rpc_type.CREATE_DELETE_VOLUME,
                    rpc_type.LIST_VOLUMES,
                    rpc_type.EXPAND_VOLUME,
                    rpc_type.CREATE_DELETE_SNAPSHOT,
                    rpc_type.LIST_SNAPSHOTS,
                    rpc_type.GET_SNAPSHOT,
                    rpc_type.CLONE_VOLUME,
                    rpc_type.GET_CAPACITY,
                )
            ]
        )

    @rpc
    def CreateVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        name = request.name
        if not name:
            raise invalid("name is required")
        if not request.volume_capabilities:
            raise invalid("volume_capabilities is required")
        parameters = {
            k: v for k, v in request.parameters.items() if not k.startswith(_SIDECAR_PREFIX)
        }
        uid = volume_uid(name)
        with self.in_flight.hold(uid):
            record = self.records.get(uid)
            if record is not None:  # a retry: its source may be gone since, and need not be
                return self._existing(record, request, parameters)
            source = (
                self._content_source(request.volume_content_source)
                if request.HasField("volume_content_source")
                else None
            )
            unsized = not (
                request.capacity_range.required_bytes or request.capacity_range.limit_bytes
            )
            size = source.size if source is not None and unsized else _size(request.capacity_range)
            from flexhub.driver.loader import load_backend
            from flexhub.provisioner.storageclass import WAIT, read_class
            from flexhub.provisioning import Claim

            spec = read_class(
                {
                    "provisioner": "flexhub",
                    "parameters": parameters,
                    "volumeBindingMode": WAIT,
                },
                lambda backend: load_backend(backend, self.config),
            )
            backend = self._backend(spec.backend)
            for capability in request.volume_capabilities:
                reason = check_capability(capability, type(backend))
                if reason:
                    raise invalid(reason)
            modes = sorted({_ACCESS_MODES[c.access_mode.mode] for c in request.volume_capabilities})
            node = self._node_of(request.accessibility_requirements)
            if source is not None:
                node = self._check_source(source, backend, spec.backend, size)
            # external-provisioner passes the claim's namespace with --extra-create-metadata;
            # without it the claim is taken as the default namespace's
            namespace = request.parameters.get(f"{_SIDECAR_PREFIX}pvc/namespace") or "default"
            claim = Claim(
                uid=uid,
                namespace=namespace,
                name=request.parameters.get(f"{_SIDECAR_PREFIX}pvc/name", name),
                size=size,
                access_modes=tuple(modes),
                selected_node=node,
            )
            secrets = secrets_of(request.secrets)
            if source is None:
                made = backend.provision(claim, spec.parameters, secrets)
            elif source.snapshot is not None:
                made = backend.restore(claim, spec.parameters, source.snapshot["record"], secrets)
            else:
                assert source.volume is not None
                volume = source.volume
                made = backend.clone(
                    claim, spec.parameters, volume.options, volume.namespace, secrets
                )
            if not _fits(made.size, request.capacity_range):
                raise CsiError(
                    grpc.StatusCode.OUT_OF_RANGE,
                    f"backend {spec.backend} made {made.size} bytes, outside the capacity range",
                )
            options = {**made.options, "backend": spec.backend}
            fs_type = made.fs_type or spec.fs_type
            if source is not None:
                asked = {c.mount.fs_type for c in request.volume_capabilities}
                options = copy_options(options, {fs_type, *asked})
            record = VolumeRecord(
                name=name,
                volume_id=f"{spec.backend}:{uid}",
                backend=spec.backend,
                parameters=parameters,
                options=options,
                reclaim={**made.reclaim, "onDelete": spec.on_delete},
                namespace=namespace,
                size=made.size,
                fs_type=fs_type,
                node=made.node,
                source=_source_of(request),
            )
            self.records.put(uid, record)
            LOG.info(
                "created %s (%s, %d bytes%s)",
                record.volume_id,
                name,
                record.size,
                f", from {source.what}" if source is not None else "",
            )
            return csi_pb2.CreateVolumeResponse(volume=self._volume(record))

    def _content_source(self, given: Any) -> _Source:
        """The snapshot or volume a volume is made from (``NOT_FOUND`` when unknown)."""
        kind = given.WhichOneof("type")
        if kind == "snapshot":
            wanted = given.snapshot.snapshot_id
            uid = uid_of_snapshot(wanted)
            snapshot = self.snapshots.get(uid) if uid else None
            if snapshot is None or snapshot["snapshot_id"] != wanted:
                raise CsiError(grpc.StatusCode.NOT_FOUND, f"no snapshot {wanted[:200]!r}")
            return _Source(
                snapshot["backend"], snapshot["node"], int(snapshot["size"]), snapshot=snapshot
            )
        if kind == "volume":
            wanted = given.volume.volume_id
            uid = uid_of_volume(wanted)
            volume, _ = self._record(uid, wanted)  # a converted one too
            if volume is None:
                raise CsiError(grpc.StatusCode.NOT_FOUND, f"no volume {wanted[:200]!r}")
            return _Source(volume.backend, volume.node, volume.size, volume=volume)
        raise invalid("volume_content_source names neither a snapshot nor a volume")

    def _check_source(self, source: _Source, backend: Any, name: str, size: int) -> str:
        """The node a volume made from ``source`` lives on (the source's, for node-local
        backends), after the checks: same backend, snapshots served, room for the data."""
        if source.backend != name:
            raise invalid(f"the content source is a {source.backend} volume, not {name}")
        if not type(backend).snapshots:
            raise invalid(f"backend {name} cannot restore snapshots or clone volumes")
        if size < source.size:
            raise CsiError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"{size} bytes asked, less than the {source.size} of {source.what}",
            )
        self._on_its_node(backend, source.node, source.what)
        return source.node or self.node_id

    def _on_its_node(self, backend: Any, node: str, what: str) -> None:
        from flexhub.provisioning import NODE

        if type(backend).reclaim_on == NODE and node != self.node_id:
            raise CsiError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{what} lives on node {node!r}: only that node's plugin can use it",
            )

    def _existing(self, record: VolumeRecord, request: Any, parameters: Mapping[str, str]) -> Any:
        if dict(record.parameters) != parameters:
            raise CsiError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"volume {request.name!r} exists with other parameters",
            )
        wanted = _source_of(request)
        if record.source is not None and record.source != wanted:
            raise CsiError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"volume {request.name!r} exists "
                + (f"made from {record.source[:200]}" if record.source else "with no source")
                + ", not "
                + (f"from {wanted[:200]}" if wanted else "without one"),
            )
        if not _fits(record.size, request.capacity_range):
            raise CsiError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"volume {request.name!r} exists with {record.size} bytes, outside the "
                "requested capacity range",
            )
        # a record of the previous version keeps no source: the retry's is answered, as it was
        echo = wanted if record.source is None else None
        return csi_pb2.CreateVolumeResponse(volume=self._volume(record, echo))

    @staticmethod
    def _volume(record: VolumeRecord, source: str | None = None) -> Any:
        """The CSI volume of ``record``; its content source the record's (``source`` for a
        record that keeps none)."""
        context = {**record.options, CONTEXT_NAMESPACE: record.namespace}
        if record.fs_type:
            context[CONTEXT_FS_TYPE] = record.fs_type
        topology = (
            [csi_pb2.Topology(segments={TOPOLOGY_NODE_KEY: record.node})] if record.node else []
        )
        volume = csi_pb2.Volume(
            volume_id=record.volume_id,
            capacity_bytes=record.size,
            volume_context=context,
            accessible_topology=topology,
        )
        kind, _, given = (record.source if record.source is not None else source or "").partition(
            ":"
        )
        if kind == "snapshot":
            volume.content_source.snapshot.snapshot_id = given
        elif kind == "volume":
            volume.content_source.volume.volume_id = given
        return volume

    @rpc
    def DeleteVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.volume_id:
            raise invalid("volume_id is required")
        uid = uid_of_volume(request.volume_id)
        if not uid:
            LOG.info("%s was never made here: nothing to delete", request.volume_id[:200])
            return csi_pb2.DeleteVolumeResponse()
        with self.in_flight.hold(uid):
            record, converted = self._record(uid, request.volume_id)
            if record is None:
                LOG.info("%s is gone already", request.volume_id)
                return csi_pb2.DeleteVolumeResponse()
            backend = self._backend(record.backend)
            from flexhub.provisioning import NODE

            if type(backend).reclaim_on == NODE and record.node != self.node_id:
                raise CsiError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"volume {record.volume_id} lives on node {record.node!r}: only that "
                    "node's plugin can delete it",
                )
            backend.reclaim(record.options, record.backend_reclaim(), secrets_of(request.secrets))
            if type(backend).snapshots:
                self._forget_intents(record)
            self.records.delete(uid)
            if converted and self.adoptions is not None:  # grown here: both records
                self.adoptions.forget(record.volume_id)
            LOG.info("deleted %s%s", record.volume_id, " (converted)" if converted else "")
        return csi_pb2.DeleteVolumeResponse()

    @rpc
    def ValidateVolumeCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.volume_id:
            raise invalid("volume_id is required")
        if not request.volume_capabilities:
            raise invalid("volume_capabilities is required")
        uid = uid_of_volume(request.volume_id)
        record, _ = self._record(uid, request.volume_id)
        if record is None:
            raise CsiError(grpc.StatusCode.NOT_FOUND, f"no volume {request.volume_id[:200]!r}")
        try:
            cls = type(self._backend(record.backend))
        except FlexhubError as exc:
            raise CsiError(grpc.StatusCode.FAILED_PRECONDITION, exc.message) from None
        for capability in request.volume_capabilities:
            reason = check_capability(capability, cls)
            if reason:
                return csi_pb2.ValidateVolumeCapabilitiesResponse(message=reason)
        return csi_pb2.ValidateVolumeCapabilitiesResponse(
            confirmed=csi_pb2.ValidateVolumeCapabilitiesResponse.Confirmed(
                volume_context=request.volume_context,
                volume_capabilities=request.volume_capabilities,
                parameters=request.parameters,
            )
        )

    @rpc
    def ListVolumes(self, request: Any, context: grpc.ServicerContext) -> Any:
        """The volumes this controller made, by uid; ``next_token`` is the last uid of the
        page, so a volume deleted between pages (the token's own too) shifts nothing."""
        if request.max_entries < 0:
            raise invalid("max_entries must not be negative")
        token = request.starting_token
        if token and not UID.fullmatch(token):
            raise CsiError(grpc.StatusCode.ABORTED, f"starting_token {token[:80]!r} is not ours")
        uids = [u for u in self.records.uids() if u > token]
        page = uids[: request.max_entries] if request.max_entries else uids
        entries = []
        for uid in page:
            record = self.records.get(uid)
            if record is not None and record.source == CONVERTED:
                record, _ = self._record(uid, record.volume_id)
            if record is not None:  # deleted meanwhile (or rolled back)
                entries.append(csi_pb2.ListVolumesResponse.Entry(volume=self._volume(record)))
        more = request.max_entries and len(uids) > len(page)
        return csi_pb2.ListVolumesResponse(entries=entries, next_token=page[-1] if more else "")

    @rpc
    def ControllerExpandVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        """The backend's ``expand_storage`` where it grows storage on its side (a LUN);
        otherwise only the record: the node grows a loop file, NFS enforces no size."""
        if not request.volume_id:
            raise invalid("volume_id is required")
        new_size = request.capacity_range.required_bytes or request.capacity_range.limit_bytes
        if new_size <= 0:
            raise invalid("capacity_range: the new size is required")
        uid = uid_of_volume(request.volume_id)
        with self.in_flight.hold(uid or request.volume_id):
            record, converted = self._record(uid, request.volume_id)
            if record is None:
                raise CsiError(grpc.StatusCode.NOT_FOUND, f"no volume {request.volume_id!r}")
            backend = self._backend(record.backend)
            from flexhub.backend import BlockBackend

            size = record.size
            if new_size > record.size:
                try:
                    backend.check_expansion(record.options, new_size)
                except InvalidOptions as exc:
                    raise CsiError(grpc.StatusCode.OUT_OF_RANGE, exc.message) from None
                if type(backend).expands_storage:
                    size = int(
                        backend.expand_storage(
                            record.options,
                            record.backend_reclaim(),
                            new_size,
                            secrets_of(request.secrets),
                        )
                    )
                else:
                    size = new_size
                self.records.put(uid, _resized(record, size, CONVERTED if converted else None))
                LOG.info("expanded %s to %d bytes", record.volume_id, size)
        return csi_pb2.ControllerExpandVolumeResponse(
            capacity_bytes=size, node_expansion_required=isinstance(backend, BlockBackend)
        )

    @rpc
    def GetCapacity(self, request: Any, context: grpc.ServicerContext) -> Any:
        """The backend's ``capacity`` for the parameters' ``backend`` (none named: the sum
        over the configured backends that know theirs); the largest volume is that, or less
        where the class bounds it (``max_volume_size``: loopfile's ``maxSize``). A node-local
        backend's room is this node's: another node's topology is ``FAILED_PRECONDITION`` (run
        a controller per node, external-provisioner's ``--node-deployment``)."""
        from flexhub.errors import NotSupported
        from flexhub.provisioning import NODE

        parameters = {
            k: v for k, v in request.parameters.items() if not k.startswith(_SIDECAR_PREFIX)
        }
        named = parameters.pop("backend", "")
        node = request.accessible_topology.segments.get(TOPOLOGY_NODE_KEY, "")
        total = largest = 0
        for name in [named] if named else sorted(self.config.backends):
            try:
                backend = self._backend(name)
            except (CsiError, FlexhubError):
                if named:
                    raise
                continue
            if node and node != self.node_id and type(backend).reclaim_on == NODE:
                raise CsiError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the room of node {node!r} is measured by that node's plugin",
                )
            try:
                room = int(backend.capacity(parameters))
            except NotSupported:
                if named:
                    raise
                continue
            total += room
            bound = backend.max_volume_size(parameters)
            largest = max(largest, room if bound is None else min(room, int(bound)))
        return csi_pb2.GetCapacityResponse(
            available_capacity=total, maximum_volume_size=Int64Value(value=largest)
        )
