"""The credentials file handed to ``mount.cifs``: created private, removed right after use.

The password never goes on a command line (``/proc/<pid>/cmdline`` is world-readable) nor in
a child's environment (``PASSWD``: ``/proc/<pid>/environ`` of a root process is readable by
root only, but it is copied into every core dump and process listing tool): mount.cifs gets
``credentials=<path>`` and reads the file itself.

The file lives in ``<state_dir>/cifs-creds/``, a directory of mode 0700 owned by flexhub's
user (checked through a descriptor opened with ``O_NOFOLLOW``; a wider mode is narrowed, a
symlink or another owner is refused). It is created with ``O_CREAT | O_EXCL | O_NOFOLLOW``
and mode 0600 under a random name that starts with the creating process's pid and start
time, and removed when the mount command returns, also when it fails or times out (a
``finally``). A file that outlives its process (the call was SIGKILLed while mount.cifs ran)
is removed by the next ``mount`` or ``unmount`` of any CIFS volume on the node, whether or
not that pod directory was ever mounted (the core calls
:meth:`~flexhub_cifs.CifsBackend.collect_leftovers` on every unmount). Its process is gone
when no process has that pid with that start time (a reused pid does not keep it); a file
older than :data:`MAX_AGE` goes in any case. Only regular files of flexhub's user named as
flexhub names them are removed, through the directory's descriptor, never following a
symlink.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from flexhub.backend import VolumeError

__all__ = ["CRED_DIR", "collect_leftovers", "credentials_file"]

LOG = logging.getLogger(__name__)

#: The private directory under the state directory.
CRED_DIR = "cifs-creds"
#: A leftover whose process still seems alive is removed anyway after this many seconds.
MAX_AGE = 3600.0
_SUFFIX = ".cred"


def _open_private_dir(state_dir: Path) -> tuple[int, Path]:
    """Make (or check) ``<state_dir>/cifs-creds`` and return a descriptor of it and its path."""
    path = Path(os.path.realpath(state_dir)) / CRED_DIR
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise VolumeError(
            f"{path} is not a private directory ({exc.strerror}): refusing to write credentials"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise VolumeError(f"{path} is not flexhub's own directory: refusing credentials")
        if stat.S_IMODE(info.st_mode) != 0o700:
            LOG.warning("%s had mode %04o: narrowed to 0700", path, stat.S_IMODE(info.st_mode))
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd, path


def _start_time(pid: int | str) -> str:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field
    22), or ``""`` when there is no such process. With the pid, it names one process for
    good: a pid is reused, a (pid, start time) pair is not until the next boot."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat_line = handle.read()
    except OSError:
        return ""
    # the command name (field 2) is in parentheses and may hold anything: split after it
    fields = stat_line[stat_line.rfind(b")") + 2 :].split()
    return fields[19].decode() if len(fields) > 19 else ""


#: ``<pid>-<start time>-<16 hex>.cred``: what :func:`credentials_file` makes; and
#: ``<pid>-<16 hex>.cred``, what earlier versions made.
_NAME = re.compile(r"([1-9][0-9]{0,9})-(?:([0-9]{1,20})-)?[0-9a-f]{16}\.cred")


def _owner_alive(pid: int, start: str | None) -> bool:
    """Whether the process that made a file of this name may still be using it."""
    if start is None:  # an earlier version's name: the pid alone (MAX_AGE covers reuse)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return _start_time(pid) == start


def _collect(dir_fd: int, path: Path) -> None:
    """Remove the credentials files whose process is gone, or that are older than MAX_AGE.

    Only regular files of flexhub's user with a name :func:`credentials_file` makes count;
    anything else (a symlink, a directory, another name or owner) is left alone and never
    followed.
    """
    now = time.time()
    for name in os.listdir(dir_fd):
        found = _NAME.fullmatch(name)
        if found is None:
            LOG.debug("%s/%s is not a credentials file of flexhub: left alone", path, name)
            continue
        try:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            LOG.warning("%s/%s is not a file flexhub made: left alone", path, name)
            continue
        if _owner_alive(int(found.group(1)), found.group(2)) and now - info.st_mtime < MAX_AGE:
            continue
        LOG.warning("removing leftover credentials file %s/%s", path, name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)


def collect_leftovers(state_dir: Path) -> None:
    """Remove credentials files whose process is gone (a call killed mid-mount)."""
    base = Path(os.path.realpath(state_dir)) / CRED_DIR
    if not base.exists():
        return
    try:
        fd, path = _open_private_dir(state_dir)
    except (OSError, VolumeError) as exc:
        LOG.warning("cannot check %s for leftover credentials: %s", base, exc)
        return
    try:
        _collect(fd, path)
    except OSError as exc:
        LOG.warning("cannot clean %s: %s", path, exc)
    finally:
        os.close(fd)


@contextlib.contextmanager
def credentials_file(state_dir: Path, content: bytes) -> Iterator[str]:
    """Write ``content`` to a new private file and yield its path; always remove it after.

    :raises VolumeError: the private directory is not flexhub's, or the file cannot be made.
    """
    dir_fd, path = _open_private_dir(state_dir)
    try:
        pid = os.getpid()
        name = f"{pid}-{_start_time(pid) or 0}-{secrets.token_hex(8)}{_SUFFIX}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            raise VolumeError(
                f"cannot create a credentials file in {path}: {exc.strerror}"
            ) from None
        try:
            try:
                os.fchmod(fd, 0o600)
                view = memoryview(content)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            yield str(path / name)
        finally:
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                LOG.error("cannot remove credentials file %s/%s: %s", path, name, exc.strerror)
    finally:
        os.close(dir_fd)
