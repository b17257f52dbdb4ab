"""Part of the remote program (:mod:`flexhub_iscsi._lio_remote`): what the fileio LUN files of
a ``fileioDirectory`` promise, against what its filesystem can hold.

A sparse LUN file promises its apparent size but holds only the blocks written so far, so
claims checked one by one against the free space could together promise more than the
filesystem has, and a tenant writing theirs full would fail another's writes. The rule (the
loopfile backend's) is per directory, over every LUN file the provisioner made there::

    promised (after the change)  <=  (available + occupied) x overcommit

* ``promised``: the apparent sizes (``st_size``) of the LUN files, with the new file's size
  added (for a growth, or a file already there, its new size instead of its current one);
* ``occupied``: the bytes those files already take (``st_blocks`` x 512, at most their size);
* ``available``: what the filesystem has left (``statvfs``: ``f_bavail`` x ``f_frsize``);
* ``overcommit``: the class's parameter (a number >= 1, default 1: every promise can be kept).

A preallocated (``sparse: "false"``) file or growth must besides fit in ``available`` now.
Counted: the regular files named ``pvc-<uid>.img`` or ``snap-<uid>.img`` (the provisioner's
names: LUNs and snapshots) directly in the directory, owned by root, on its filesystem, each
inode once; nothing is opened or followed.

Standard library only: this text runs on the target host (python3 3.7 or later).
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any

if __name__ != "__main__":  # imported on the host; sent, the parts' texts come before this
    from flexhub_iscsi._lio_errors import NoRoomLeft

#: The files the provisioner makes: ``pvc-<claim uid>.img`` (LUNs), ``snap-<uid>.img``
#: (snapshots).
LUN_FILE = re.compile(
    r"(pvc|snap)-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\.img"
)


def human(size: int) -> str:
    """``size`` bytes in binary units: ``200.0 MiB``, ``1.50 GiB`` (MiB at least)."""
    units = ("MiB", "GiB", "TiB", "PiB", "EiB")
    value = size / (1 << 20)
    unit = 0
    while value >= 1024 and unit < len(units) - 1:
        value /= 1024
        unit += 1
    return f"{value:.1f} {units[unit]}" if unit == 0 else f"{value:.2f} {units[unit]}"


def measure(directory: str, skip: Any) -> tuple[int, int, int]:
    """(promised, occupied, available) of the LUN files in ``directory``; the file whose
    ``(st_dev, st_ino)`` is ``skip`` promises nothing (its new size is the caller's)."""
    vfs = os.statvfs(directory)
    device = os.stat(directory).st_dev
    promised = occupied = 0
    seen = set()
    with os.scandir(directory) as entries:
        for entry in entries:
            if LUN_FILE.fullmatch(entry.name) is None:
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
            if (st.st_dev, st.st_ino) != skip:
                promised += st.st_size
            occupied += min(st.st_blocks * 512, st.st_size)
    return promised, occupied, vfs.f_bavail * vfs.f_frsize


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
