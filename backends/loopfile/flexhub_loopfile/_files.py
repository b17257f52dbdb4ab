"""Backing files on disk: made atomically at their size, grown, checked, and the record of the
one an attach made (for the rollback of its failed mount).

A new file is made under a ``.<name>.<random>.flexhub-new`` name in its (existing) directory,
sized (sparse, or fully allocated), synced and then linked into place, so it appears
atomically, already at its size; what a killed creation left is removed by the next one. Sizes
are rounded up to whole 4 KiB blocks.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path

from flexhub.backend import Frozen, InvalidOptions, NoRoom, VolumeError, fsync_directory
from flexhub_loopfile import _room

__all__ = [
    "BLOCK",
    "check_size",
    "create",
    "free_bytes",
    "grow",
    "has_data",
    "make_parents",
    "remove_dirs",
    "remove_leftovers",
    "round_up",
]

LOG = logging.getLogger(__name__)

#: Files are sized in whole 4 KiB blocks (what every filesystem here uses).
BLOCK = 4096
#: Suffix of a file being created (no ``file`` option may end with it).
NEW_SUFFIX = _room.NEW_SUFFIX


def round_up(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def has_data(path: Path) -> bool | None:
    """Whether ``path`` has a data extent (``SEEK_DATA``); ``None`` when it cannot tell.

    Holes and preallocated (unwritten) extents are not data on ext4, xfs, btrfs and tmpfs.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        os.lseek(fd, 0, os.SEEK_DATA)
    except OSError as exc:
        return False if exc.errno == errno.ENXIO else None
    finally:
        os.close(fd)
    return True


def free_bytes(directory: Path) -> int:
    try:
        vfs = os.statvfs(directory)
    except OSError:
        return 0
    return vfs.f_bavail * vfs.f_frsize


class _Created(Frozen):
    """A backing file an attach of this instance created (for ``LoopfileBackend.discard``)."""

    __slots__ = ("identity", "size", "directories")  # noqa: RUF023 - the fields, in order
    identity: tuple[int, int]
    size: int
    directories: tuple[Path, ...]

    def __init__(self, identity: tuple[int, int], size: int, directories: tuple[Path, ...]) -> None:
        self._set(identity=identity, size=size, directories=directories)


def check_size(path: Path, current: int, size: int, *, note: bool = True) -> None:
    """An existing file must be at least ``size`` bytes, as asked (a file flexhub makes is
    rounded up to whole blocks, a given one need not be); a file larger than ``size``
    rounded up is logged if ``note``.

    :raises VolumeError: the file is smaller than option ``size``.
    """
    if current < size:
        have, want = _room.human(current), _room.human(size)
        if have == want:  # e.g. 99,999,999 and 100,000,000 bytes: both 95.4 MiB
            have, want = f"{current} bytes", f"{size} bytes"
        raise VolumeError(
            f"{path} is {have} but option 'size' asks for {want}: refusing to mount it at "
            f"another size (mount it with a 'size' of at most {have}, or none, and expand "
            "its PVC; or name a new file)"
        )
    if current > round_up(size) and note:
        LOG.info(
            "%s is %d bytes, larger than option 'size' (%d): not shrunk, mounted at its size",
            path,
            current,
            size,
        )


def remove_leftovers(path: Path) -> None:
    """Remove what a creation of ``path`` that was killed left (the volume lock is held:
    none is in progress), before its blocks are counted."""
    if not path.parent.is_dir():
        return
    for stale in path.parent.glob(f".{path.name}.*{NEW_SUFFIX}"):
        with contextlib.suppress(OSError):
            stale.unlink()
            LOG.info("removed %s, left by an interrupted creation", stale)


def make_parents(path: Path) -> list[Path]:
    """Create the missing directories above ``path`` (0700).

    :returns: those this call made, deepest first.
    """
    missing: list[Path] = []
    for directory in path.parents:
        if os.path.lexists(directory):
            break
        missing.append(directory)
    made: list[Path] = []
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            continue
        made.insert(0, directory)
    return made


def remove_dirs(made: list[Path]) -> None:
    for directory in made:  # deepest first; only while empty
        try:
            directory.rmdir()
        except OSError:
            break


def create(path: Path, base: Path, size: int, preallocate: bool) -> bool:
    """Make the file at ``size`` in its (existing) directory, inside ``base``; ``False`` if it
    appeared meanwhile."""
    # Re-check now that the directories exist: nothing may have sneaked a symlink in.
    real_parent = path.parent.resolve()
    if real_parent != path.parent or not real_parent.is_relative_to(base):
        raise InvalidOptions(f"option 'file' escapes the loopfile root: {path}")
    # what secrets.token_hex(4) returns, without importing secrets (random, hmac, base64)
    tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}{NEW_SUFFIX}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        try:
            if preallocate:
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            LOG.info("%s appeared while being created; using it", path)
            return False
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoRoom(
                f"not enough room on the node for {path}: need {_room.human(size)}, "
                f"{_room.human(free_bytes(path.parent))} free"
            ) from None
        raise VolumeError(f"cannot create {path}: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_directory(path.parent)
    LOG.info("created %s: %d bytes, %s", path, size, "preallocated" if preallocate else "sparse")
    return True


def grow(path: Path, current: int, target: int, preallocate: bool) -> None:
    """Grow ``path`` from ``current`` to ``target`` bytes; on failure it is cut back.

    :raises NoRoom: the node's disk is full (or the quota reached).
    """
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            if preallocate:
                os.posix_fallocate(fd, current, target - current)
            else:
                os.ftruncate(fd, target)
            os.fsync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, current)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoRoom(
                    f"not enough room on the node to grow {path}: need "
                    f"{_room.human(target - current)} more, "
                    f"{_room.human(free_bytes(path.parent))} free"
                ) from None
            raise VolumeError(f"cannot grow {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
