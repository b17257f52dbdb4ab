"""Mount, unmount and expand a volume for a pod: locks, journal, shared staging, rollback.

This is what the core dispatcher calls for ``mount``, ``unmount`` and ``expandfs``.

Block volumes (:class:`~flexhub.backend.BlockBackend`) are attached and mounted once per node
on ``<state_dir>/staging/<sha256(volume id)[:32]>`` (for a CO's staging directory, that path
repeated below it: :func:`staging_dir`) and bind-mounted into each pod directory.
The last pod's ``unmount`` unmounts the staging directory and detaches the device. Who uses a
staging mount is derived from the journal's pod records and checked against mountinfo, so the
count heals after a crash or a reboot.

Every step is journalled **before** it is taken (the volume record before formatting, the pod
record before the bind), so that an interrupted call leaves enough state for the retry, or
for ``unmount``, to converge.

Locks: ``("pod", target)`` then ``("volume", volume id)`` then ``("staging", staging dir)``,
always in that order; never a global lock. Filesystem backends get only the pod lock (one
export's mounts on different pod directories do not queue behind each other) unless they set
``volume_lock``.

fsGroup: the driver reports ``fsGroup: false`` so kubelet never chowns. For a read-write block
volume with ``kubernetes.io/mounterArgs.FsGroup``, flexhub sets the group of the
filesystem's root directory to the fsGroup and adds ``g+rwx`` and setgid (other bits kept).
Only the root directory, never recursively. Filesystem backends (NFS) skip it. Pods sharing a
staging mount share its root directory: the last fsGroup applied wins.

Mount options of a block volume apply when its staging mount is made (the first pod on the
node); later pods share that mount.

Test hook: :func:`checkpoint` is called between steps with the names in :data:`CHECKPOINTS`
(see :mod:`flexhub.node.checkpoints`: ``FLEXHUB_TEST_CRASH_AT``, ``FLEXHUB_TEST_PAUSE_AT``,
``FLEXHUB_TEST_TRACE``).

This module holds the entry points and filesystem volumes; the rest is, one job each:

* :mod:`flexhub.node.podrecords`: staging and pod directories, locks, who uses a staging mount;
* :mod:`flexhub.node.staging`: a block mount (attach, stage, restage read-write, bind, rollback);
* :mod:`flexhub.node.release`: a block release (busy device, deferred release, interrupted attach);
* :mod:`flexhub.node.checkpoints`: the test hook.

The names of those modules that callers used from here (:data:`CHECKPOINTS`,
:func:`staging_dir`, ...) are still importable from here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flexhub.backend import Attachment, Backend, BlockBackend, FilesystemBackend
from flexhub.errors import BackendError, FlexhubError, VolumeError
from flexhub.node import Node
from flexhub.node.checkpoints import (
    CHECKPOINTS,
    CRASH_ENV,
    PAUSE_ENV,
    TRACE_ENV,
    UNMOUNT_CHECKPOINTS,
    checkpoint,
)
from flexhub.node.journal import PodRecord, record_details
from flexhub.node.mounts import check_block_mount_options, check_mount_options, cleanup_mount_point
from flexhub.node.podrecords import (
    _abs,
    _adopt_pod_record,
    _backend_name,
    _check_no_secret,
    _device_number,
    _forget,
    _guess_staging,
    _volume_locks,
    journalled_staging,
    pod_dir,
    staging_dir,
)
from flexhub.node.staging import STAT_TIMEOUT, _clean_if_corrupted, _mount_block, apply_fs_group

# Moved to flexhub.node.staging; still importable from here (tests build a mount step by step).
from flexhub.node.staging import _attach_and_record as _attach_and_record
from flexhub.node.staging import _Progress as _Progress
from flexhub.node.statedir import secure_state_dir
from flexhub.volume import Volume

if TYPE_CHECKING:
    from flexhub.node.release import OPEN_TIMEOUT, RETRY_MAX, retry_deferred_releases

__all__ = [
    "CHECKPOINTS",
    "CRASH_ENV",
    "OPEN_TIMEOUT",
    "PAUSE_ENV",
    "RETRY_MAX",
    "STAT_TIMEOUT",
    "TRACE_ENV",
    "UNMOUNT_CHECKPOINTS",
    "apply_fs_group",
    "checkpoint",
    "expand_volume",
    "mount_volume",
    "pod_dir",
    "retry_deferred_releases",
    "staging_dir",
    "unmount_volume",
]

LOG = logging.getLogger(__name__)

#: Names of :mod:`flexhub.node.release` still importable from here, loaded on first use: a
#: ``mount`` releases nothing (unless it fails), so it does not import that module.
_FROM_RELEASE = ("OPEN_TIMEOUT", "RETRY_MAX", "retry_deferred_releases")


def __getattr__(name: str) -> Any:
    if name in _FROM_RELEASE:
        from flexhub.node import release

        return getattr(release, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- mount ---------------------------------------------------------------------------------------


def mount_volume(
    node: Node, backend: Backend, target: Path, volume: Volume, *, stage: bool = False
) -> None:
    """Mount ``volume`` on the pod directory ``target``; idempotent, rolled back on failure.

    :param stage: ``target`` is a CO's staging directory (CSI ``NodeStageVolume``), which
        names flexhub's own staging mount of a block volume (:func:`staging_dir`).
    :raises FlexhubError: the mount failed; what this call did was undone.
    """
    given, target = _abs(target), pod_dir(target)
    _refuse_state_dir(node, target)
    check_mount_options(volume.mount_options)
    if isinstance(backend, BlockBackend):
        check_block_mount_options(volume.mount_options)
    secure_state_dir(node.state_dir)
    volume_id = backend.volume_id(volume)
    with node.lock("pod", str(target)):
        _adopt_pod_record(node, given, target)
        if isinstance(backend, BlockBackend):
            _mount_block(node, backend, target, volume, volume_id, given if stage else None)
        elif isinstance(backend, FilesystemBackend):
            _mount_filesystem(node, backend, target, volume, volume_id)
        else:
            raise BackendError(f"backend {type(backend).__name__} is neither block nor filesystem")


def _refuse_state_dir(node: Node, target: Path) -> None:
    """A mount on flexhub's state directory, on a directory that holds it, or inside it
    would hide the journal and locks (or staging mounts) under a volume.

    :raises VolumeError: ``target`` is such a directory.
    """
    state = Path(os.path.realpath(node.state_dir))
    if target == state or state in target.parents or target in state.parents:
        raise VolumeError(
            f"{str(target)[:300]!r} is flexhub's state directory {state}, holds it or lies "
            "inside it: refusing to mount a volume there"
        )


def _mount_filesystem(
    node: Node, backend: FilesystemBackend, target: Path, volume: Volume, volume_id: str
) -> None:
    name = _backend_name(node, backend, volume)
    with _filesystem_lock(node, type(backend), volume_id):
        record = node.journal.get_pod(target)
        entry = _clean_if_corrupted(node, target)
        if entry is not None:
            if record is not None and record.volume_id == volume_id and record.staging is None:
                LOG.info("%s is already mounted (%s): nothing to do", target, volume_id)
                return
            raise VolumeError(f"{target} is already a mount point of {entry.source}")
        node.journal.put_pod(PodRecord(str(target), name, volume_id, None, volume.read_only))
        checkpoint("pod-record")
        try:
            target.mkdir(mode=0o750, parents=True, exist_ok=True)
            details = record_details(backend.mount(target, volume))
            _check_no_secret(name, details, volume)
            checkpoint("bound")
            node.journal.put_pod(
                PodRecord(str(target), name, volume_id, None, volume.read_only, details)
            )
        except BaseException:
            _undo_filesystem(node, backend, target)
            raise
        checkpoint("done")


def _filesystem_lock(
    node: Node, backend_type: type[Backend | None], volume_id: str
) -> contextlib.AbstractContextManager[None]:
    """The volume lock if the filesystem backend asks for it; else nothing (the caller holds
    the pod lock, which is all that one pod directory needs)."""
    if getattr(backend_type, "volume_lock", False):
        return node.lock("volume", volume_id)
    return contextlib.nullcontext()


def _undo_filesystem(node: Node, backend: FilesystemBackend, target: Path) -> None:
    try:
        if node.mounts.is_mount_point(target):
            backend.unmount(target, {})
        cleanup_mount_point(node.runner, target, node.config.unmount_timeout, node.mounts)
        node.journal.delete_pod(target)
    except (FlexhubError, OSError) as exc:
        LOG.error("rollback of the mount on %s failed: %s", target, exc)


# -- unmount -------------------------------------------------------------------------------------


def unmount_volume(node: Node, target: Path, load_backend: Callable[[str], Backend]) -> str:
    """Unmount the pod directory ``target`` and release what no other pod uses.

    Idempotent: a directory that is not mounted, no longer exists, or has no (readable)
    record is success after cleaning what remains. A corrupt record falls back to mountinfo.
    Once nothing is mounted on ``target``, the call succeeds even when the journal cannot
    be updated (a read-only or full ``state_dir``) or the backend cannot be loaded to release
    its device: both are logged and returned, and the records are kept for a later call.

    Then the releases that waited for their storage (:class:`ReleaseDeferred`) are tried
    again (:func:`retry_deferred_releases`).

    :param load_backend: returns the backend instance of a journalled backend name.
    :returns: what could not be released or forgotten ("" when everything was).
    """
    from flexhub.node.release import retry_deferred_releases

    secure_state_dir(node.state_dir)
    notes = _unmount_pod(node, target, load_backend)
    retry_deferred_releases(node, load_backend)
    return "; ".join(notes)


def _unmount_pod(node: Node, target: Path, load_backend: Callable[[str], Backend]) -> list[str]:
    from flexhub.node.release import _release

    given, target = _abs(target), pod_dir(target)
    notes: list[str] = []
    with node.lock("pod", str(target)):
        _adopt_pod_record(node, given, target)
        record = node.journal.get_pod(target)
        if record is not None and record.staging is None:
            _unmount_filesystem(node, target, record, load_backend)
            checkpoint("unbound")
            _forget(node.journal.delete_pod, target, notes)
            return notes
        staging: Path | None = Path(record.staging) if record and record.staging else None
        volume_id = record.volume_id if record else None
        if record is None:
            staging, volume_id = _guess_staging(node, target)
        if staging is None:
            cleanup_mount_point(node.runner, target, node.config.unmount_timeout, node.mounts)
            _forget(node.journal.delete_pod, target, notes)
            return notes
        with _volume_locks(node, volume_id, staging):
            cleanup_mount_point(node.runner, target, node.config.unmount_timeout, node.mounts)
            checkpoint("unbound")
            _release(node, staging, volume_id, target, load_backend, notes)
            checkpoint("released")
            _forget(node.journal.delete_pod, target, notes)
    return notes


def _unmount_filesystem(
    node: Node, target: Path, record: PodRecord, load_backend: Callable[[str], Backend]
) -> None:
    # Loaded also when nothing is mounted: a mount killed midway may have left files of its
    # backend (collect_leftovers).
    from flexhub.node.release import _load_for_unmount

    backend = _load_for_unmount(load_backend, record.backend, record.volume_id)
    with _filesystem_lock(node, type(backend), record.volume_id):
        if isinstance(backend, FilesystemBackend) and node.mounts.is_mount_point(target):
            backend.unmount(target, record.details)
        cleanup_mount_point(node.runner, target, node.config.unmount_timeout, node.mounts)
    if isinstance(backend, FilesystemBackend):
        try:
            backend.collect_leftovers()
        except Exception as exc:  # a hook that must not raise: the unmount is done
            LOG.error("backend %r: collecting leftovers failed: %s", record.backend, exc)


# -- expand --------------------------------------------------------------------------------------


def _staged_volume_id(node: Node, target: Path, volume: Volume) -> str | None:
    """The volume id journalled for the pod directory ``target``, if it is a block volume.

    ``expandfs`` carries the PV's options but no pod, so a backend whose volume id depends on
    the pod (loopfile's namespace areas) is found through the pod directory's record, kept
    under the resolved path (:func:`pod_dir`; an older flexhub's, under the path as given).
    """
    record = node.journal.get_pod(pod_dir(target)) or node.journal.get_pod(_abs(target))
    if record is None or record.staging is None:
        return None
    if volume.backend and record.backend != volume.backend:
        raise VolumeError(
            f"{target} holds a {record.backend} volume, not a {volume.backend} volume"
        )
    return record.volume_id


def expand_volume(
    node: Node, backend: Backend, target: Path, volume: Volume, new_size: int
) -> None:
    """Grow the volume to ``new_size`` bytes and its filesystem with it, verified.

    :raises VolumeError: the volume is not staged on this node, or the filesystem did not grow.
    """
    secure_state_dir(node.state_dir)
    if isinstance(backend, FilesystemBackend):
        volume_id = backend.volume_id(volume)
        with node.lock("volume", volume_id):
            backend.expand(pod_dir(target), volume, new_size)
        return
    if not isinstance(backend, BlockBackend):
        raise BackendError(f"backend {type(backend).__name__} is neither block nor filesystem")
    volume_id = _staged_volume_id(node, target, volume) or backend.volume_id(volume)
    with node.lock("volume", volume_id):
        staging = journalled_staging(node, volume_id)
        with node.lock("staging", str(staging)):
            record = node.journal.get_volume(volume_id)
            staged = node.mounts.at(staging)
            if record is None or staged is None:
                raise VolumeError(f"volume {volume_id} is not mounted on this node")
            if _device_number(record.device) != staged.major_minor:
                raise VolumeError(
                    f"{record.device} is no longer the device mounted on {staging}: "
                    "remount the volume before expanding it"
                )
            if "ro" in staged.options:
                raise VolumeError(f"volume {volume_id} is mounted read-only: cannot grow it")
            from flexhub.node.fs import grow_filesystem

            started = time.monotonic()
            backend.expand(Attachment(record.device, dict(record.details)), volume, new_size)
            size = grow_filesystem(node.runner, record.device, str(staging), staged.fs_type)
            LOG.info(
                "expanded %s to %d bytes (filesystem %d) in %.2fs",
                volume_id,
                new_size,
                size,
                time.monotonic() - started,
            )
