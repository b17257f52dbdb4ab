"""Mount, unmount and expand a volume for a pod: locks, journal, shared staging, rollback.

This is what the core dispatcher calls for ``mount``, ``unmount`` and ``expandfs``.

Block volumes (:class:`~flexhub.backend.BlockBackend`) are attached and mounted once per node
on ``<state_dir>/staging/<sha256(volume id)[:32]>`` and bind-mounted into each pod directory.
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

Test hook: :func:`checkpoint` is called between steps with the names in :data:`CHECKPOINTS`.
When the environment variable ``FLEXHUB_TEST_CRASH_AT`` equals the name, the process kills
itself with SIGKILL, so tests can interrupt a mount at each step. When
``FLEXHUB_TEST_TRACE`` names a file, each checkpoint reached is appended to it (one name a
line), so a test learns which steps a backend's calls really take. Both are inert otherwise.
``attach-progress-<key>`` follows the journalling of a backend's ``record_progress(<key>=...)``
(``<key>``: the first key of that report).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import signal
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

from flexhub.backend import Attachment, Backend, BlockBackend, FilesystemBackend
from flexhub.errors import (
    MIN_SECRET_CHARS,
    BackendError,
    FlexhubError,
    LockTimeout,
    ReleaseDeferred,
    StateError,
    VolumeError,
)
from flexhub.node import Node
from flexhub.node.fs import format_and_mount, grow_filesystem
from flexhub.node.journal import PodRecord, VolumeRecord, record_details
from flexhub.node.mounts import (
    MountEntry,
    bind_mount,
    check_block_mount_options,
    check_mount_options,
    cleanup_mount_point,
    is_corrupted,
)
from flexhub.node.statedir import secure_state_dir
from flexhub.volume import PodInfo, Volume

__all__ = [
    "CHECKPOINTS",
    "CRASH_ENV",
    "TRACE_ENV",
    "UNMOUNT_CHECKPOINTS",
    "apply_fs_group",
    "checkpoint",
    "expand_volume",
    "mount_volume",
    "pod_dir",
    "staging_dir",
    "unmount_volume",
]

LOG = logging.getLogger(__name__)

CRASH_ENV = "FLEXHUB_TEST_CRASH_AT"
#: Test hook: the file each checkpoint reached is appended to.
TRACE_ENV = "FLEXHUB_TEST_TRACE"

#: The steps of a block mount, in order, at which :func:`checkpoint` may crash the process.
CHECKPOINTS = (
    "pod-record",
    "volume-intent",
    "attached",
    "volume-record",
    "staged",
    "bound",
    "done",
)
#: The steps of a block unmount at which :func:`checkpoint` may crash the process (a filesystem
#: unmount reaches only ``unbound``).
UNMOUNT_CHECKPOINTS = ("unbound", "unstaged", "released")

#: Key of the pod's namespace in a volume record's options (never one of a backend's keys).
_NAMESPACE = "kubernetes.io/pod.namespace"
_K = TypeVar("_K", str, Path)

#: Seconds given to the ``stat`` of a possibly stale mount point.
STAT_TIMEOUT = 5.0


def checkpoint(name: str) -> None:
    """Test hook: SIGKILL this process when ``$FLEXHUB_TEST_CRASH_AT`` is ``name``; append
    ``name`` to the file ``$FLEXHUB_TEST_TRACE`` when set."""
    trace = os.environ.get(TRACE_ENV)
    if trace:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(trace, flags, 0o600)
        try:
            os.write(fd, f"{name}\n".encode())
        finally:
            os.close(fd)
    if os.environ.get(CRASH_ENV) == name:
        LOG.warning("test hook: crashing at checkpoint %s", name)
        os.kill(os.getpid(), signal.SIGKILL)


def staging_dir(node: Node, volume_id: str) -> Path:
    """The directory where the block volume ``volume_id`` is mounted once for the node."""
    import hashlib

    digest = hashlib.sha256(volume_id.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return _staging_root(node) / digest


def _staging_root(node: Node) -> Path:
    # mountinfo shows resolved paths; state_dir is ours (never stale), so resolving is safe.
    return Path(os.path.realpath(node.state_dir)) / "staging"


def _abs(target: Path) -> Path:
    return Path(os.path.normpath(os.path.abspath(target)))


def pod_dir(target: Path) -> Path:
    """The pod volume directory as mountinfo names it: kubelet's directories resolved.

    Operators often make ``/var/lib/kubelet`` (or ``.../pods``) a symlink to a data disk;
    kubelet passes the path as configured, mountinfo shows the resolved one. Only the parent
    (kubelet's own directory, never a volume) is resolved; the last component is appended as
    given, because resolving a possibly stale mount point can hang.
    """
    absolute = _abs(target)
    return Path(os.path.realpath(absolute.parent)) / absolute.name


def _adopt_pod_record(node: Node, given: Path, target: Path) -> None:
    """Move a pod record keyed by the unresolved path ``given`` (older flexhub) to ``target``.

    The caller holds the pod lock; a record already under ``target`` wins.
    """
    if given == target or node.journal.get_pod(target) is not None:
        return
    old = node.journal.get_pod(given)
    if old is None:
        return
    LOG.info("pod record of %s moves to its resolved path %s", given, target)
    try:
        node.journal.put_pod(dataclasses.replace(old, target=str(target)))
        node.journal.delete_pod(given)
    except StateError as exc:  # a read-only state_dir: the mount table still tells
        LOG.warning("cannot move the pod record of %s: %s", given, exc)


def _backend_name(node: Node, backend: Backend, volume: Volume) -> str:
    return volume.backend or node.backend or type(backend).__name__


def _check_no_secret(backend_name: str, details: dict[str, str], volume: Volume) -> None:
    # Whole values only: a CHAP user name inside an IQN, or a one-letter value, is no leak.
    secrets = {
        form
        for secret in volume.secrets.revealed()
        for form in (secret, secret.strip())
        if len(form) >= MIN_SECRET_CHARS
    }
    for key, value in details.items():
        if value in secrets or value.strip() in secrets or key in secrets:
            raise BackendError(
                f"backend {backend_name!r} returned a secret in its details ({key!r}): "
                "refusing to journal it"
            )


def apply_fs_group(root: Path, gid: int) -> None:
    """Give ``root`` (a filesystem's root directory) group ``gid``, ``g+rwx`` and setgid."""
    info = os.stat(root)
    if info.st_gid != gid:
        os.chown(root, -1, gid)
    mode = stat.S_IMODE(info.st_mode) | stat.S_IRWXG | stat.S_ISGID
    if mode != stat.S_IMODE(info.st_mode):
        os.chmod(root, mode)


@contextlib.contextmanager
def _volume_locks(node: Node, volume_id: str | None, staging: Path) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if volume_id is not None:
            stack.enter_context(node.lock("volume", volume_id))
        stack.enter_context(node.lock("staging", str(staging)))
        yield


def _same_device(entry: MountEntry | None, other: MountEntry | None) -> bool:
    return entry is not None and other is not None and entry.major_minor == other.major_minor


def _device_number(device: str) -> str | None:
    try:
        rdev = os.stat(device).st_rdev
    except OSError:
        return None
    return f"{os.major(rdev)}:{os.minor(rdev)}"


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


# -- mount ---------------------------------------------------------------------------------------


def mount_volume(node: Node, backend: Backend, target: Path, volume: Volume) -> None:
    """Mount ``volume`` on the pod directory ``target``; idempotent, rolled back on failure.

    :raises FlexhubError: the mount failed; what this call did was undone.
    """
    given, target = _abs(target), pod_dir(target)
    check_mount_options(volume.mount_options)
    if isinstance(backend, BlockBackend):
        check_block_mount_options(volume.mount_options)
    secure_state_dir(node.state_dir)
    volume_id = backend.volume_id(volume)
    with node.lock("pod", str(target)):
        _adopt_pod_record(node, given, target)
        if isinstance(backend, BlockBackend):
            _mount_block(node, backend, target, volume, volume_id)
        elif isinstance(backend, FilesystemBackend):
            _mount_filesystem(node, backend, target, volume, volume_id)
        else:
            raise BackendError(f"backend {type(backend).__name__} is neither block nor filesystem")


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


def _mount_block(
    node: Node, backend: BlockBackend, target: Path, volume: Volume, volume_id: str
) -> None:
    name = _backend_name(node, backend, volume)
    fs_type = volume.fs_type_or_default()
    staging = staging_dir(node, volume_id)
    with _volume_locks(node, volume_id, staging):
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
    if staged is None or not _record_matches(vrecord, staged):
        vrecord = _attach_and_record(
            node, backend, volume, volume_id, name, staging, staged, progress
        )
    assert vrecord is not None
    if staged is not None and not volume.read_only and staged.read_only:
        _unstage_read_only(node, staging, target, volume_id)
        staged = None
    if staged is None:
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


def _unstage_read_only(node: Node, staging: Path, target: Path, volume_id: str) -> None:
    """Unmount a read-only staging mount a read-write pod needs, so it is checked again.

    A read-only mount skipped ``fsck`` (and may skip journal recovery); remounting it
    read-write would write to a filesystem nobody checked. It is unmounted instead, and the
    caller stages it again through the full first-mount path (fsck, mount read-write). That
    is impossible while read-only pods use it (their binds keep the filesystem mounted):
    refused then, and kubelet retries once they are gone.

    :raises VolumeError: read-only pods use the staging mount.
    """
    users = _users(node, staging, exclude=target)
    if users:
        raise VolumeError(
            f"volume {volume_id} is mounted read-only by {len(users)} pod(s) on this node; a "
            "read-write mount needs the filesystem checked first, which needs them gone"
        )
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
    backend: BlockBackend, volume: Volume, volume_id: str, record: VolumeRecord
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
            f"volume {volume_id} is already staged on this node with another connection "
            f"identity: {', '.join(differ)} differ(s); refusing to share it"
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
        record[0] = dataclasses.replace(record[0], partial={**record[0].partial, **details})
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
                backend.detach(progress.attachment)
            elif record is not None:
                _detach(backend, record)
        except ReleaseDeferred as exc:
            _keep_for_later(node, volume_id, staging, exc, [])
            return
        node.journal.delete_volume(volume_id)
        _remove_dir(staging)
    except (FlexhubError, OSError) as exc:
        LOG.error("rollback of the mount of %s on %s failed: %s", volume_id, target, exc)


def _users(node: Node, staging: Path, exclude: Path) -> list[str]:
    """The pod directories still bound to the staging mount (journal checked by mountinfo).

    Pod records of this staging directory whose target is no longer bound to it are stale
    (a crash, a reboot) and are pruned; the caller holds the volume's locks, so no mount of
    it is in flight. Binds found in mountinfo but missing from the journal (a lost record)
    count too: a staging mount is never pulled from under a pod.
    """
    staged = node.mounts.at(staging)
    users: set[str] = set()
    for record in node.journal.pods():
        if record.staging != str(staging) or record.target == str(exclude):
            continue
        bound = node.mounts.at(record.target)
        if _same_device(bound, staged):
            users.add(record.target)
        else:
            LOG.info("pruning stale pod record of %s (not bound to %s)", record.target, staging)
            with contextlib.suppress(FlexhubError):
                node.journal.delete_pod(record.target)
    if staged is not None:
        for entry in node.mounts.users_of(staged):
            point = entry.mount_point
            if point in (str(staging), str(exclude)) or point in users:
                continue
            if Path(point).parent == staging.parent:
                continue  # another staging dir of the same device: not a pod
            LOG.warning("%s is bound to %s without a pod record: counting it", point, staging)
            users.add(point)
    return sorted(users)


def _detach(backend: BlockBackend, record: VolumeRecord) -> None:
    """Release the device of ``record``; for an intent, what the attach reported (or, for a
    backend that reports nothing, attach again (idempotent) first)."""
    if not record.pending:
        backend.detach(Attachment(record.device, dict(record.details)))
        return
    if backend.releases_partial:
        LOG.info(
            "%s was interrupted during attach: releasing what it reported (%s)",
            record.volume_id,
            ", ".join(f"{k}={v}" for k, v in sorted(record.partial.items())) or "nothing",
        )
        backend.release(dict(record.partial))
        return
    if not record.options:
        LOG.warning("intent record of %s has no options: cannot release it", record.volume_id)
        return
    LOG.info("%s was interrupted during attach: re-attaching to detach it", record.volume_id)
    own = {k: v for k, v in record.options.items() if k != _NAMESPACE}
    namespace = record.options.get(_NAMESPACE, "")
    volume = Volume(
        options=own,
        fs_type=record.fs_type,
        pod=PodInfo(namespace=namespace) if namespace else None,
    )
    try:
        attachment = backend.attach(volume)
    except FlexhubError as exc:
        LOG.warning(
            "cannot re-attach %s to release it (%s): assuming nothing is attached",
            record.volume_id,
            exc,
        )
        return
    backend.detach(attachment)


def _remove_dir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError as exc:
        if exc.errno == errno.EROFS:
            LOG.warning("cannot remove %s: %s", path, exc.strerror)
        elif exc.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EBUSY):
            raise


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
    secure_state_dir(node.state_dir)
    notes = _unmount_pod(node, target, load_backend)
    retry_deferred_releases(node, load_backend)
    return "; ".join(notes)


def _unmount_pod(node: Node, target: Path, load_backend: Callable[[str], Backend]) -> list[str]:
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


#: The longest wait between two tries of a release deferred for unreachable storage.
RETRY_MAX = 900.0


def retry_deferred_releases(node: Node, load_backend: Callable[[str], Backend]) -> None:
    """Try again each release that waited for its storage (usually there is none).

    Each is tried ``release_retry_interval`` seconds after it was deferred, then after twice
    as long each time (up to :data:`RETRY_MAX`), so that storage that stays unreachable (or a
    target that takes writes and never answers) cannot make every unmount on the node slow.
    A volume that a call holds is skipped (never waited for), one that is staged again is no
    longer waiting (its own last unmount releases it). Nothing here fails the call: it is
    logged.
    """
    now = time.time()
    for waiting in node.journal.deferred_releases():
        pause = min(node.config.release_retry_interval * 2**waiting.attempts, RETRY_MAX)
        if now - waiting.since < pause:
            continue
        volume_id = waiting.volume_id
        staging = staging_dir(node, volume_id)
        try:
            with node.lock("volume", volume_id, 0), node.lock("staging", str(staging), 0):
                if not _retry_release(node, volume_id, staging, load_backend):
                    node.journal.defer_release(volume_id, waiting.attempts + 1)
        except LockTimeout:
            LOG.info("the deferred release of %s waits: a call holds the volume", volume_id)
        except (FlexhubError, OSError) as exc:
            LOG.error("the deferred release of %s failed: %s", volume_id, exc)
            with contextlib.suppress(FlexhubError):
                node.journal.defer_release(volume_id, waiting.attempts + 1)


def _retry_release(
    node: Node, volume_id: str, staging: Path, load_backend: Callable[[str], Backend]
) -> bool:
    """One try; ``False`` when the release still waits."""
    record = node.journal.get_volume(volume_id)
    if record is None or node.mounts.at(staging) is not None:
        # released meanwhile, or mounted again: its next last unmount releases it
        node.journal.clear_deferred(volume_id)
        return True
    backend = _load_for_unmount(load_backend, record.backend, volume_id)
    if not isinstance(backend, BlockBackend):
        return False
    try:
        _detach(backend, record)
    except ReleaseDeferred as exc:
        LOG.info("the release of %s still waits: %s", volume_id, exc)
        return False
    node.journal.delete_volume(volume_id)
    node.journal.clear_deferred(volume_id)
    _remove_dir(staging)
    LOG.info("released %s (its release had waited for the storage)", volume_id)
    return True


def _keep_for_later(
    node: Node, volume_id: str, staging: Path, exc: ReleaseDeferred, notes: list[str]
) -> None:
    """The storage is unreachable: the device and its record stay, so that writes still
    queued reach the storage when it returns; a later unmount retries
    (:func:`retry_deferred_releases`)."""
    LOG.error("%s: %s", volume_id, exc.message)
    notes.append(exc.message)
    try:
        node.journal.defer_release(volume_id)
    except StateError as state_exc:
        LOG.warning("the deferred release was not recorded: %s", state_exc)
        notes.append(f"journal not updated: {state_exc}")
    _remove_dir(staging)


def _forget(delete: Callable[[_K], None], key: _K, notes: list[str]) -> None:
    """Delete a journal record after the unmount it describes: a failure is only a warning
    (the next call finds nothing mounted and deletes it then)."""
    try:
        delete(key)
    except StateError as exc:
        LOG.warning("unmounted, but the journal was not updated: %s", exc)
        notes.append(f"journal not updated: {exc}")


def _unmount_filesystem(
    node: Node, target: Path, record: PodRecord, load_backend: Callable[[str], Backend]
) -> None:
    backend = None
    if node.mounts.is_mount_point(target):
        backend = _load_for_unmount(load_backend, record.backend, record.volume_id)
    with _filesystem_lock(node, type(backend), record.volume_id):
        if isinstance(backend, FilesystemBackend) and node.mounts.is_mount_point(target):
            backend.unmount(target, record.details)
        cleanup_mount_point(node.runner, target, node.config.unmount_timeout, node.mounts)


def _load_for_unmount(
    load_backend: Callable[[str], Backend], name: str, volume_id: str
) -> Backend | None:
    """The backend ``name``, or ``None`` (logged) when it cannot be loaded: unmount goes on
    with what the core can do alone."""
    try:
        return load_backend(name)
    except FlexhubError as exc:
        LOG.warning("backend %r unusable for unmounting %s: %s", name, volume_id, exc)
        return None


def _guess_staging(node: Node, target: Path) -> tuple[Path | None, str | None]:
    """Without a pod record: find the staging mount ``target`` is a bind of, from mountinfo."""
    here = node.mounts.at(target)
    if here is None:
        return None, None
    root = str(_staging_root(node))
    for entry in node.mounts.users_of(here):
        if entry.mount_point != str(target) and str(Path(entry.mount_point).parent) == root:
            staging = Path(entry.mount_point)
            record = node.journal.volume_by_staging(staging)
            LOG.warning(
                "no readable record for %s: it is a bind of %s (volume %s)",
                target,
                staging,
                record.volume_id if record else "unknown",
            )
            return staging, record.volume_id if record else None
    return None, None


def _release(
    node: Node,
    staging: Path,
    volume_id: str | None,
    target: Path,
    load_backend: Callable[[str], Backend],
    notes: list[str],
) -> None:
    """Unmount the staging directory and detach the device, unless another pod uses them."""
    users = _users(node, staging, exclude=target)
    if users:
        LOG.info("%s stays staged: still used by %d pod(s)", staging, len(users))
        return
    record = (
        node.journal.get_volume(volume_id)
        if volume_id is not None
        else node.journal.volume_by_staging(staging)
    )
    staged = node.mounts.at(staging)
    cleanup_mount_point(node.runner, staging, node.config.unmount_timeout, node.mounts)
    checkpoint("unstaged")
    if record is None:
        if staged is not None:
            LOG.warning(
                "no readable record for %s: %s unmounted but left attached", staging, staged.source
            )
        _forget(node.journal.delete_volume_by_prefix, staging.name, notes)
    else:
        backend = _load_for_unmount(load_backend, record.backend, record.volume_id)
        if not isinstance(backend, BlockBackend):
            # The core unmounted everything; only the backend knows how to release its device.
            # The record stays: the next mount of the volume reuses the device, `flexhub state`
            # shows it, and an unmount after the backend is repaired releases it.
            left = (
                f"{record.device or 'the device'} of {record.volume_id} left attached: "
                f"backend {record.backend!r} cannot be loaded to release it"
            )
            LOG.warning("%s", left)
            notes.append(left)
            _remove_dir(staging)
            return
        try:
            _detach(backend, record)
        except ReleaseDeferred as exc:
            _keep_for_later(node, record.volume_id, staging, exc, notes)
            return
        _forget(node.journal.delete_volume, record.volume_id, notes)
    _remove_dir(staging)
    LOG.info("released %s", record.volume_id if record else staging)


# -- expand --------------------------------------------------------------------------------------


def _staged_volume_id(node: Node, target: Path, volume: Volume) -> str | None:
    """The volume id journalled for the pod directory ``target``, if it is a block volume.

    ``expandfs`` carries the PV's options but no pod, so a backend whose volume id depends on
    the pod (loopfile's namespace areas) is found through the pod directory's record.
    """
    record = node.journal.get_pod(_abs(target))
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
    staging = staging_dir(node, volume_id)
    with _volume_locks(node, volume_id, staging):
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
