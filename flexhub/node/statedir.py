"""The state directory is root's alone: ``state_dir`` and its sub-directories are mode 0700.

Everything flexhub keeps there (the journal, lock files, loop-device markers) is private, and
``staging/`` holds the node-wide staging mounts: a staged volume's files are reachable through
``<state_dir>/staging/<hash>`` by anybody who may traverse the path. :func:`secure_state_dir`
runs whenever the node services are set up (every ``mount``, ``unmount`` and ``expandfs``):

* a missing ``state_dir`` and the sub-directories that lead to staging mounts and records
  (:data:`PRIVATE_DIRS`) are created 0700 up front, so no ``mkdir(parents=True)`` later makes
  one with the process umask;
* an existing ``state_dir`` or direct sub-directory with any group or other bit (an older
  flexhub created ``state_dir`` and ``staging/`` 0755) is tightened to 0700 on its next use,
  and the change is logged once. Nothing deeper is touched: ``staging/<hash>`` are mount
  points, and a chmod there would change the mounted filesystem's root directory.

A symlinked sub-directory is left alone; a symlinked ``state_dir`` is followed (its target is
the state directory).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
from pathlib import Path

from flexhub.errors import StateError

__all__ = [
    "PRIVATE_DIRS",
    "fsync_directory",
    "private_dir",
    "remove_dead_temporaries",
    "secure_state_dir",
    "write_atomically",
]

LOG = logging.getLogger(__name__)

#: Sub-directories created 0700 with the state directory.
PRIVATE_DIRS = ("staging", "pods", "volumes", "locks")

_OPEN = stat.S_IRWXG | stat.S_IRWXO


def _tighten(path: Path, info: os.stat_result) -> None:
    mode = stat.S_IMODE(info.st_mode)
    if mode & _OPEN:
        os.chmod(path, mode & ~_OPEN)  # a directory (callers skip symlinked sub-directories)
        LOG.warning("tightened %s from %04o to %04o", path, mode, mode & ~_OPEN)


def private_dir(state_dir: Path, *names: str) -> Path:
    """Make ``state_dir`` (0700) and ``state_dir/names[0]/names[1]/...`` (each 0700) where
    missing, and return the last; missing parents of ``state_dir`` are made 0755.

    Every place that creates the state directory or a directory under it (the memo and
    stevedore's cache, the journal, the locks, a log directory inside it) goes through here,
    so none of them makes one with the umask's mode (``mkdir(parents=True)`` and
    ``os.makedirs`` give missing parents 0777 less the umask). Existing directories are left as
    they are: :func:`secure_state_dir` tightens them.

    :raises OSError: a directory cannot be made.
    """
    from flexhub.node.dirs import make_private

    return Path(make_private(str(state_dir), *names))


def secure_state_dir(state_dir: Path) -> None:
    """Create ``state_dir`` 0700 when missing and tighten it and its sub-directories.

    :raises StateError: the directory cannot be created or its mode cannot be changed.
    """
    try:
        private_dir(state_dir)
        _tighten(state_dir, os.stat(state_dir))
        for name in PRIVATE_DIRS:
            private_dir(state_dir, name)
        with os.scandir(state_dir) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    _tighten(Path(entry.path), entry.stat(follow_symlinks=False))
    except OSError as exc:
        raise StateError(
            f"cannot make the state directory {state_dir} private: {exc.strerror or exc}"
        ) from None


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a zombie counts: its writes may not be over)."""
    if pid <= 0 or pid > 1 << 22:
        return True  # never a writer's pid (pid_max is at most 2**22): unknown, keep its file
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError as exc:
        return exc.errno != errno.ESRCH  # EPERM: it exists
    return True


def remove_dead_temporaries(directory: str | os.PathLike[str], pattern: re.Pattern[str]) -> None:
    """Remove the temporaries that writers killed between write and rename left in ``directory``.

    Only names that ``pattern`` matches whole (its group ``pid`` the writer's process id),
    only regular files (a symlink or anything else is left alone, and nothing is followed:
    the directory is opened without following a symlink, the files are looked at and removed
    relative to it), and only when that process is gone; never this process's own. Errors are
    logged, never raised: this is tidying.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # missing (nothing written yet), or not a directory: nothing of ours there
    try:
        for name in os.listdir(fd):
            match = pattern.fullmatch(name)
            if match is None:
                continue
            pid = int(match.group("pid"))
            if pid == os.getpid() or process_alive(pid):
                continue
            with contextlib.suppress(FileNotFoundError):
                info = os.lstat(name, dir_fd=fd)
                if not stat.S_ISREG(info.st_mode):
                    continue
                os.unlink(name, dir_fd=fd)
                LOG.info("removed %s/%s, left by a killed writer (pid %d)", directory, name, pid)
    except OSError as exc:
        LOG.warning("cannot tidy %s: %s", directory, exc.strerror or exc)
    finally:
        os.close(fd)


def write_atomically(
    path: str | os.PathLike[str], payload: bytes, *, sync_directory: bool = True
) -> None:
    """Replace ``path`` with a file holding ``payload``, atomically: readers (and a crash) see
    the old file or the new one whole, never a part.

    ``payload`` goes to the temporary ``.<name>.<pid>.tmp`` in the same directory (opened
    without following a symlink, mode 0600 whatever the umask) and is synced (``fsync``), then
    renamed over ``path`` (a symlink at ``path`` is replaced, not followed) and, with
    ``sync_directory``, the directory is synced so the rename survives a power cut. The
    directory must exist. On any failure the temporary is removed and the error raised; one
    a killed writer left is for :func:`remove_dead_temporaries` (with a pattern of that name).

    :raises OSError: the file cannot be written, synced or renamed.
    """
    directory, name = os.path.split(os.fspath(path))
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    try:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            os.fchmod(fd, 0o600)
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_directory:
        fsync_directory(directory or ".")


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """``fsync`` the directory itself, so that the names made, renamed or removed in it
    survive a power cut.

    :raises OSError: it cannot be opened or synced.
    """
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
