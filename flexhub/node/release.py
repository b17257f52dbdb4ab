"""Release a block volume's device: the last pod's unmount, a release deferred, a busy device.

The device is released only once it opens with ``O_EXCL`` (:func:`_check_free`: no
filesystem, in any mount namespace, still holds it) and its backend does not ask to wait
(:meth:`~flexhub.backend.BlockBackend.release_waits`). A release that must wait
(:class:`~flexhub.errors.ReleaseDeferred`: unreachable storage, a busy device) keeps the
device and its record and is tried again after later unmounts
(:func:`retry_deferred_releases`). An attach interrupted before it was journalled is
released from what it reported (:func:`_detach`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from flexhub.backend import Attachment, Backend, BlockBackend
from flexhub.errors import FlexhubError, LockTimeout, ReleaseDeferred, StateError
from flexhub.node import Node
from flexhub.node.checkpoints import checkpoint
from flexhub.node.journal import VolumeRecord
from flexhub.node.mounts import cleanup_mount_point
from flexhub.node.podrecords import (
    _NAMESPACE,
    _forget,
    _staging_root,
    _users,
    journalled_staging,
    raw_consumers,
    staging_key,
)
from flexhub.volume import PodInfo, Volume

__all__ = ["OPEN_TIMEOUT", "RETRY_MAX", "retry_deferred_releases"]

LOG = logging.getLogger(__name__)


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
        staging = journalled_staging(node, volume_id)
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
    if record is None or node.mounts.at(staging) is not None or raw_consumers(node, volume_id):
        # released meanwhile, or mounted (or attached raw) again: its next last unmount
        # releases it
        node.journal.clear_deferred(volume_id)
        return True
    backend = _load_for_unmount(load_backend, record.backend, volume_id)
    if not isinstance(backend, BlockBackend):
        return False
    try:
        _check_free(backend, _attachment(record), volume_id)
        _detach(backend, record)
    except ReleaseDeferred as exc:
        LOG.info("the release of %s still waits: %s", volume_id, exc)
        return False
    node.journal.delete_volume(volume_id)
    node.journal.clear_deferred(volume_id)
    _remove_staging(node, staging)
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
    _remove_staging(node, staging)


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
        _forget(node.journal.delete_volume_by_prefix, staging_key(node, staging), notes)
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
            _remove_staging(node, staging)
            return
        try:
            _check_free(backend, _attachment(record), record.volume_id)
            _detach(backend, record)
        except ReleaseDeferred as exc:
            _keep_for_later(node, record.volume_id, staging, exc, notes)
            return
        _forget(node.journal.delete_volume, record.volume_id, notes)
    _remove_staging(node, staging)
    LOG.info("released %s", record.volume_id if record else staging)


#: Seconds the exclusive open of a device to release may take (it does no I/O).
OPEN_TIMEOUT = 5.0
#: Tries of that open, :data:`_BUSY_PAUSE` apart, before the release waits.
_BUSY_TRIES = 5
_BUSY_PAUSE = 0.2


def _attachment(record: VolumeRecord) -> Attachment:
    return Attachment(record.device, dict(record.details))


def _check_free(backend: BlockBackend, attachment: Attachment, volume_id: str) -> None:
    """Refuse to release the device of ``attachment`` while its filesystem (or anything)
    still holds it.

    An unmount, lazy or not, is no proof that the filesystem is gone: another mount
    namespace (a container that copied the host's mounts) may still have it mounted, and
    then the host's umount neither synced nor shut it down. An exclusive open (``O_EXCL``
    on a block device) fails with EBUSY while the device is mounted anywhere or held by a
    holder. A few tries, briefly apart: a filesystem whose last mount just went needs a
    moment to let go. The backend is asked first (:meth:`BlockBackend.release_waits`): a
    filesystem lazily unmounted while its storage is unreachable is busy too, and then the
    storage is the reason to name. A device the backend says is no longer the attachment's
    (:meth:`BlockBackend.still_attached`: the name was reused) is not probed.

    :raises ReleaseDeferred: the device is busy (or its open hangs): it stays attached
        with its record, and a later unmount tries again.
    """
    device = attachment.device
    if not device:
        return  # an intent: nothing of it was mounted
    waits = backend.release_waits(attachment)
    if waits:
        raise ReleaseDeferred(waits)
    if backend.still_attached(attachment) is False:
        # The name now maps another device (after a reboot, or the loss of this one): its
        # being busy says nothing about this volume; the backend's detach leaves it alone.
        LOG.info("%s of %s is no longer its device: not waiting for it", device, volume_id)
        return
    try:
        if not stat.S_ISBLK(os.stat(device).st_mode):
            return
    except OSError:
        return  # gone already: the backend's release deals with what is left
    why = ""
    for attempt in range(_BUSY_TRIES):
        why = _open_exclusive(device)
        if why != "busy":
            break  # free, or an open that hangs (trying again would hang again)
        if attempt + 1 < _BUSY_TRIES:
            time.sleep(_BUSY_PAUSE)
    if not why:
        return
    raise ReleaseDeferred(
        f"{device} of {volume_id} is still in use after its unmount ({why}: its filesystem "
        "is still mounted elsewhere, e.g. in another mount namespace, or a process holds "
        "it): it stays attached; a later unmount releases it once it is free"
    )


def _open_exclusive(device: str) -> str:
    """``""`` if ``device`` opens with ``O_EXCL`` (closed at once), else why not."""
    outcome: list[str] = []

    def probe() -> None:
        try:
            fd = os.open(device, os.O_RDONLY | os.O_EXCL | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            outcome.append("busy" if exc.errno == errno.EBUSY else "")
            return
        os.close(fd)
        outcome.append("")

    thread = threading.Thread(target=probe, name="flexhub-open-exclusive", daemon=True)
    thread.start()
    thread.join(OPEN_TIMEOUT)
    if thread.is_alive():
        return f"opening it did not finish within {OPEN_TIMEOUT:g}s"
    return outcome[0]


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


def _remove_staging(node: Node, staging: Path) -> None:
    """Remove the staging directory ``staging`` and, for one that repeats a CO's staging
    path (:func:`~flexhub.node.podrecords.staging_dir`), its parents up to the volume's."""
    root = _staging_root(node)
    path = staging
    while path != root and root in path.parents:
        if not _remove_dir(path):
            return
        path = path.parent


def _remove_dir(path: Path) -> bool:
    """Remove the empty directory ``path``; ``False`` when it stays (not empty, busy, a
    read-only state directory), ``True`` when it is gone."""
    try:
        path.rmdir()
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return True
        if exc.errno == errno.EROFS:
            LOG.warning("cannot remove %s: %s", path, exc.strerror)
        elif exc.errno not in (errno.ENOTEMPTY, errno.EBUSY):
            raise
        return False
    return True
