"""Raw block volumes: a block backend's device attached for a consumer that reads and writes
the device itself (CSI's access type ``block``, Kubernetes' ``volumeMode: Block``).

The device is attached exactly as for a filesystem volume (the journal's intent, the attach,
the attachment: :mod:`flexhub.node.staging`), with a pod record for the consumer's directory
(``target``: CSI's staging directory) whose staging directory is flexhub's own, left
**unmounted**: nothing is ever formatted or mounted. The release is the ordinary one
(:func:`flexhub.node.volumes.unmount_volume` of ``target``): no pod record binds the staging
directory, so the device is detached, after the exclusive open that proves nobody holds it.

A device staged with a filesystem on this node is never handed out raw, and a device attached
raw is never formatted or mounted: its pod record says ``access: raw``
(:func:`flexhub.node.podrecords.raw_consumers`), and :mod:`flexhub.node.staging` refuses a
filesystem stage while one is journalled (a blank device its consumer has not written yet
would be formatted, a VM's disk mounted beneath it). :func:`raw_device` is how the node
service tells them apart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from flexhub.backend import Attachment, Backend, BlockBackend
from flexhub.errors import FlexhubError, VolumeError
from flexhub.node import Node
from flexhub.node.checkpoints import checkpoint
from flexhub.node.journal import PodRecord, VolumeRecord
from flexhub.node.podrecords import (
    RAW_DETAILS,
    _backend_name,
    _volume_locks,
    is_raw,
    journalled_staging,
    live_raw_record,
    pod_dir,
    staging_dir,
)
from flexhub.node.statedir import secure_state_dir
from flexhub.volume import Volume

__all__ = ["attach_raw", "device_size", "expand_raw", "mark_raw_records", "raw_device"]

LOG = logging.getLogger(__name__)


def device_size(device: str) -> int:
    """The size in bytes of the block device ``device`` (its ``/sys/class/block`` entry)."""
    st = os.stat(device)
    if not stat.S_ISBLK(st.st_mode):
        raise VolumeError(f"{device} is not a block device")
    sectors = Path(f"/sys/dev/block/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}/size")
    return int(sectors.read_text()) * 512


def _is_block_device(device: str) -> bool:
    try:
        return stat.S_ISBLK(os.stat(device).st_mode)
    except OSError:
        return False


def raw_device(node: Node, target: Path) -> str | None:
    """The device attached raw for ``target``; ``None`` when none is (or it is mounted)."""
    record = node.journal.get_pod(pod_dir(target))
    if record is None or not record.staging:
        return None
    if node.mounts.is_mount_point(Path(record.staging)):
        return None  # staged with a filesystem
    volume = node.journal.get_volume(record.volume_id)
    if volume is None or volume.pending or not _is_block_device(volume.device):
        return None
    return volume.device


def attach_raw(node: Node, backend: BlockBackend, target: Path, volume: Volume) -> str:
    """Attach ``volume`` raw for ``target``; idempotent, rolled back on failure.

    :returns: the device's path.
    :raises VolumeError: the volume is staged with a filesystem on this node.
    """
    from flexhub.node.staging import _attach_and_record, _check_access, _Progress, _undo_block

    target = pod_dir(target)
    secure_state_dir(node.state_dir)
    volume_id = backend.volume_id(volume)
    name = _backend_name(node, backend, volume)
    staging = staging_dir(node, volume_id)
    with node.lock("pod", str(target)), _volume_locks(node, volume_id, staging):
        if node.mounts.is_mount_point(staging) or node.mounts.is_mount_point(
            journalled_staging(node, volume_id)
        ):
            raise VolumeError(
                f"volume {volume_id} is mounted with a filesystem on this node: refusing to "
                "hand its device out as a raw block volume"
            )
        record = node.journal.get_pod(target)
        other = live_raw_record(node, target)
        if other is not None and other.volume_id != volume_id:
            raise VolumeError(
                f"{target} is where volume {other.volume_id} is attached raw: refusing to "
                f"attach {volume_id} there"
            )
        if node.mounts.is_mount_point(target):
            raise VolumeError(
                f"{target} is a mount point (a filesystem stage): refusing to attach "
                f"{volume_id} raw there"
            )
        known = node.journal.get_volume(volume_id)
        # Whether the journalled device still is the attachment (after a reboot, or the
        # device's loss, its name may map nothing, or another volume): None, cannot tell.
        proven: bool | None = None
        if known is not None and not known.pending:
            proven = _is_block_device(known.device) and backend.still_attached(
                Attachment(known.device, dict(known.details))
            )
        if record is not None and record.volume_id == volume_id and proven is True:
            assert known is not None
            _check_access(backend, volume, volume_id, known)
            if not is_raw(record):  # journalled before pod records said raw (an upgrade)
                node.journal.put_pod(record.replace(details=RAW_DETAILS))
            LOG.info("%s is already attached raw (%s): nothing to do", volume_id, known.device)
            return known.device
        # Attached before this call and maybe still in use (for this consumer, or another):
        # a failure here never releases it, the journal is put back (the attach is
        # idempotent: a retry converges). A device proven gone is not kept: a failure
        # releases what this call attached, as on a first attach.
        kept = known is not None and not known.pending and proven is not False
        if kept:
            assert known is not None
            _check_access(backend, volume, volume_id, known)
        progress = _Progress()
        try:
            node.journal.put_pod(
                PodRecord(str(target), name, volume_id, str(staging), volume.read_only, RAW_DETAILS)
            )
            progress.pod_record = True
            checkpoint("pod-record")
            attached = _attach_and_record(
                node, backend, volume, volume_id, name, staging, None, progress
            )
            checkpoint("done")
        except BaseException:
            if not kept:
                _undo_block(node, backend, target, volume_id, staging, progress)
            else:
                _restore(
                    node,
                    target,
                    record if record and record.volume_id == volume_id else None,
                    known,
                )
            raise
    LOG.info("attached %s raw (%s) for %s", volume_id, attached.device, target)
    return attached.device


def _restore(
    node: Node, target: Path, record: PodRecord | None, known: VolumeRecord | None
) -> None:
    """Put the journal back as it was before a failed attach of a device attached before it:
    the volume record (the attach's progress reports replaced it with an intent) and the
    pod record of ``target`` (``None``: this call wrote the only one, removed)."""
    if known is not None:
        with contextlib.suppress(FlexhubError):
            node.journal.put_volume(known)
    with contextlib.suppress(FlexhubError):
        if record is None:
            node.journal.delete_pod(target)
        else:
            node.journal.put_pod(record)


def mark_raw_records(
    node: Node, staged: Iterable[Path], load_backend: Callable[[str], Backend]
) -> int:
    """Say ``access: raw`` in the pod records of the raw stages among ``staged`` (CSI's
    staging directories whose access type was not recorded) that a release before
    :data:`RAW_DETAILS` journalled without it: an upgraded plugin runs this before it serves,
    as kubelet does not stage a volume again because the plugin changed.

    A record is marked only when it can be nothing else: it is the only one on its volume's
    bare staging directory (a filesystem stage shares it with a FlexVolume pod, or was
    journalled there by 0.1.0), that directory is not mounted, and the backend proves the
    journalled device is still the attachment (after a reboot a filesystem stage looks the
    same, its device gone: left alone, and a raw stage again marks its own record).

    :returns: how many records were rewritten.
    """
    marked = 0
    for path in staged:
        target = pod_dir(path)
        with node.lock("pod", str(target)):
            record = node.journal.get_pod(target)
            if record is None or record.details:
                continue
            staging = staging_dir(node, record.volume_id)
            with _volume_locks(node, record.volume_id, staging):
                if not _only_unmounted_attached(node, record, staging, load_backend):
                    continue
                node.journal.put_pod(record.replace(details=RAW_DETAILS))
            LOG.info("the raw pod record of %s now says so (%s)", target, record.volume_id)
            marked += 1
    return marked


def _only_unmounted_attached(
    node: Node, record: PodRecord, staging: Path, load_backend: Callable[[str], Backend]
) -> bool:
    if record.staging != str(staging) or node.mounts.is_mount_point(staging):
        return False
    if [other for other in node.journal.pods() if other.staging == record.staging] != [record]:
        return False
    known = node.journal.get_volume(record.volume_id)
    if known is None or known.pending or not _is_block_device(known.device):
        return False
    try:
        backend = load_backend(known.backend)
    except FlexhubError:
        return False
    return isinstance(backend, BlockBackend) and (
        backend.still_attached(Attachment(known.device, dict(known.details))) is True
    )


def expand_raw(node: Node, backend: BlockBackend, target: Path, volume: Volume, size: int) -> int:
    """Grow the device attached raw for ``target`` to ``size`` bytes (no filesystem).

    :returns: the device's size after.
    :raises VolumeError: nothing is attached raw for ``target``, or the device did not grow.
    """
    device = raw_device(node, target)
    record = node.journal.get_pod(pod_dir(target))
    if device is None or record is None:
        raise VolumeError(f"no raw block volume is attached for {target}")
    volume_id = record.volume_id
    with _volume_locks(node, volume_id, staging_dir(node, volume_id)):
        attached = node.journal.get_volume(volume_id)
        if attached is None:
            raise VolumeError(f"volume {volume_id} is not attached on this node")
        backend.expand(Attachment(attached.device, dict(attached.details)), volume, size)
        now = device_size(attached.device)
    if now < size:
        raise VolumeError(f"{device} is {now} bytes after growing it to {size}")
    LOG.info("expanded raw %s (%s) to %d bytes", volume_id, device, now)
    return now
