"""Cross-process node locks: one ``flock`` file per (kind, key), with a bounded wait."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flexhub.errors import LockTimeout, StateError
from flexhub.node.fastpath import sha256
from flexhub.node.statedir import private_dir

__all__ = ["lock", "lock_path"]

LOG = logging.getLogger(__name__)

#: Seconds between two attempts while a lock is busy.
POLL_INTERVAL = 0.05


def lock_path(lock_dir: Path, kind: str, key: str) -> Path:
    """The lock file of ``(kind, key)``: a hash, so any key is a safe file name."""
    digest = sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:40]
    return lock_dir / f"{kind}-{digest}.lock"


#: Errors of a state directory that is read-only or full: the lock file cannot be created.
_NO_WRITE = (errno.EROFS, errno.ENOSPC, errno.EDQUOT)


def _open(lock_dir: Path, path: Path, kind: str, key: str) -> int | None:
    """Open (creating it if needed) the lock file; ``None`` when it cannot exist.

    On a read-only or full state directory an existing lock file is opened read-only (a
    ``flock`` needs no write access); a missing one cannot be created, and the call goes on
    unlocked with a warning: nothing that changes the journal can succeed there anyway, so
    only ``unmount`` (which must still unmount) gets that far.
    """
    flags = os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        private_dir(lock_dir.parent, lock_dir.name)  # a missing state_dir 0700 too
        return os.open(path, flags | os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        if exc.errno not in _NO_WRITE:
            raise StateError(f"cannot open lock file {path}: {exc.strerror}") from None
        reason = exc.strerror
    try:
        return os.open(path, flags | os.O_RDONLY)
    except FileNotFoundError:
        LOG.warning(
            "cannot create lock file %s (%s): going on without the %s lock of %s",
            path,
            reason,
            kind,
            key,
        )
        return None
    except OSError as exc:
        raise StateError(f"cannot open lock file {path}: {exc.strerror}") from None


def _is_current(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path`` (a releasing holder may have unlinked it)."""
    try:
        on_disk = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


@contextmanager
def lock(
    lock_dir: Path, kind: str, key: str, timeout: float, shared: bool = False
) -> Iterator[None]:
    """Hold an exclusive (or, with ``shared``, a shared) ``flock`` on ``(kind, key)``.

    Locks are per volume or per shared resource, never global. The kernel drops them when the
    holder dies, even by SIGKILL, so a crash never leaves a lock behind. The holder removes
    the lock file before releasing it, so files do not pile up with pod churn; a waiter that
    opened the file before that finds, once it holds the lock, that the path no longer names
    its file, and starts again on the new one (so two holders never coexist).

    :param kind: what is locked, e.g. ``"pod"``, ``"volume"``, ``"loopfile"``.
    :param key: the non-secret identity of the thing (a path, a volume id).
    :param timeout: seconds to wait for a busy lock (0: try once).
    :param shared: many holders at once; an exclusive holder waits for all of them.
    :raises LockTimeout: the lock stayed busy for ``timeout`` seconds.
    :raises StateError: the lock directory or file cannot be created.
    """
    path = lock_path(lock_dir, kind, key)
    deadline = time.monotonic() + timeout
    waited = False
    while True:
        fd = _open(lock_dir, path, kind, key)
        if fd is None:
            yield
            return
        try:
            _acquire(fd, path, kind, key, deadline, timeout, waited, shared)
            waited = True
            if not _is_current(fd, path):
                continue  # the file we waited on was removed by its last holder
            try:
                yield
            finally:
                if not shared or _try_exclusive(fd):
                    with contextlib.suppress(OSError):
                        path.unlink()  # under an exclusive flock: nobody else holds this file
                fcntl.flock(fd, fcntl.LOCK_UN)
            return
        finally:
            os.close(fd)


def _try_exclusive(fd: int) -> bool:
    """Turn a shared lock into an exclusive one if no other holder is left (never waits).

    The conversion may drop the shared lock first; the caller is releasing it anyway, and
    unlinks the file only when this returns ``True``.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _acquire(
    fd: int,
    path: Path,
    kind: str,
    key: str,
    deadline: float,
    timeout: float,
    waited: bool,
    shared: bool = False,
) -> None:
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StateError(f"cannot lock {path}: {exc.strerror}") from None
        if not waited:
            LOG.debug("waiting for the %s lock of %s", kind, key)
            waited = True
        if time.monotonic() >= deadline:
            raise LockTimeout(f"timed out after {timeout:g}s waiting for the {kind} lock of {key}")
        time.sleep(POLL_INTERVAL)
