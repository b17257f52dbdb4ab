"""Open a share's sub-directory one component at a time, never through a symlink.

The share is the server's: a directory in it may show as a symlink to this client (a
``mfsymlinks`` file or a reparse point planted by any client that can write there, or served
by a hostile server), and the node's kernel would follow it in the *node's* namespace
(``/etc``, ``../..``). :func:`open_sub_path` therefore starts from a descriptor of the mounted
share and opens each component with ``openat(O_NOFOLLOW | O_DIRECTORY)``. Any symlink, or
anything that is not a directory, is refused. The caller bind-mounts the returned descriptor
(``/proc/<pid>/fd/<n>``), so what is mounted is exactly what was checked.

Everything here may block on a dead server: the caller runs it in
:func:`flexhub.claimdir.bounded` (a daemon thread given up after a bound; the caller then
tears the share's mount down, which ends the wait).
(The same decisions as the nfs backend's walk, without ``createSubPath``.)
"""

from __future__ import annotations

import errno
import os
import stat

from flexhub.backend import VolumeError

__all__ = ["SubPathMissing", "open_sub_path"]

_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Mode asked for a directory ``create`` makes (the server applies its own masks).
_MADE_MODE = 0o755


class SubPathMissing(VolumeError):
    """A component of the sub-directory does not exist."""


def _open_dir(parent: int, name: str, shown: str) -> int:
    try:
        return os.open(name, _FLAGS, dir_fd=parent)
    except FileNotFoundError:
        raise SubPathMissing(f"{shown} does not exist in the share") from None
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise VolumeError(f"cannot open {shown} in the share: {exc.strerror}") from None
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        info = None
    if info is not None and stat.S_ISLNK(info.st_mode):
        raise VolumeError(f"{shown} is a symbolic link in the share")
    raise VolumeError(f"{shown} is not a directory in the share")


def open_sub_path(root: int, sub_path: str, *, create: bool = False) -> int:
    """Return a descriptor of ``sub_path`` below the directory ``root``, walked safely.

    :param root: a descriptor of the share's root directory (not consumed).
    :param create: make missing components (``mkdirat``, mode ``0755``; the modes a pod sees
        are the mount's ``dir_mode``); used by provisioning only, never by a pod's mount.
    :raises SubPathMissing: a component is missing (and ``create`` is false).
    :raises VolumeError: a component is a symlink or not a directory, or cannot be made.
    """
    parts = sub_path.split("/")
    if not sub_path or any(part in ("", ".", "..") for part in parts):
        raise VolumeError(f"subPath {sub_path!r} is not a plain relative path")
    fd = os.dup(root)
    try:
        for index, name in enumerate(parts):
            shown = "/".join(parts[: index + 1])
            try:
                child = _open_dir(fd, name, shown)
            except SubPathMissing:
                if not create:
                    raise
                try:
                    os.mkdir(name, _MADE_MODE, dir_fd=fd)
                except FileExistsError:
                    pass  # made concurrently: opened (and checked) below
                except OSError as exc:
                    raise VolumeError(f"cannot make {shown} in the share: {exc.strerror}") from None
                child = _open_dir(fd, name, shown)
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise
