"""Mount a block volume for a pod: attach, stage once per node, bind, roll back on failure.

The first pod on the node attaches the device (journalled first: the intent, then the
attachment) and mounts it on its staging directory (formatting a blank device); each pod
gets a bind of that mount. A read-only staging mount is restaged read-write (unmounted,
attached for writing, checked, mounted again) only once no read-only pod uses it. A volume
of another connection identity never shares a staged device. A failed mount undoes what it
did (:func:`_undo_block`), releasing the device when no other pod uses it.

fsGroup: for a read-write volume, the group of the filesystem's root directory is set to the
fsGroup with ``g+rwx`` and setgid (:func:`apply_fs_group`); only the root directory.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from flexhub.backend import Attachment, BlockBackend
from flexhub.errors import FlexhubError, ReleaseDeferred, VolumeError
from flexhub.node import Node
from flexhub.node.checkpoints import checkpoint
from flexhub.node.journal import PodRecord, VolumeRecord, record_details
from flexhub.node.mounts import MountEntry, bind_mount, cleanup_mount_point, is_corrupted
from flexhub.node.podrecords import (
    _NAMESPACE,
    _backend_name,
    _check_no_secret,
    _device_number,
    _same_device,
    _users,
    live_raw_record,
    raw_consumers,
    staging_dir,
)
from flexhub.volume import Volume

__all__ = ["STAT_TIMEOUT", "apply_fs_group"]

LOG = logging.getLogger(__name__)


#: Seconds given to the ``stat`` of a possibly stale mount point.
STAT_TIMEOUT = 5.0


def apply_fs_group(root: Path, gid: int) -> None:
    """Give ``root`` (a filesystem's root directory) group ``gid``, ``g+rwx`` and setgid."""
    info = os.stat(root)
    if info.st_gid != gid:
        os.chown(root, -1, gid)
    mode = stat.S_IMODE(info.st_mode) | stat.S_IRWXG | stat.S_ISGID
    if mode != stat.S_IMODE(info.st_mode):
        os.chmod(root, mode)


def _clean_if_corrupted(node: Node, path: Path) -> MountEntry | None:
    """Unmount ``path`` if it is a corrupted mount point; return what is mounted there now."""
    entry = node.mounts.at(path)
    if entry is not None and is_corrupted(path, STAT_TIMEOUT):
        LOG.warning(
            "cleaning corrupted mount point %s (%s from %s)", path, entry.fs_type, entry.source
        )
        cleanup_mount_point(node.runner, path, node.config.unmount_timeout, node.mounts)
        entry = node.mounts.at(path)
    return entry


#: The longest path a system call takes (PATH_MAX, its NUL included).
_PATH_MAX = 4096


def _staging_for(node: Node, volume_id: str, co_staging: Path | None) -> Path:
    """The staging directory of a mount of ``volume_id``: where it is staged on this node
    already (a device is never mounted twice), else :func:`staging_dir` (for ``co_staging``,
    the CO's staging path repeated). Staged already: the journalled staging if it is
    mounted, else any mount below the volume's own staging directory (its record may be
    unreadable: the mount table still tells). The caller holds the volume's lock.

    :raises VolumeError: the repeated CO staging path is too long for a system call, or the
        volume is staged for another CO staging path.
    """
    wanted = staging_dir(node, volume_id, co_staging)
    found = _mounted_staging(node, volume_id)
    if found is None or found == wanted:
        if len(os.fsencode(wanted)) >= _PATH_MAX:
            raise VolumeError(
                f"the staging path of {volume_id} is too long to repeat below "
                f"{staging_dir(node, volume_id)} ({len(os.fsencode(wanted))} bytes, at most "
                f"{_PATH_MAX - 1}): shorten the CO's root directory or flexhub's state_dir"
            )
        return wanted
    if co_staging is not None and found != staging_dir(node, volume_id):
        # Another CO staging path of the same storage (two PVs of one loop file): sharing it
        # would make each staging mount a foreign reference of the other to the kubelet,
        # which would then unstage neither.
        raise VolumeError(
            f"volume {volume_id} is staged on this node for another staging path already "
            f"({found}): one staging path per volume (two PVs of the same storage?)"
        )
    if co_staging is not None:
        LOG.warning(
            "%s is staged on %s already (for a FlexVolume pod, or by an older flexhub): "
            "sharing it; the kubelet unstages it only once no other mount uses it",
            volume_id,
            found,
        )
    return found


def _mounted_staging(node: Node, volume_id: str) -> Path | None:
    """Where ``volume_id`` is staged on this node: its journalled staging directory if it
    is mounted, else the shallowest mount at or below its own staging directory."""
    record = node.journal.get_volume(volume_id)
    if record is not None and record.staging and node.mounts.is_mount_point(record.staging):
        return Path(record.staging)
    base = str(staging_dir(node, volume_id))
    points = [
        entry.mount_point
        for entry in node.mounts.entries()
        if entry.mount_point == base or entry.mount_point.startswith(f"{base}/")
    ]
    return Path(min(points, key=len)) if points else None


def _mount_block(
    node: Node,
    backend: BlockBackend,
    target: Path,
    volume: Volume,
    volume_id: str,
    co_staging: Path | None = None,
) -> None:
    name = _backend_name(node, backend, volume)
    fs_type = volume.fs_type_or_default()
    with node.lock("volume", volume_id):
        staging = _staging_for(node, volume_id, co_staging)
        with node.lock("staging", str(staging)):
            _mount_block_locked(node, backend, target, volume, volume_id, name, fs_type, staging)


def _mount_block_locked(
    node: Node,
    backend: BlockBackend,
    target: Path,
    volume: Volume,
    volume_id: str,
    name: str,
    fs_type: str,
    staging: Path,
) -> None:
    raw = raw_consumers(node, volume_id)
    if raw:
        raise VolumeError(
            f"volume {volume_id} is attached raw on this node (for {raw[0]}): refusing to "
            "format or mount it with a filesystem"
        )
    other = live_raw_record(node, target)
    if other is not None:
        raise VolumeError(
            f"{target} is where volume {other.volume_id} is attached raw: refusing to mount "
            f"{volume_id} there"
        )
    staged = _clean_if_corrupted(node, staging)
    here = _clean_if_corrupted(node, target)
    shared = node.journal.get_volume(volume_id)
    if staged is not None and _record_matches(shared, staged):
        assert shared is not None
        _check_access(backend, volume, volume_id, shared)
    elif shared is not None and shared.device and volume_id in node.journal.deferred():
        # Not staged, but still attached with its identity (its release waits for the
        # storage): reusing the device would skip the login, as sharing a staged one would.
        _check_access(backend, volume, volume_id, shared)
    record = node.journal.get_pod(target)
    if here is not None:
        if _same_device(here, staged) and here.read_only == volume.read_only:
            if record is None or record.staging != str(staging):
                node.journal.put_pod(
                    PodRecord(str(target), name, volume_id, str(staging), volume.read_only)
                )
            if not _record_matches(node.journal.get_volume(volume_id), staged):
                LOG.warning("re-journalling the staged volume %s", volume_id)
                _attach_and_record(
                    node, backend, volume, volume_id, name, staging, staged, _Progress()
                )
            LOG.info("%s is already mounted (%s): nothing to do", target, volume_id)
            return
        if record is None or record.volume_id != volume_id:
            raise VolumeError(f"{target} is already a mount point of {here.source}")
        # Our own leftover (an interrupted call, or the wrong mode): start again.
        cleanup_mount_point(node.runner, target, node.config.unmount_timeout, node.mounts)
    progress = _Progress()
    try:
        _do_mount_block(
            node, backend, target, volume, volume_id, name, fs_type, staging, staged, progress
        )
    except BaseException:
        _undo_block(node, backend, target, volume_id, staging, progress)
        raise


class _Progress:
    """What a block mount call changed, for its rollback."""

    def __init__(self) -> None:
        self.attachment: Attachment | None = None
        self.staged = False
        self.pod_record = False
        self.bound = False


def _do_mount_block(
    node: Node,
    backend: BlockBackend,
    target: Path,
    volume: Volume,
    volume_id: str,
    name: str,
    fs_type: str,
    staging: Path,
    staged: MountEntry | None,
    progress: _Progress,
) -> None:
    journal = node.journal
    journal.put_pod(PodRecord(str(target), name, volume_id, str(staging), volume.read_only))
    progress.pod_record = True
    checkpoint("pod-record")
    vrecord = journal.get_volume(volume_id)
    restage = staged is not None and not volume.read_only and staged.read_only
    if restage:
        _refuse_while_read_only_pods(node, staging, target, volume_id)
    if staged is None or restage or not _record_matches(vrecord, staged):
        # Every read-write staging mount follows an attach for writing (idempotent), which
        # is where a backend fences other writers: also a read-only staging mount (attached
        # for reading, never fenced) that is restaged read-write.
        vrecord = _attach_and_record(
            node, backend, volume, volume_id, name, staging, staged, progress
        )
    assert vrecord is not None
    if restage:
        _unstage_read_only(node, staging, target)
        staged = None
    if staged is None:
        # (imported here: a mount that finds the volume staged formats nothing)
        from flexhub.node.formatintent import FormatIntent
        from flexhub.node.fs import format_and_mount

        staging.mkdir(mode=0o700, parents=True, exist_ok=True)
        formatted = format_and_mount(
            node.runner,
            vrecord.device,
            staging,
            fs_type,
            volume.read_only,
            volume.mount_options,
            node.config.mount_timeout,
            blank_hint=progress.attachment.blank if progress.attachment else None,
            label=_device_label(vrecord),
            internal_options=_internal_options(backend, volume),
            intent=FormatIntent(node.journal, volume_id, vrecord.device),
        )
        progress.staged = True
        LOG.info(
            "staged %s (%s%s) on %s",
            volume_id,
            vrecord.device,
            ", formatted" if formatted else "",
            staging,
        )
        checkpoint("staged")
        staged = node.mounts.at(staging)
        if staged is None:
            raise VolumeError(f"{staging} is not a mount point after mounting it")
    if staged.fs_type != fs_type:
        raise VolumeError(
            f"{vrecord.device} holds a {staged.fs_type} filesystem but fsType {fs_type} was "
            "requested"
        )
    if volume.fs_group is not None and not volume.read_only:
        # before the bind: once the pod directory is a mount point kubelet never calls again
        apply_fs_group(staging, volume.fs_group)
    target.mkdir(mode=0o750, parents=True, exist_ok=True)
    bind_mount(
        node.runner, staging, target, volume.read_only, node.mounts, node.config.mount_timeout
    )
    progress.bound = True
    checkpoint("bound")
    checkpoint("done")


def _refuse_while_read_only_pods(node: Node, staging: Path, target: Path, volume_id: str) -> None:
    """A read-only staging mount is restaged read-write only once no pod uses it.

    A read-only mount skipped ``fsck`` (and may skip journal recovery); remounting it
    read-write would write to a filesystem nobody checked. It is unmounted instead and staged
    again through the full first-mount path (attach for writing, fsck, mount read-write),
    which is impossible while read-only pods use it (their binds keep the filesystem
    mounted): refused then, before any attach, and kubelet retries once they are gone.

    :raises VolumeError: read-only pods use the staging mount.
    """
    users = _users(node, staging, exclude=target)
    if users:
        raise VolumeError(
            f"volume {volume_id} is mounted read-only by {len(users)} pod(s) on this node; a "
            "read-write mount needs the filesystem checked first, which needs them gone"
        )


def _unstage_read_only(node: Node, staging: Path, target: Path) -> None:
    """Unmount a read-only staging mount (no pod uses it) that a read-write pod restages."""
    LOG.info("unmounting the read-only staging mount %s to check it for %s", staging, target)
    cleanup_mount_point(node.runner, staging, node.config.unmount_timeout, node.mounts)


def _device_label(record: VolumeRecord) -> str:
    """The device of ``record`` for messages, with its backing file when the backend says."""
    file = record.details.get("file")
    return f"{record.device} (file {file})" if file else record.device


def _internal_options(backend: BlockBackend, volume: Volume) -> tuple[str, ...]:
    """flexhub's own options of a staging mount: a read-only mount of a device that another
    node may be writing never replays its journal (``norecovery``: ext4 and xfs)."""
    return ("norecovery",) if volume.read_only and backend.shared_device else ()


def _record_matches(record: VolumeRecord | None, staged: MountEntry | None) -> bool:
    """Whether ``record`` names the device that is mounted on the staging directory."""
    return (
        record is not None
        and staged is not None
        and not record.pending
        and _device_number(record.device) == staged.major_minor
    )


def _check_access(
    backend: BlockBackend,
    volume: Volume,
    volume_id: str,
    record: VolumeRecord,
    what: str = "is already staged on this node",
) -> None:
    """Refuse to share a staged volume with a volume of another connection identity.

    :raises VolumeError: naming the keys of :meth:`BlockBackend.access` that differ, never
        their values.
    """
    wanted = record_details(backend.access(volume))
    differ = sorted(
        k for k in wanted.keys() | record.access.keys() if wanted.get(k) != record.access.get(k)
    )
    if differ:
        raise VolumeError(
            f"volume {volume_id} {what} with another connection identity: "
            f"{', '.join(differ)} differ(s); refusing to share it"
        )


def _attach_and_record(
    node: Node,
    backend: BlockBackend,
    volume: Volume,
    volume_id: str,
    name: str,
    staging: Path,
    staged: MountEntry | None,
    progress: _Progress,
) -> VolumeRecord:
    """Journal the intent, attach (idempotent), journal the attachment."""
    fs_type = volume.fs_type_or_default()
    options = record_details(volume.options)
    _check_no_secret(name, options, volume)
    if volume.pod is not None and volume.pod.namespace:
        # a backend may resolve the volume in its namespace (loopfile): _detach needs it too
        options[_NAMESPACE] = volume.pod.namespace
    access = record_details(backend.access(volume))
    _check_no_secret(name, access, volume)
    earlier = node.journal.get_volume(volume_id)
    if earlier is not None and earlier.pending and earlier.partial:
        # An attach interrupted earlier left something (an iSCSI session logged in with its
        # CHAP): a volume of another identity must not inherit it. Refused; the rollback
        # releases the leftover, so kubelet's retry attaches with its own identity.
        _check_access(
            backend, volume, volume_id, earlier, "was being attached on this node (interrupted)"
        )
    # An attach interrupted earlier may have left something: keep what it reported.
    partial = dict(earlier.partial) if earlier is not None and earlier.pending else {}
    intent = VolumeRecord(
        volume_id,
        name,
        "",
        str(staging),
        fs_type,
        {},
        options=options,
        partial=partial,
        access=access,
    )
    if earlier is None or earlier.pending or not earlier.device:
        node.journal.put_volume(intent)
    # else: a device attached before and never released (its release waits for the storage,
    # or its backend was broken) keeps its record until this attach returns: a failure here
    # must still know what to release.
    checkpoint("volume-intent")
    attachment = _attach_reporting(node, backend, volume, intent)
    progress.attachment = attachment
    checkpoint("attached")
    details = record_details(attachment.details)
    _check_no_secret(name, details, volume)
    if staged is not None and _device_number(attachment.device) != staged.major_minor:
        raise VolumeError(
            f"{staging} holds {staged.source}, not {attachment.device}: refusing to share it"
        )
    record = VolumeRecord(
        volume_id,
        name,
        attachment.device,
        str(staging),
        fs_type,
        details,
        options=options,
        access=access,
    )
    node.journal.put_volume(record)
    checkpoint("volume-record")
    return record


def _attach_reporting(
    node: Node, backend: BlockBackend, volume: Volume, intent: VolumeRecord
) -> Attachment:
    """``backend.attach``, journalling each ``record_progress`` into the intent at once."""
    record = [intent]

    def journal(details: Mapping[str, str]) -> None:
        _check_no_secret(intent.backend, dict(details), volume)
        record[0] = record[0].replace(partial={**record[0].partial, **details})
        node.journal.put_volume(record[0])
        if details:  # one step per report, named after its first key
            checkpoint(f"attach-progress-{next(iter(details))}")

    previous = backend.node.progress
    backend.node.progress = journal
    try:
        return backend.attach(volume)
    finally:
        backend.node.progress = previous


def _undo_block(
    node: Node,
    backend: BlockBackend,
    target: Path,
    volume_id: str,
    staging: Path,
    progress: _Progress,
) -> None:
    """Undo a failed block mount: the bind, and the staging and device if nobody uses them."""
    # (imported here: a mount that succeeds releases nothing)
    from flexhub.node.release import (
        _attachment,
        _check_free,
        _detach,
        _keep_for_later,
        _remove_staging,
    )

    try:
        if progress.bound or node.mounts.is_mount_point(target):
            cleanup_mount_point(node.runner, target, node.config.unmount_timeout, node.mounts)
        node.journal.delete_pod(target)
        if _users(node, staging, exclude=target):
            return
        cleanup_mount_point(node.runner, staging, node.config.unmount_timeout, node.mounts)
        record = node.journal.get_volume(volume_id)
        try:
            if progress.attachment is not None:
                _check_free(backend, progress.attachment, volume_id)
                backend.detach(progress.attachment)
            elif record is not None:
                _check_free(backend, _attachment(record), volume_id)
                _detach(backend, record)
        except ReleaseDeferred as exc:
            _keep_for_later(node, volume_id, staging, exc, [])
            return
        node.journal.delete_volume(volume_id)
        _remove_staging(node, staging)
        if progress.attachment is not None:
            backend.discard(progress.attachment)  # e.g. the file this call's attach created
    except (FlexhubError, OSError) as exc:
        LOG.error("rollback of the mount of %s on %s failed: %s", volume_id, target, exc)
