"""The fileio room rule with reflinked snapshots and clones, on a real xfs with
``reflink=1`` (a loop device): every claim the rule admits can be written full beside the
others (no ENOSPC inside a LUN), and a claim that fits is admitted. Blocks a reflink shares
are on the filesystem once; a snapshot is never written, so it promises only what it holds.
The snapshots and clones are made by the remote program's own paths (:mod:`._lio_snap`),
which check the room first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from flexhub_iscsi import _lio_capacity, _lio_room, _lio_snap
from flexhub_iscsi._lio_errors import NoRoomLeft

from tests.iscsi.test_lio_snapshots import xfs  # noqa: F401 (the fixture)
from tests.loopfile.test_room_reflink import write as write_file

MiB = 1 << 20
A = "pvc-0b7f3c1e-5d2a-4e8f-9a61-2c4d8e0f1a3b"
B = "pvc-7c1e9d2a-3b4f-4a5e-8d6c-0f1e2d3c4b5a"
C = "pvc-2d3c4b5a-3b4f-4a5e-8d6c-0f1e7c1e9d2a"
SNAP = "snap-5a0c2b9e-1f3d-5e7a-8b4c-6d2e0f1a3b5c"


def write(directory: Path, name: str, size: int, written: int) -> None:
    """Make (or keep) the LUN file ``size`` bytes and write its first ``written`` bytes."""
    write_file(directory / f"{name}.img", size, written)


def fill_every_lun(directory: Path) -> None:
    """Write every LUN file full, as their tenants may (a reflink's blocks copied on write)."""
    for path in sorted(directory.glob("pvc-*.img")):
        size = path.stat().st_size
        write(directory, path.name.removesuffix(".img"), size, size)


def snapshot_of(directory: Path, name: str) -> None:
    done = _lio_snap.snapshot({"name": name, "directory": str(directory),
                               "file": f"{name}.img", "snapshot": SNAP, "overcommit": 1.0})  # fmt: skip
    assert done["how"] == "reflink"


def clone(directory: Path, source: str, name: str, size: int) -> None:
    _lio_snap.prepare_copy({"name": name, "directory": str(directory), "file": f"{name}.img",
                            "sparse": True, "overcommit": 1.0, "size": size,
                            "source": {"directory": str(directory), "name": source}})  # fmt: skip


def capacity(directory: Path) -> int:
    """What the filesystem can hold for LUN files: free now, plus what they take now."""
    vfs = os.statvfs(directory)
    taken = 0
    for path in directory.glob("*.img"):
        taken += path.stat().st_blocks * 512
    return vfs.f_bavail * vfs.f_frsize + taken


def test_a_reflinked_clone_is_admitted_only_when_every_lun_can_be_written_full(
    xfs: Path,  # noqa: F811
) -> None:
    """A written LUN, its reflinked snapshot, then a reflinked clone: the clone shares blocks
    the filesystem has once, and once both LUNs are written the snapshot's blocks stay. The
    rule must refuse a clone whose writes would run the filesystem out; a smaller one fits."""
    size = capacity(xfs) * 2 // 5 // MiB * MiB  # the LUN and its snapshot: 4/5 of the room
    write(xfs, A, size, size)
    snapshot_of(xfs, A)
    # room left for claims: capacity - (A full + the snapshot's blocks) = 1/5, not A's size
    try:
        clone(xfs, A, B, size)
    except NoRoomLeft:
        admitted = False
    else:  # then its tenants must be able to write it full (the figures say they cannot)
        try:
            fill_every_lun(xfs)
        except OSError as exc:
            pytest.fail(f"the room rule admitted a clone that ran out of space: {exc}")
        admitted = True
    assert not admitted and not (xfs / f"{B}.img").exists()
    left = _lio_capacity.room({"directory": str(xfs), "sparse": True, "overcommit": 1.0})
    assert left["available"] < size
    # a claim as large as the room answered, less a margin for xfs's own metadata, is made
    # and written full beside A (its copy-on-write blocks included): no ENOSPC
    fits = (left["available"] - 8 * MiB) // MiB * MiB
    _lio_room.check_room(str(xfs), f"{C}.img", fits, 1.0, True)
    write(xfs, C, fits, 0)
    fill_every_lun(xfs)  # no ENOSPC


def test_a_snapshot_of_a_sparse_lun_promises_only_what_it_holds(xfs: Path) -> None:  # noqa: F811
    """A LUN barely written and its reflinked snapshot: the snapshot holds (and will ever
    hold) a few MiB, so a claim of most of the rest is admitted, and written full it fits."""
    total = capacity(xfs)
    size = total * 2 // 5 // MiB * MiB
    write(xfs, A, size, 4 * MiB)
    snapshot_of(xfs, A)
    # footprint once every LUN is written: A's size + the snapshot's 4 MiB + the claim
    claim = (total - size - 4 * MiB) * 9 // 10 // MiB * MiB
    assert claim > size  # the old rule (the snapshot promising A's size) left less than that
    room = _lio_capacity.room({"directory": str(xfs), "sparse": True, "overcommit": 1.0})
    assert room["available"] >= claim
    _lio_room.check_room(str(xfs), f"{C}.img", claim, 1.0, True)
    write(xfs, C, claim, 0)
    fill_every_lun(xfs)  # no ENOSPC: the room was there
    assert (xfs / f"{SNAP}.img").stat().st_blocks * 512 <= 5 * MiB


def test_shared_extents_and_their_union(xfs: Path) -> None:  # noqa: F811
    """FIEMAP finds a reflink's shared ranges on both files (the same physical bytes, counted
    once), none on tmpfs-like files with no sharing."""
    write(xfs, A, 8 * MiB, 4 * MiB)
    fd = os.open(xfs / f"{A}.img", os.O_RDONLY)
    try:
        assert _lio_room.shared_extents(fd, 100) == []
    finally:
        os.close(fd)
    snapshot_of(xfs, A)
    found = []
    for name in (A, SNAP):
        fd = os.open(xfs / f"{name}.img", os.O_RDONLY)
        try:
            found.append(_lio_room.shared_extents(fd, 100))
        finally:
            os.close(fd)
    assert found[0] == found[1] and sum(n for _, n in found[0]) == 4 * MiB
    assert _lio_room.union(found[0] + found[1]) == 4 * MiB
    assert _lio_room.union([(0, 10), (5, 10), (20, 1), (20, 1)]) == 16
    fd = os.open(xfs / f"{A}.img", os.O_RDONLY)
    try:
        assert _lio_room.shared_extents(fd, 0) is None  # past the limit
    finally:
        os.close(fd)
    promised, occupied, _ = _lio_room.measure(str(xfs), None)
    assert (promised, occupied) == (8 * MiB + 4 * MiB, 4 * MiB)


@pytest.mark.parametrize("limit", [0, 1])
def test_past_the_shared_extents_bound_the_account_stays_on_the_safe_side(
    xfs: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    limit: int,
) -> None:
    """Too many shared extents to remember: shared blocks count as taken by no file and as
    promised by every snapshot holding them, so the room is never more than the exact one."""
    write(xfs, A, 8 * MiB, 4 * MiB)
    snapshot_of(xfs, A)
    clone(xfs, A, B, 8 * MiB)
    exact = _lio_room.measure(str(xfs), None)
    monkeypatch.setattr(_lio_room, "MAX_SHARED", limit)
    bounded = _lio_room.measure(str(xfs), None)
    assert bounded[0] >= exact[0] and bounded[1] <= exact[1]
    assert bounded[1] - bounded[0] < exact[1] - exact[0]
