"""Open an export's sub-directory one component at a time, never through a symlink.

The export is the server's: a directory in it may be a symlink (planted by any client that
can write there, or served by a hostile server), and the node's kernel would follow it in the
*node's* namespace (``/etc``, ``../..``). :func:`open_sub_path` therefore starts from a
descriptor of the mounted export and opens each component with ``openat(O_NOFOLLOW |
O_DIRECTORY)``; a missing component is made with ``mkdirat`` (when asked) and opened the same
way. Any symlink, or anything that is not a directory, is refused. The caller bind-mounts the
returned descriptor (``/proc/<pid>/fd/<n>``), so what is mounted is exactly what was checked.

Everything here may block on a dead server: the caller runs it in
:func:`flexhub.claimdir.bounded` (a daemon thread given up after a bound; the caller then
tears the export's mount down, which ends the wait).
"""

from __future__ import annotations

import errno
import os
import stat

from flexhub.backend import VolumeError

__all__ = ["SubPathMissing", "open_sub_path"]

_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Missing parents get mkdir's default (0777 less the umask), as ``mkdir -p`` gives them.
_PARENT_MODE = 0o777


class SubPathMissing(VolumeError):
    """A component of the sub-directory does not exist (and was not to be created)."""


def _open_dir(parent: int, name: str, shown: str) -> int:
    try:
        return os.open(name, _FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        info = None
    if info is not None and stat.S_ISLNK(info.st_mode):
        raise VolumeError(f"{shown} is a symbolic link in the export")
    raise VolumeError(f"{shown} is not a directory in the export")


def open_sub_path(root: int, sub_path: str, *, create: bool, mode: int) -> int:
    """Return a descriptor of ``sub_path`` below the directory ``root``, walked safely.

    :param root: a descriptor of the export's root directory (not consumed).
    :param create: make missing components (``mkdirat``); the last one gets exactly ``mode``
        (``fchmod``, so the umask cannot narrow it and setgid is kept), the others
        ``0777`` less the umask.
    :raises SubPathMissing: a component is missing and ``create`` is false.
    :raises VolumeError: a component is a symlink or not a directory, or cannot be made.
    """
    parts = sub_path.split("/")
    if not sub_path or any(part in ("", ".", "..") for part in parts):
        raise VolumeError(f"subPath {sub_path!r} is not a plain relative path")
    fd = os.dup(root)
    try:
        for index, name in enumerate(parts):
            shown = "/".join(parts[: index + 1])
            last = index == len(parts) - 1
            try:
                child = _open_dir(fd, name, shown)
            except FileNotFoundError:
                if not create:
                    raise SubPathMissing(f"{shown} does not exist in the export") from None
                made = True
                try:
                    os.mkdir(name, 0o700 if last else _PARENT_MODE, dir_fd=fd)
                except FileExistsError:
                    made = False  # made concurrently: opened (and checked) below
                child = _open_dir(fd, name, shown)
                if made and last:
                    try:
                        os.fchmod(child, mode)
                    except OSError:
                        os.close(child)
                        raise
            except OSError as exc:
                raise VolumeError(f"cannot open {shown} in the export: {exc.strerror}") from None
            os.close(fd)
            fd = child
        return fd
    except OSError as exc:
        os.close(fd)
        raise VolumeError(f"cannot create {sub_path} in the export: {exc.strerror}") from None
    except BaseException:
        os.close(fd)
        raise
