"""The byte ranges a file shares with other files (reflinks), for room accounts that must count
a shared block once (loopfile's :mod:`flexhub_loopfile._room`; the iSCSI target host's
``_lio_room`` carries its own copy, as its text runs there with the standard library alone).

``FIEMAP`` (``FS_IOC_FIEMAP``) maps a file's extents; ``FIEMAP_EXTENT_SHARED`` marks those
another file shares (xfs with ``reflink=1``, btrfs). A filesystem that cannot share blocks,
or cannot answer ``FIEMAP`` (tmpfs), has none.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from collections.abc import Iterable

__all__ = ["shared_extents", "shared_of", "union"]

FIEMAP = 0xC020660B
FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_SHARED = 0x2000
#: Extents asked per ``FIEMAP`` call.
BATCH = 256
_HEAD = struct.Struct("=QQIIII")  # struct fiemap
_EXTENT = struct.Struct("=QQQ16xI12x")  # struct fiemap_extent: logical, physical, length, flags
_NO_FIEMAP = (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.ENOSYS)


#: The extents of one file read before its sharing counts as unknown (``None``): this many
#: times the shared extents still remembered, plus :data:`FIRST_WALK`. A tenant can fragment
#: its sparse volume's file without end (every other block written); a scan runs under the
#: room lock, so it never reads such a file to its end.
WALK_FACTOR = 4
FIRST_WALK = 65536


def shared_extents(fd: int, limit: int) -> list[tuple[int, int]] | None:
    """The ``(physical, length)`` byte ranges of the file ``fd`` that it shares with another
    file, at most ``limit`` (``None`` past it)."""
    found: list[tuple[int, int]] = []
    start = walked = 0
    while True:
        request = bytearray(_HEAD.size + BATCH * _EXTENT.size)
        _HEAD.pack_into(request, 0, start, 0xFFFFFFFFFFFFFFFF - start, 0, 0, BATCH, 0)
        try:
            fcntl.ioctl(fd, FIEMAP, request)
        except OSError as exc:
            if exc.errno in _NO_FIEMAP:
                return []
            raise
        mapped = _HEAD.unpack_from(request, 0)[3]
        if mapped == 0:
            return found
        walked += mapped
        if walked > WALK_FACTOR * max(limit, 1) + FIRST_WALK:
            return None  # a file this fragmented is not walked to its end: sharing unknown
        for index in range(mapped):
            logical, physical, length, flags = _EXTENT.unpack_from(
                request, _HEAD.size + index * _EXTENT.size
            )
            if flags & FIEMAP_EXTENT_SHARED:
                if len(found) >= limit:
                    return None
                found.append((physical, length))
            if flags & FIEMAP_EXTENT_LAST:
                return found
            start = logical + length


def shared_of(path: str, st: os.stat_result, limit: int) -> list[tuple[int, int]] | None:
    """:func:`shared_extents` of the file at ``path`` (the inode of ``st``), opened read only
    without following a symlink; ``[]`` when it is gone or another inode meanwhile, ``None``
    (unknown) when ``FIEMAP`` fails: never an error that would drop files from the account."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return []
        return shared_extents(fd, limit)
    except OSError:  # FIEMAP failed (EIO...): sharing unknown, the account's safe side
        return None
    finally:
        os.close(fd)


def union(ranges: Iterable[tuple[int, int]]) -> int:
    """The bytes the ``(start, length)`` ranges cover, each byte once."""
    total = 0
    end = -1
    for start, length in sorted(ranges):
        if start + length <= end:
            continue
        total += start + length - max(start, end)
        end = start + length
    return total
