"""The CSI Node service: stage once per node, publish per pod, through the FlexVolume core.

* ``NodeStageVolume`` is the FlexVolume driver's ``mount`` with the CO's staging directory as
  the mount directory (:func:`flexhub.node.volumes.mount_volume`): the same journal, locks,
  safe format and, for block backends, flexhub's own staging mount per node bound into it.
* ``NodeUnstageVolume`` is the driver's ``unmount`` of it
  (:func:`flexhub.node.volumes.unmount_volume`): the last user releases the device.
* ``NodePublishVolume`` bind-mounts the staged directory on the pod's target path (read-only
  when asked, verified), ``NodeUnpublishVolume`` unmounts it and removes the target path.
* ``VOLUME_MOUNT_GROUP``: the capability's ``volume_mount_group`` (the pod's fsGroup) is
  applied at stage and at each read-write publish as the FlexVolume driver applies fsGroup
  (:func:`flexhub.csi.volumes.mount_group`).
* ``NodeGetVolumeStats`` is ``statvfs`` of a mounted volume path (bytes and inodes).
* ``NodeGetVolumeHealth`` (``GET_VOLUME_HEALTH``, v1.13's successor of ``VOLUME_CONDITION``):
  ``INACCESSIBLE`` with a reason and a one-line message for a path that holds no mount, is a
  stale mount or does not answer a stat in time; no entry for a healthy volume
  (:mod:`flexhub.csi.health`).

A second call on a volume while one runs is refused with ``ABORTED`` (:class:`InFlight`).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc

from flexhub.backend import BlockBackend
from flexhub.config import NodeConfig
from flexhub.csi import TOPOLOGY_NODE_KEY
from flexhub.csi.proto import csi_pb2, csi_pb2_grpc
from flexhub.csi.published import Published, PublishedTargets, pod_of_publish, target_parts
from flexhub.csi.rawpublish import publish_raw, refuse_while_published
from flexhub.csi.records import StagedContexts
from flexhub.csi.status import CsiError, InFlight, rpc
from flexhub.csi.volumes import (
    READ_ONLY_MODES,
    flexhub_volume,
    invalid,
    is_block,
    mount_group,
)
from flexhub.errors import FlexhubError, StateError

__all__ = ["NodeService"]

LOG = logging.getLogger(__name__)

_Cap = csi_pb2.NodeServiceCapability.RPC.Type
_SINGLE_WRITER = csi_pb2.VolumeCapability.AccessMode.Mode.SINGLE_NODE_SINGLE_WRITER


def _require(value: str, what: str) -> str:
    if not value:
        raise invalid(f"{what} is required")
    if "\0" in value:
        raise invalid(f"{what} must not contain a NUL character")
    return value


def _path(value: str, what: str) -> Path:
    _require(value, what)
    if not os.path.isabs(value):
        raise invalid(f"{what} {value[:200]!r} is not an absolute path")
    return Path(os.path.normpath(value))


class NodeService(csi_pb2_grpc.NodeServicer):
    """Node RPCs for every installed backend (the volume context's ``backend`` picks)."""

    def __init__(self, config: NodeConfig, node_id: str) -> None:
        self.config = config
        self.node_id = node_id
        self.in_flight = InFlight()
        self.staged = StagedContexts(config.state_dir)
        self.published = PublishedTargets(config.state_dir)

    def _node(self) -> Any:
        from flexhub.node import Node

        return Node(self.config)

    def upgrade_records(self) -> None:
        """Before serving: bring what an earlier release journalled up to date (the raw
        stages' pod records say ``access: raw``: :func:`flexhub.node.rawblock.mark_raw_records`).
        A failure is logged; the plugin serves anyway."""
        from flexhub.driver.loader import backend_factory
        from flexhub.node.rawblock import mark_raw_records

        try:
            legacy = [path for path, _, access in self.staged.entries() if not access]
            marked = mark_raw_records(self._node(), legacy, backend_factory(self.config))
        except (FlexhubError, OSError) as exc:
            LOG.error("cannot bring the raw stages' pod records up to date: %s", exc)
            return
        if marked:
            LOG.info("%d raw stage record(s) of an earlier release now say access: raw", marked)

    @rpc
    def NodeGetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return csi_pb2.NodeGetInfoResponse(
            node_id=self.node_id,
            accessible_topology=csi_pb2.Topology(segments={TOPOLOGY_NODE_KEY: self.node_id}),
        )

    @rpc
    def NodeGetCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        return csi_pb2.NodeGetCapabilitiesResponse(
            capabilities=[
                csi_pb2.NodeServiceCapability(rpc=csi_pb2.NodeServiceCapability.RPC(type=t))
                for t in (
                    _Cap.STAGE_UNSTAGE_VOLUME,
                    _Cap.GET_VOLUME_STATS,
                    _Cap.EXPAND_VOLUME,
                    _Cap.SINGLE_NODE_MULTI_WRITER,
                    _Cap.GET_VOLUME_HEALTH,
                    _Cap.VOLUME_MOUNT_GROUP,
                )
            ]
        )

    @rpc
    def NodeStageVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        volume_id = _require(request.volume_id, "volume_id")
        staging = _path(request.staging_target_path, "staging_target_path")
        if not request.HasField("volume_capability"):
            raise invalid("volume_capability is required")
        from flexhub.node.volumes import mount_volume

        with self.in_flight.hold(volume_id):
            volume, backend, node = flexhub_volume(
                request.volume_context,
                request.volume_capability,
                request.secrets,
                self.config,
            )
            if not staging.is_dir():
                raise invalid(f"staging_target_path {staging} is not a directory")
            raw = is_block(request.volume_capability)
            previous = self.staged.read(staging)
            self.staged.put(staging, volume_id, request.volume_context, "block" if raw else "mount")
            try:
                if raw:
                    from flexhub.node.rawblock import attach_raw

                    assert isinstance(backend, BlockBackend)  # check_capability said so
                    attach_raw(node, backend, staging, volume)
                else:
                    mount_volume(node, backend, staging, volume, stage=True)
            except BaseException:
                if not self._staged_here(node, staging):  # rolled back: nothing staged
                    self.staged.delete(staging)
                else:  # refused: what is staged there is what was (maybe another volume)
                    self.staged.restore(staging, previous)
                raise
            LOG.info("staged %s on %s%s", volume_id, staging, " (raw block)" if raw else "")
        return csi_pb2.NodeStageVolumeResponse()

    @staticmethod
    def _staged_here(node: Any, staging: Path) -> bool:
        from flexhub.node.rawblock import raw_device

        return bool(node.mounts.is_mount_point(staging) or raw_device(node, staging))

    @rpc
    def NodeUnstageVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        volume_id = _require(request.volume_id, "volume_id")
        staging = _path(request.staging_target_path, "staging_target_path")
        from flexhub.driver.loader import backend_factory
        from flexhub.node.volumes import unmount_volume

        with self.in_flight.hold(volume_id):
            node = self._node()
            refuse_while_published(node, volume_id, staging)
            note = unmount_volume(node, staging, backend_factory(self.config))
            self.staged.delete(staging)
            LOG.info("unstaged %s from %s%s", volume_id, staging, f" ({note})" if note else "")
        return csi_pb2.NodeUnstageVolumeResponse()

    @rpc
    def NodePublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        volume_id = _require(request.volume_id, "volume_id")
        staging = _path(request.staging_target_path, "staging_target_path")
        target = _path(request.target_path, "target_path")
        if not request.HasField("volume_capability"):
            raise invalid("volume_capability is required")
        from flexhub.csi.volumes import check_capability
        from flexhub.node.mounts import bind_mount

        reason = check_capability(request.volume_capability)
        if reason:
            raise invalid(reason)
        fs_group = mount_group(request.volume_capability)
        if is_block(request.volume_capability):
            with self.in_flight.hold(volume_id):
                publish_raw(self._node(), volume_id, staging, target, request)
                self._record_publish(volume_id, staging, target, request.volume_context)
            return csi_pb2.NodePublishVolumeResponse()
        with self.in_flight.hold(volume_id):
            node = self._node()
            staged = node.mounts.at(staging)
            if staged is None:
                raise CsiError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"volume {volume_id} is not staged on {staging} (NodeStageVolume first)",
                )
            current = node.mounts.at(target)
            if current is not None:
                if _same_mount(current, staged) and current.read_only == request.readonly:
                    self._record_publish(volume_id, staging, target, request.volume_context)
                    return csi_pb2.NodePublishVolumeResponse()
                raise CsiError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"{target} is already a mount point of another volume or with other flags",
                )
            if request.volume_capability.access_mode.mode == _SINGLE_WRITER:
                self._refuse_second_writer(node, volume_id, staging, target, staged)
            mode = request.volume_capability.access_mode.mode
            if fs_group is not None and not request.readonly and mode not in READ_ONLY_MODES:
                self._apply_mount_group(volume_id, staging, fs_group)
            target.mkdir(mode=0o750, parents=True, exist_ok=True)
            bind_mount(
                node.runner,
                staging,
                target,
                request.readonly,
                node.mounts,
                self.config.mount_timeout,
            )
            self._record_publish(volume_id, staging, target, request.volume_context)
            LOG.info("published %s on %s%s", volume_id, target, " (ro)" if request.readonly else "")
        return csi_pb2.NodePublishVolumeResponse()

    def _record_publish(
        self, volume_id: str, staging: Path, target: Path, context: Mapping[str, str]
    ) -> None:
        """Keep the publish and the pod the kubelet named for it (:mod:`flexhub.csi.published`:
        believed only when the target path and the stage agree); never an option value. The
        record serves the health Events alone: a failure to keep it is logged, and the
        publish, done, stays answered OK."""
        try:
            found = self.staged.get(staging)
            pod = pod_of_publish(volume_id, str(target), context, found[1] if found else None)
            pv, _ = target_parts(str(target))
            self.published.put(Published(str(target), volume_id, str(staging), pv, pod))
        except StateError as exc:
            LOG.warning("publish of %s on %s kept no record (no health Event): %s",
                        volume_id, target, exc.message)  # fmt: skip

    def _apply_mount_group(self, volume_id: str, staging: Path, gid: int) -> None:
        """A pod's fsGroup on a read-write publish, as the FlexVolume driver applies it at each
        pod's mount: a block backend's filesystem root (the staged one) gets the group,
        ``g+rwx`` and setgid, the last pod's group winning; a filesystem backend's group was
        its mount's (cifs ``gid=``, at stage) or is never applied (NFS)."""
        from flexhub.node.staging import apply_fs_group

        found = self.staged.get(staging)
        if found is None or found[0] != volume_id:
            return
        if self._block_backend(found[1]):
            apply_fs_group(staging, gid)

    def _attachment_health(self, volume_id: str) -> list[Any]:
        """What the block backend says its journalled attachment of the staged volume lacks
        (:meth:`flexhub.backend.BlockBackend.health`); nothing for a share, or for a volume
        whose attachment this node has no record of (the stats then say what is wrong)."""
        from flexhub.backend import Attachment

        for staging in self.staged.of_volume(volume_id):
            found = self.staged.get(staging)
            if found is None or found[0] != volume_id or not self._block_backend(found[1]):
                continue
            capability = csi_pb2.VolumeCapability(
                mount=csi_pb2.VolumeCapability.MountVolume(),
                access_mode=csi_pb2.VolumeCapability.AccessMode(
                    mode=csi_pb2.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER
                ),
            )
            volume, backend, node = flexhub_volume(
                found[1], capability, {}, self.config, expanding=True
            )
            if not isinstance(backend, BlockBackend):
                return []
            record = node.journal.get_volume(backend.volume_id(volume))
            if record is None or record.pending:
                return []
            return list(backend.health(Attachment(record.device, record.details)))
        return []

    def _block_backend(self, context: Mapping[str, str]) -> bool:
        """Whether a staged volume's backend (its kept context's) is a block backend."""
        from flexhub.csi.volumes import backend_class

        return issubclass(backend_class(context.get("backend", ""), self.config), BlockBackend)

    def _refuse_second_writer(
        self, node: Any, volume_id: str, staging: Path, target: Path, staged: Any
    ) -> None:
        """A ``SINGLE_NODE_SINGLE_WRITER`` volume (ReadWriteOncePod) is published on one
        target at most: any other mount of the staged filesystem (but the staging mounts) is
        ``FAILED_PRECONDITION``. Found in mountinfo, so it holds across plugin restarts."""
        from flexhub.node.podrecords import pod_dir

        own = {str(pod_dir(staging)), str(pod_dir(target))}
        state = str(self.config.state_dir.resolve())
        for entry in node.mounts.entries():
            point = entry.mount_point
            if (
                _same_mount(entry, staged)
                and point not in own
                and not point.startswith(state + os.sep)
            ):
                raise CsiError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"volume {volume_id} is single-writer (SINGLE_NODE_SINGLE_WRITER) and "
                    f"already published on {point}",
                )

    @rpc
    def NodeUnpublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        volume_id = _require(request.volume_id, "volume_id")
        target = _path(request.target_path, "target_path")
        with self.in_flight.hold(volume_id):
            node = self._node()
            try:  # first: the health watcher forgets its pod before the mount goes
                self.published.delete(str(target))
            except StateError as exc:
                LOG.warning("unpublish of %s from %s: %s", volume_id, target, exc.message)
            node.unmount(target)
            try:
                if target.is_dir() or not target.exists():
                    target.rmdir()
                else:  # the file a raw block volume was bound on
                    target.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise CsiError(
                    grpc.StatusCode.INTERNAL, f"cannot remove {target}: {exc.strerror}"
                ) from None
            LOG.info("unpublished %s from %s", volume_id, target)
        return csi_pb2.NodeUnpublishVolumeResponse()

    @rpc
    def NodeExpandVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        """The FlexVolume driver's ``expandfs`` of the staged volume: the backend grows the
        device, the core the filesystem (verified), with the context kept at stage and the
        request's secrets (the PV's ``nodeExpandSecretRef``: cifs checks its credentials)."""
        volume_id = _require(request.volume_id, "volume_id")
        path = Path(os.path.normpath(_require(request.volume_path, "volume_path")))
        node = self._node()
        if not path.is_absolute() or not path.exists() or not node.mounts.is_mount_point(path):
            raise CsiError(grpc.StatusCode.NOT_FOUND, f"volume {volume_id} is not on {path}")
        new_size = request.capacity_range.required_bytes or request.capacity_range.limit_bytes
        if new_size <= 0:
            raise invalid("capacity_range: the new size is required")
        if request.staging_target_path:
            staging = _path(request.staging_target_path, "staging_target_path")
        else:  # optional in the request: where this node staged the volume
            places = self.staged.of_volume(volume_id)
            if len(places) != 1:
                raise CsiError(
                    grpc.StatusCode.NOT_FOUND if not places else grpc.StatusCode.INVALID_ARGUMENT,
                    f"volume {volume_id} is staged on {len(places)} directories here: "
                    "name staging_target_path",
                )
            staging = places[0]
        found = self.staged.get(staging)
        if found is None or found[0] != volume_id:
            raise CsiError(
                grpc.StatusCode.NOT_FOUND, f"volume {volume_id} is not staged on {staging}"
            )
        capability = (
            request.volume_capability
            if request.HasField("volume_capability")
            else csi_pb2.VolumeCapability(
                mount=csi_pb2.VolumeCapability.MountVolume(),
                access_mode=csi_pb2.VolumeCapability.AccessMode(
                    mode=csi_pb2.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER
                ),
            )
        )
        from flexhub.node.rawblock import expand_raw, raw_device
        from flexhub.node.volumes import expand_volume

        if not self._block_backend(found[1]):
            # a share grows on its server: nothing on this node to grow or to log in for (the
            # controller never asks kubelet for this; csi-sanity does, with no secrets)
            LOG.info("%s is a share: nothing to expand on the node", volume_id)
            return csi_pb2.NodeExpandVolumeResponse(capacity_bytes=new_size)
        with self.in_flight.hold(volume_id):
            if raw_device(node, staging) is not None:
                block = csi_pb2.VolumeCapability(access_mode=capability.access_mode)
                block.block.SetInParent()
                volume, backend, node = flexhub_volume(
                    found[1], block, request.secrets, self.config, expanding=True
                )
                assert isinstance(backend, BlockBackend)  # check_capability said so
                expand_raw(node, backend, staging, volume, new_size)
                LOG.info("expanded raw %s to %d bytes", volume_id, new_size)
                return csi_pb2.NodeExpandVolumeResponse(capacity_bytes=new_size)
            volume, backend, node = flexhub_volume(
                found[1], capability, request.secrets, self.config, expanding=True
            )
            expand_volume(node, backend, staging, volume, new_size)
            LOG.info("expanded %s to %d bytes", volume_id, new_size)
        return csi_pb2.NodeExpandVolumeResponse(capacity_bytes=new_size)

    @rpc
    def NodeGetVolumeStats(self, request: Any, context: grpc.ServicerContext) -> Any:
        volume_id = _require(request.volume_id, "volume_id")
        path = Path(os.path.normpath(_require(request.volume_path, "volume_path")))
        node = self._node()
        # mountinfo first (no stat): then every stat of the path is bounded, in a thread of
        # its own, one at a time per path: a hard NFS mount whose server is gone blocks a
        # stat for good, and kubelet polls every volume; it must never take the workers
        if not path.is_absolute() or not node.mounts.is_mount_point(path):
            raise CsiError(
                grpc.StatusCode.NOT_FOUND, f"volume {volume_id} is not mounted on {path}"
            )
        kind, st = _bounded_stat(str(path))
        unit = csi_pb2.VolumeUsage.Unit
        if stat.S_ISBLK(kind):  # a raw block volume: its size, no usage
            from flexhub.node.rawblock import device_size

            return csi_pb2.NodeGetVolumeStatsResponse(
                usage=[csi_pb2.VolumeUsage(unit=unit.BYTES, total=device_size(str(path)))]
            )
        assert st is not None
        return csi_pb2.NodeGetVolumeStatsResponse(
            usage=[
                csi_pb2.VolumeUsage(
                    unit=unit.BYTES,
                    total=st.f_blocks * st.f_frsize,
                    available=st.f_bavail * st.f_frsize,
                    used=(st.f_blocks - st.f_bfree) * st.f_frsize,
                ),
                csi_pb2.VolumeUsage(
                    unit=unit.INODES,
                    total=st.f_files,
                    available=st.f_favail,
                    used=st.f_files - st.f_ffree,
                ),
            ]
        )

    @rpc
    def NodeGetVolumeHealth(self, request: Any, context: grpc.ServicerContext) -> Any:
        """The volume's health from this node (:mod:`flexhub.csi.health`): its staging and
        publish paths when the request names them, else where this node staged it; a volume
        this node never staged is ``NOT_FOUND``."""
        volume_id = _require(request.volume_id, "volume_id")
        paths = [
            _path(value, what)
            for value, what in (
                (request.staging_target_path, "staging_target_path"),
                (request.volume_publish_path, "volume_publish_path"),
            )
            if value
        ]
        if request.staging_target_path:
            found = self.staged.get(paths[0])
            if found is None or found[0] != volume_id:  # only what this node staged
                raise CsiError(
                    grpc.StatusCode.NOT_FOUND, f"volume {volume_id} is not staged on {paths[0]}"
                )
        if not self.staged.of_volume(volume_id):
            raise CsiError(
                grpc.StatusCode.NOT_FOUND, f"volume {volume_id} is not staged on this node"
            )
        if not paths:
            paths = self.staged.of_volume(volume_id)
        health = self.health_of(volume_id, paths)
        for entry in health.health_statuses:
            LOG.warning("volume %s: %s: %s", volume_id, entry.reason, entry.message)
        return csi_pb2.NodeGetVolumeHealthResponse(volume_health=health)

    def unpublished(self, target: Path) -> bool:
        """Whether ``target`` is published no more: no mount on it and no such path (its pod's
        directory gone; a mount point cannot be removed). The mount table is read first, so a
        path with a mount, hung or not, is never statted (the health watcher)."""
        node = self._node()
        return not self._staged_here(node, target) and not os.path.lexists(target)

    def health_of(self, volume_id: str, paths: list[Path]) -> Any:
        """The ``VolumeHealth`` of ``volume_id`` on its staging and publish ``paths``: one
        bounded stat of each (:func:`flexhub.csi.health.volume_health`, :data:`STAT_BOUND`),
        and what its block backend says the attachment lacks, asked beside them within the same
        bound (one still hanging from an earlier call: not asked again);
        ``NodeGetVolumeHealth`` and the health watcher (:mod:`flexhub.csi.healthevents`)."""
        from flexhub.csi.health import backend_troubles, volume_health

        node = self._node()
        more = backend_troubles(
            lambda: self._attachment_health(volume_id),
            STAT_BOUND,
            f"volume {volume_id}",
            volume_id,
        )
        return volume_health(
            volume_id, paths, lambda path: self._staged_here(node, path), STAT_BOUND, more
        )


#: Seconds a stats or health call's stat of a volume path may take.
STAT_BOUND = 5.0


def _bounded_stat(path: str) -> tuple[int, os.statvfs_result | None]:
    """``(st_mode, statvfs or None for a device)`` of ``path`` within :data:`STAT_BOUND`
    (:func:`flexhub.csi.health.probe`: one stat and statvfs, also what tells a stale mount);
    a stuck stat is ``UNAVAILABLE``, a stale mount ``INTERNAL``, a missing path ``NOT_FOUND``."""
    from flexhub.csi.health import probe

    found = probe(path, STAT_BOUND)
    if not found.reason:
        return found.mode, found.statvfs
    if found.reason == "StaleMount":
        raise CsiError(grpc.StatusCode.INTERNAL, f"{path} is a stale or broken mount")
    if found.reason == "StatFailed":
        raise CsiError(grpc.StatusCode.NOT_FOUND, found.message)
    raise CsiError(grpc.StatusCode.UNAVAILABLE, found.message)


def _same_mount(entry: Any, other: Any) -> bool:
    """Whether two mountinfo entries show the same filesystem and root (a bind of it)."""
    return bool(entry.major_minor == other.major_minor and entry.root == other.root)
