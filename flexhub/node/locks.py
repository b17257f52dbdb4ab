"""Cross-process node locks: one ``flock`` file per (kind, key), with a bounded wait."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flexhub.errors import LockTimeout, StateError

__all__ = ["lock", "lock_path"]

LOG = logging.getLogger(__name__)

#: Seconds between two attempts while a lock is busy.
POLL_INTERVAL = 0.05


def lock_path(lock_dir: Path, kind: str, key: str) -> Path:
    """The lock file of ``(kind, key)``: a hash, so any key is a safe file name."""
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:40]
    return lock_dir / f"{kind}-{digest}.lock"


@contextmanager
def lock(
    lock_dir: Path, kind: str, key: str, timeout: float, shared: bool = False
) -> Iterator[None]:
    """Hold an exclusive (or, with ``shared``, a shared) ``flock`` on ``(kind, key)``.

    Locks are per volume or per shared resource, never global. The kernel drops them when the
    holder dies, even by SIGKILL, so a crash never leaves a lock behind. Lock files are kept
    (removing them would race with a waiter that already opened the file).

    :param kind: what is locked, e.g. ``"pod"``, ``"volume"``, ``"loopfile"``.
    :param key: the non-secret identity of the thing (a path, a volume id).
    :param timeout: seconds to wait for a busy lock (0: try once).
    :param shared: many holders at once; an exclusive holder waits for all of them.
    :raises LockTimeout: the lock stayed busy for ``timeout`` seconds.
    :raises StateError: the lock directory or file cannot be created.
    """
    path = lock_path(lock_dir, kind, key)
    try:
        lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise StateError(f"cannot open lock file {path}: {exc.strerror}") from None
    try:
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise StateError(f"cannot lock {path}: {exc.strerror}") from None
            if not waited:
                LOG.debug("waiting for the %s lock of %s", kind, key)
                waited = True
            if time.monotonic() >= deadline:
                raise LockTimeout(
                    f"timed out after {timeout:g}s waiting for the {kind} lock of {key}"
                )
            time.sleep(POLL_INTERVAL)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
