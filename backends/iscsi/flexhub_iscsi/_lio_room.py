"""Part of the remote program (:mod:`flexhub_iscsi._lio_remote`): what the fileio LUN files of
a ``fileioDirectory`` promise, against what its filesystem can hold.

A sparse LUN file promises its apparent size but holds only the blocks written so far, so
claims checked one by one against the free space could together promise more than the
filesystem has, and a tenant writing theirs full would fail another's writes. The rule (the
loopfile backend's) is per directory, over every LUN file the provisioner made there::

    promised (after the change)  <=  (available + occupied) x overcommit

* ``promised``: the apparent sizes (``st_size``) of the LUN files, with the new file's size
  added (for a growth, or a file already there, its new size instead of its current one),
  plus the blocks the snapshot files hold (a snapshot is never written: it promises no more
  than it holds);
* ``occupied``: the blocks those files take on the filesystem (``st_blocks`` x 512, at most
  their size), a block shared by several (a reflink) counted once;
* ``available``: what the filesystem has left (``statvfs``: ``f_bavail`` x ``f_frsize``);
* ``overcommit``: the class's parameter (a number >= 1, default 1: every promise can be kept).

Why: with every LUN file written full, each holds its size in blocks of its own (a block it
shares with a reflinked snapshot or clone is copied on its first write), and the snapshots
keep the blocks they hold; so the filesystem must hold ``promised`` in all, and it can hold
``available`` plus what the files take now, each block once. Counting a reflink's shared
blocks once per file (``st_blocks``) counted blocks the filesystem does not have: a clone
made the rule admit claims that, written full, ran the filesystem out of space (ENOSPC inside
the tenants' LUNs); and a snapshot promising its apparent size refused claims while there was
room (its holes are never written). Shared blocks are found with ``FIEMAP``
(``FIEMAP_EXTENT_SHARED``: xfs, btrfs); where the filesystem cannot share blocks (or answer
``FIEMAP``) none are.

A preallocated (``sparse: "false"``) file or growth must besides fit in ``available`` now.
Counted: the regular files named ``pvc-<uid>.img`` or ``snap-<uid>.img`` (the provisioner's
names: LUNs and snapshots) directly in the directory, owned by root, on its filesystem, each
inode once; none is followed (opened ``O_NOFOLLOW``, read only, for ``FIEMAP`` alone).

Standard library only: this text runs on the target host (python3 3.7 or later).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import struct
from typing import Any

if __name__ != "__main__":  # imported on the host; sent, the parts' texts come before this
    from flexhub_iscsi._lio_errors import NoRoomLeft

#: The files the provisioner makes: ``pvc-<claim uid>.img`` (LUNs), ``snap-<uid>.img``
#: (snapshots).
LUN_FILE = re.compile(
    r"(pvc|snap)-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\.img"
)
#: ``FS_IOC_FIEMAP`` and its flags: the extent is the last; shared with another file.
FIEMAP = 0xC020660B
FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_SHARED = 0x2000
#: Extents asked per ``FIEMAP`` call, and shared extents remembered in all (past that, the
#: account stays on the safe side: see :func:`measure`).
FIEMAP_BATCH = 256
MAX_SHARED = 100_000
_HEAD = struct.Struct("=QQIIII")  # struct fiemap
_EXTENT = struct.Struct("=QQQ16xI12x")  # struct fiemap_extent: logical, physical, length, flags


def human(size: int) -> str:
    """``size`` bytes in binary units: ``200.0 MiB``, ``1.50 GiB`` (MiB at least)."""
    units = ("MiB", "GiB", "TiB", "PiB", "EiB")
    value = size / (1 << 20)
    unit = 0
    while value >= 1024 and unit < len(units) - 1:
        value /= 1024
        unit += 1
    return f"{value:.1f} {units[unit]}" if unit == 0 else f"{value:.2f} {units[unit]}"


#: The extents of one file read before its sharing counts as unknown (``None``): this many
#: times the shared extents still remembered, plus :data:`FIRST_WALK`. A tenant can fragment
#: its sparse volume's file without end (every other block written); a scan runs under the
#: room lock, so it never reads such a file to its end.
WALK_FACTOR = 4
FIRST_WALK = 65536


def shared_extents(fd: int, limit: int) -> Any:
    """The ``(physical, length)`` byte ranges of the file ``fd`` that it shares with another
    file (a reflink), at most ``limit`` (``None`` past it); none where the filesystem cannot
    answer ``FIEMAP``."""
    found: list[Any] = []
    start = walked = 0
    while True:
        request = bytearray(_HEAD.size + FIEMAP_BATCH * _EXTENT.size)
        _HEAD.pack_into(request, 0, start, 0xFFFFFFFFFFFFFFFF - start, 0, 0, FIEMAP_BATCH, 0)
        try:
            fcntl.ioctl(fd, FIEMAP, request)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.ENOSYS):
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


def union(ranges: Any) -> int:
    """The bytes the ``(start, length)`` ranges cover, each byte once."""
    total = 0
    end = -1
    for start, length in sorted(ranges):
        if start + length <= end:
            continue
        total += start + length - max(start, end)
        end = start + length
    return total


def measure(directory: str, skip: Any) -> tuple[int, int, int]:
    """(promised, occupied, available) of the LUN files in ``directory`` (see the module); the
    file whose ``(st_dev, st_ino)`` is ``skip`` promises nothing (its new size is the
    caller's). Past :data:`MAX_SHARED` shared extents, shared blocks are counted as taken by
    no file and as promised by every snapshot that holds them (never more room than there
    is)."""
    vfs = os.statvfs(directory)
    device = os.stat(directory).st_dev
    promised = exclusive = 0
    seen = set()
    shared: list[Any] = []  # (physical, length, snapshot?)
    overflow = False
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                match = LUN_FILE.fullmatch(entry.name)
                if match is None:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # gone meanwhile
                if (
                    not stat.S_ISREG(st.st_mode)
                    or st.st_uid != 0
                    or st.st_dev != device
                    or st.st_ino in seen
                ):
                    continue
                seen.add(st.st_ino)
                snapshot = match.group(1) == "snap"
                held = min(st.st_blocks * 512, st.st_size)
                ranges: Any = []
                if held and not overflow:
                    ranges = _shared_of(dfd, entry.name, st, MAX_SHARED - len(shared))
                    overflow = ranges is None
                if overflow:  # its sharing unknown: as if all of its blocks were shared
                    ranges, mine = [], held
                else:
                    mine = min(held, sum(length for _, length in ranges))
                exclusive += held - mine
                shared.extend((p, n, snapshot) for p, n in ranges)
                if snapshot:
                    promised += held - mine + (mine if overflow else 0)
                elif (st.st_dev, st.st_ino) != skip:
                    promised += st.st_size
    finally:
        os.close(dfd)
    if overflow:  # safe side: shared blocks take nothing, every snapshot's are promised
        occupied = exclusive
        promised += sum(n for _, n, snap in shared if snap)
    else:
        occupied = exclusive + union((p, n) for p, n, _ in shared)
        promised += union((p, n) for p, n, snap in shared if snap)
    return promised, occupied, vfs.f_bavail * vfs.f_frsize


def _shared_of(dfd: int, name: str, st: Any, limit: int) -> Any:
    """:func:`shared_extents` of the file ``name`` (the inode of ``st``), opened without
    following a symlink; ``[]`` when it is gone or another inode meanwhile."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return []
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return []
        return shared_extents(fd, limit)
    finally:
        os.close(fd)


def check_room(directory: str, file: str, size: int, ratio: float, sparse: bool) -> None:
    """Refuse to make ``directory/file`` (new, or there and growing) ``size`` bytes when the
    LUN files would then promise more than the filesystem can hold times ``ratio``.

    :raises NoRoomLeft: one line with the figures in binary units.
    """
    path = os.path.join(directory, file)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        current, skip = 0, None
    else:
        current, skip = st.st_size, (st.st_dev, st.st_ino)
    if size <= current:
        return  # nothing more is promised
    promised, occupied, available = measure(directory, skip)
    promised += size
    if skip is None:
        what = f"{path} ({human(size)})"
    else:
        what = f"{path} to grow from {human(current)} to {human(size)}"
    if not sparse and size - current > available:
        raise NoRoomLeft(
            f"not enough room for {what}: allocating {human(size - current)} needs that "
            f"much free, and the filesystem of {directory} has {human(available)} free"
        )
    capacity = available + occupied
    allowed = int(capacity * ratio)
    if promised > allowed:
        raise NoRoomLeft(
            f"not enough room for {what}: the LUN files of {directory} would promise "
            f"{human(promised)}, and its filesystem can hold {human(capacity)} "
            f"({human(available)} free + {human(occupied)} in those files) "
            f"x overcommit {ratio:g} = {human(allowed)}"
        )
