"""A claim's directory in the share: made, removed or archived, never through a symlink.

Every step starts from a descriptor of the mounted share's root and walks with
:func:`flexhub_cifs._subpath.open_sub_path` (``openat(O_NOFOLLOW | O_DIRECTORY)`` per segment,
``mkdirat`` where missing), so a symlink the client sees on the way (an ``mfsymlinks`` file, a
reparse point, a POSIX-extensions symlink) is refused and nothing is made, removed or renamed
outside the share.

* :func:`make`: the claim's directory (and missing parents) made with ``mkdirat``; found
  already (a retried call), nothing else is made. Its owner and mode on the server are the
  server's (the Secret's user; without POSIX extensions a chown or chmod from the client is
  dropped): what pods see is the PV's ``uid``/``gid``/``dir_mode``/``file_mode`` options.
* :func:`remove`: ``shutil.rmtree`` with ``dir_fd`` of the parent: on Linux it walks by
  descriptors (``shutil.rmtree.avoids_symlink_attacks``), never follows a symlink inside the
  tree, and refuses to start if it is not; a missing directory (or parent) is success.
* :func:`archive`: ``renameat`` of the directory to ``archived-<its name>`` beside it; a
  missing directory is success; an existing archive of that name is refused (never replaced).
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from typing import Any

from flexhub.backend import VolumeError
from flexhub.pathpattern import ARCHIVE_PREFIX
from flexhub_cifs._subpath import SubPathMissing, open_sub_path

__all__ = ["PARENT_MODE", "archive", "make", "remove"]

#: Mode of a missing parent directory the pattern names (e.g. ``team`` in ``team/${pvName}``).
PARENT_MODE = 0o755
_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _parent(root: int, path: str, *, create: bool) -> tuple[int, str]:
    """A descriptor of ``path``'s parent (walked safely) and the last segment's name."""
    parent, _, leaf = path.rpartition("/")
    if not parent:
        return os.dup(root), leaf
    return open_sub_path(root, parent, create=create), leaf


def _refused(path: str, info: os.stat_result) -> VolumeError:
    kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a directory"
    return VolumeError(f"{path} is {kind} in the share: refused")


def make(root: int, path: str) -> bool:
    """Make (or find) the directory ``path`` below ``root``.

    :returns: whether this call made it.
    :raises VolumeError: a symlink or non-directory on the way, or it cannot be made.
    """
    parent, leaf = _parent(root, path, create=True)
    try:
        made = True
        try:
            os.mkdir(leaf, PARENT_MODE, dir_fd=parent)
        except FileExistsError:
            made = False
        except OSError as exc:
            raise VolumeError(f"cannot make {path} in the share: {exc.strerror}") from None
        try:
            fd = os.open(leaf, _FLAGS, dir_fd=parent)
        except OSError as exc:
            try:
                info = os.stat(leaf, dir_fd=parent, follow_symlinks=False)
            except OSError:
                info = None
            if info is None or stat.S_ISDIR(info.st_mode):
                raise VolumeError(f"cannot open {path} in the share: {exc.strerror}") from None
            raise _refused(path, info) from None
        os.close(fd)
        return made
    finally:
        os.close(parent)


def _ignore_missing(func: Any, path: str, exc: Any) -> None:
    error = exc[1] if isinstance(exc, tuple) else exc
    if not isinstance(error, FileNotFoundError):  # removed meanwhile: that is the goal
        raise error


def remove(root: int, path: str) -> bool:
    """Remove the directory ``path`` below ``root`` and everything in it.

    :returns: whether there was something to remove (``False``: already gone).
    :raises VolumeError: a symlink on the way to it, or something cannot be removed.
    """
    if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover - not on Linux
        raise VolumeError("this platform's rmtree may follow symlinks: refusing to delete")
    try:
        parent, leaf = _parent(root, path, create=False)
    except SubPathMissing:
        return False
    try:
        try:
            info = os.stat(leaf, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return False
        try:
            if not stat.S_ISDIR(info.st_mode):  # our name, not a directory: only the entry goes
                os.unlink(leaf, dir_fd=parent)
            elif sys.version_info >= (3, 12):
                shutil.rmtree(leaf, dir_fd=parent, onexc=_ignore_missing)
            else:  # pragma: no cover - 3.11
                shutil.rmtree(leaf, dir_fd=parent, onerror=_ignore_missing)
        except OSError as exc:
            raise VolumeError(f"cannot remove {path} from the share: {exc.strerror}") from None
        return True
    finally:
        os.close(parent)


def archive(root: int, path: str) -> str:
    """Rename the directory ``path`` to ``archived-<name>`` beside it.

    :returns: the archive's path, or ``""`` when the directory is already gone.
    :raises VolumeError: a symlink on the way, or the archive's name is taken.
    """
    try:
        parent, leaf = _parent(root, path, create=False)
    except SubPathMissing:
        return ""
    shown = path[: -len(leaf)] + ARCHIVE_PREFIX + leaf
    try:
        try:
            os.stat(leaf, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return ""
        try:
            os.stat(ARCHIVE_PREFIX + leaf, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            raise VolumeError(f"cannot archive {path}: {shown} exists already")
        try:
            os.rename(leaf, ARCHIVE_PREFIX + leaf, src_dir_fd=parent, dst_dir_fd=parent)
        except FileNotFoundError:
            return ""  # archived (or removed) meanwhile by another call: gone is success
        except OSError as exc:
            raise VolumeError(f"cannot archive {path} as {shown}: {exc.strerror}") from None
        return shown
    finally:
        os.close(parent)
