"""The loopfile root's room with reflinked snapshots and clones, on a real xfs with
``reflink=1`` and 4096-byte sectors (where loopfile reflinks: ``_snapshot.reflink_safe``): a
volume file the rule admits can be written full beside the others (no ENOSPC inside a
volume), and one that fits is admitted. The files are made as loopfile's copies make them
(``FICLONE``), at their places under the root."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
from flexhub_loopfile import _room

from flexhub.backend import NoRoom
from tests.conftest import needs_root
from tests.iscsi.test_lio_snapshots import xfs  # noqa: F401 (the fixture: a reflink xfs)

pytestmark = [needs_root, pytest.mark.root]

MiB = 1 << 20
FICLONE = 0x40049409


def write(path: Path, size: int, written: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        block = os.urandom(MiB)
        for offset in range(0, written, MiB):
            os.pwrite(fd, block, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def reflink(source: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    src = os.open(source, os.O_RDONLY)
    dst = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.ioctl(dst, FICLONE, src)
        os.fsync(dst)
    finally:
        os.close(dst)
        os.close(src)


def capacity(root: Path) -> int:
    vfs = os.statvfs(root)
    taken = sum(p.stat().st_blocks * 512 for p in root.rglob("*.img"))
    return vfs.f_bavail * vfs.f_frsize + taken


def fill_volumes(root: Path) -> None:
    for path in sorted((root / "namespaces").rglob("*.img")):
        size = path.stat().st_size
        write(path, size, size)


def test_a_reflinked_clone_is_admitted_only_when_every_volume_can_be_written_full(
    xfs: Path,  # noqa: F811
) -> None:
    root = xfs
    size = capacity(root) * 2 // 5 // MiB * MiB
    a = root / "namespaces" / "default" / "a.img"
    write(a, size, size)
    reflink(a, root / "snapshots" / "default" / "snap-5a0c2b9e-1f3d-5e7a-8b4c-6d2e0f1a3b5c.img")
    b = root / "namespaces" / "default" / "b.img"
    try:
        _room.check(root, b, size, ratio=1.0, preallocate=False)
    except NoRoom:
        admitted = False
    else:  # then it must be writable full beside the others (the figures say it is not)
        reflink(a, b)
        try:
            fill_volumes(root)
        except OSError as exc:
            pytest.fail(f"the room rule admitted a clone that ran out of space: {exc}")
        admitted = True
    assert not admitted


def test_a_snapshot_of_a_sparse_volume_promises_only_what_it_holds(
    xfs: Path,  # noqa: F811
) -> None:
    root = xfs
    total = capacity(root)
    size = total * 2 // 5 // MiB * MiB
    a = root / "namespaces" / "default" / "a.img"
    write(a, size, 4 * MiB)
    reflink(a, root / "snapshots" / "default" / "snap-5a0c2b9e-1f3d-5e7a-8b4c-6d2e0f1a3b5c.img")
    claim = (total - size - 4 * MiB) * 9 // 10 // MiB * MiB
    assert claim > size  # a snapshot promising its apparent size left less than that
    c = root / "namespaces" / "default" / "c.img"
    _room.check(root, c, claim, ratio=1.0, preallocate=False)
    write(c, claim, 0)
    fill_volumes(root)  # no ENOSPC: the room was there
    room = _room.measure(root, root)
    assert room.occupied <= size + claim + 5 * MiB  # the shared 4 MiB counted once
