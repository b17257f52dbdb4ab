"""What the files under the loopfile root promise, against what its filesystem can hold.

A sparse file promises its apparent size but holds only the blocks written so far, so a check
of one new file against the free space lets the files together promise more than the
filesystem has: tenants filling theirs then break another tenant's writes inside its own
volume. The rule is therefore per filesystem, over every file under the root::

    promised (after the change)  <=  (available + occupied) x overcommit

* ``promised``: the sum of the apparent sizes (``st_size``) of the files counted, with the
  new file's size added (or, for a growth, the file's new size instead of its current one),
  except that a snapshot (``<root>/snapshots/<namespace>/``), never written, promises the
  blocks it holds;
* ``occupied``: the bytes those files already occupy (``st_blocks`` x 512), a block shared by
  several (a reflinked snapshot or clone) counted once (:mod:`flexhub.extents`: ``FIEMAP``);
* ``available``: what the filesystem has left for them (``statvfs``: ``f_bavail`` x
  ``f_frsize``).

``available + occupied`` is what the filesystem could hold for the loopfiles if they were all
written full; with ``overcommit = 1`` every promise can be kept. A preallocated file (or
growth) must besides fit in ``available`` now, since its blocks are taken at once.

Counted: regular files owned by root (flexhub's own files are root's, 0600) on the
filesystem of the new file, each inode once, found with ``scandir`` without following any
symlink, at most :data:`MAX_DEPTH` directories below the root (deeper than any ``file``
option can reach) and over at most :data:`MAX_ENTRIES` entries (more is refused: the scan
runs on every mount that creates or grows a file). Only regular files are opened (read only,
``O_NOFOLLOW | O_NONBLOCK``, for ``FIEMAP`` alone, the inode checked), so a FIFO or a device
node in the tree cannot block the scan. Once every file is written full, each holds its size
in blocks of its own (a shared block is copied on its first write) and the snapshots keep
theirs: counted per file, a reflink's blocks were counted twice, as room the filesystem does
not have. A file of another user is not counted: the blocks it
really takes are missing from ``available`` anyway, and its size cannot make every mount
on the node fail.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from flexhub.backend import Frozen, NoRoom, VolumeError

__all__ = ["MAX_DEPTH", "MAX_ENTRIES", "NEW_SUFFIX", "Room", "check", "human", "measure"]

#: Directory levels scanned below the root: ``namespaces/<namespace>/`` and the at most 128
#: segments of a 255-character ``file`` option.
MAX_DEPTH = 2 + 128
#: Directory entries scanned at most before refusing.
MAX_ENTRIES = 100_000
#: Shared extents remembered in all (past that, the account stays on the safe side).
MAX_SHARED = 100_000
#: The directory of the snapshots (``<root>/snapshots/<namespace>/snap-<uid>.img``; as
#: :data:`flexhub_loopfile._tenancy.SNAPSHOTS`).
SNAPSHOTS = "snapshots"
#: Suffix of a file being created (``.<name>.<random>.flexhub-new``). Creations hold the lock
#: on the account, so one that the scan meets is the leftover of a killed call: it promises
#: nothing (its blocks, if any, are simply not free).
NEW_SUFFIX = ".flexhub-new"

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human(size: int) -> str:
    """``size`` bytes in binary units: ``200.0 MiB``, ``1.50 GiB`` (MiB at least)."""
    value = size / (1 << 20)
    unit = 1
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{value:.1f} {_UNITS[unit]}" if unit == 1 else f"{value:.2f} {_UNITS[unit]}"


class Room(Frozen):
    """One filesystem's loopfile account (bytes)."""

    __slots__ = ("promised", "occupied", "available")  # noqa: RUF023 - the fields, in order
    promised: int
    occupied: int
    available: int

    def __init__(self, promised: int, occupied: int, available: int) -> None:
        self._set(promised=promised, occupied=occupied, available=available)

    @property
    def capacity(self) -> int:
        """What the filesystem could hold for the files counted."""
        return self.available + self.occupied


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path("/")  # pragma: no cover - "/" always exists


def measure(root: Path, where: Path, exclude: tuple[int, int] | None = None) -> Room:
    """Count the files under ``root`` on the filesystem that holds (or will hold) ``where``,
    the size of the file ``exclude`` (``(st_dev, st_ino)``: the one about to grow) left out of
    ``promised`` (its blocks stay in ``occupied``).

    :raises VolumeError: the tree has more than :data:`MAX_ENTRIES` entries, or the
        filesystem cannot be read.
    """
    anchor = _nearest_existing(where)
    try:
        device = os.stat(anchor).st_dev
        vfs = os.statvfs(anchor)
    except OSError as exc:
        raise VolumeError(
            f"cannot measure the loopfile root's filesystem: {exc.strerror}"
        ) from None
    from flexhub_loopfile._extents import shared_of, union

    promised = exclusive = entries = 0
    seen: set[int] = set()
    shared: list[tuple[int, int, bool]] = []  # (physical, length, in a snapshot?)
    overflow = False
    snapshots = root / SNAPSHOTS
    stack = [(root, 0)] if os.path.isdir(root) and not os.path.islink(root) else []
    while stack:
        directory, depth = stack.pop()
        snapshot = directory.parent == snapshots  # <root>/snapshots/<namespace>/
        try:
            with os.scandir(directory) as listing:
                for entry in listing:
                    entries += 1
                    if entries > MAX_ENTRIES:
                        raise VolumeError(
                            f"the loopfile root {root} holds more than {MAX_ENTRIES} entries: "
                            "refusing to account for it (clean it up)"
                        )
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue  # gone meanwhile
                    if stat.S_ISDIR(st.st_mode):
                        if depth < MAX_DEPTH:
                            stack.append((Path(entry.path), depth + 1))
                    elif (
                        stat.S_ISREG(st.st_mode)
                        and st.st_uid == 0
                        and st.st_dev == device
                        and st.st_ino not in seen
                        and not entry.name.endswith(NEW_SUFFIX)
                    ):
                        seen.add(st.st_ino)
                        # blocks past the end (xfs preallocates ahead) hold nothing promised
                        held = min(st.st_blocks * 512, st.st_size)
                        ranges: list[tuple[int, int]] | None = []
                        if held and not overflow:
                            ranges = shared_of(entry.path, st, MAX_SHARED - len(shared))
                            overflow = ranges is None
                        if overflow or ranges is None:  # sharing unknown: all of it shared
                            ranges, mine = [], held
                        else:
                            mine = min(held, sum(length for _, length in ranges))
                        exclusive += held - mine
                        shared.extend((p, n, snapshot) for p, n in ranges)
                        if snapshot:  # never written: it promises what it holds
                            promised += held - mine + (mine if overflow else 0)
                        elif (st.st_dev, st.st_ino) != exclude:
                            promised += st.st_size
        except OSError:
            continue  # a directory gone (or unreadable) meanwhile
    if overflow:  # safe side: shared blocks take nothing, every snapshot's are promised
        occupied = exclusive
        promised += sum(n for _, n, snap in shared if snap)
    else:
        occupied = exclusive + union((p, n) for p, n, _ in shared)
        promised += union((p, n) for p, n, snap in shared if snap)
    return Room(promised, occupied, vfs.f_bavail * vfs.f_frsize)


def check(root: Path, path: Path, target: int, *, ratio: float, preallocate: bool) -> None:
    """Refuse to make ``path`` (new, or existing and growing) ``target`` bytes when the files
    under ``root`` would then promise more than its filesystem can hold times ``ratio``.

    :raises NoRoom: one line with the numbers in binary units (a :class:`VolumeError`: the
        FlexVolume reply is ``Failure``; CSI's is ``RESOURCE_EXHAUSTED``).
    :raises VolumeError: the root cannot be measured.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        current, exclude = 0, None
    except OSError as exc:
        raise VolumeError(f"cannot read {path}: {exc.strerror}") from None
    else:
        current, exclude = st.st_size, (st.st_dev, st.st_ino)
    room = measure(root, path, exclude)
    promised = room.promised + target
    if exclude is None:
        what = f"{path} ({human(target)})"
    else:
        what = f"{path} to grow from {human(current)} to {human(target)}"
    if preallocate and target - current > room.available:
        raise NoRoom(
            f"not enough room for {what}: preallocating {human(target - current)} needs that "
            f"much free, and the loopfile root's filesystem has {human(room.available)} free"
        )
    allowed = int(room.capacity * ratio)
    if promised > allowed:
        raise NoRoom(
            f"not enough room for {what}: the loopfile root's files would promise "
            f"{human(promised)}, and its filesystem can hold {human(room.capacity)} "
            f"({human(room.available)} free + {human(room.occupied)} in those files) "
            f"x overcommit {ratio:g} = {human(allowed)}"
        )
