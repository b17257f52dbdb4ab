"""Data safety with real loop devices: unknown data is never formatted, a read-only staging
mount is checked before it turns read-write, fsGroup survives a crash (issue 10)."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest
from conftest import Rig

from flexhub.errors import CommandError, VolumeError
from flexhub.node.fs import format_and_mount
from flexhub.node.mounts import MountTable
from flexhub.node.runner import SubprocessRunner
from flexhub.node.volumes import mount_volume, staging_dir, unmount_volume

pytestmark = pytest.mark.root

MiB = 1 << 20


def _mount(rig: Rig, target: Path, **kw: object) -> None:
    mount_volume(rig.node, rig.backend, target, rig.volume(**kw))  # type: ignore[arg-type]


def _unmount(rig: Rig, target: Path) -> None:
    unmount_volume(rig.node, target, lambda name: rig.backend)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tar(path: Path, tmp: Path) -> None:
    payload = tmp / "payload.txt"
    payload.write_text("precious rows\n" * 1000)
    with tarfile.open(path, "w") as archive:
        archive.add(payload, arcname="payload.txt")
    with open(path, "r+b") as handle:
        handle.truncate(64 * MiB)


def _random(path: Path, tmp: Path) -> None:
    with open(path, "wb") as handle:
        handle.truncate(64 * MiB)
        handle.seek(32 * MiB)  # data only in the middle: first and last MiB are zeros
        handle.write(os.urandom(MiB))
        handle.seek(0)
        handle.write(os.urandom(4096))


def _qcow2(path: Path, tmp: Path) -> None:
    # a qcow2 v3 header: magic, version, then zeros (blkid knows no qcow2 signature)
    header = b"QFI\xfb" + (3).to_bytes(4, "big") + bytes(8) + (16).to_bytes(4, "big")
    with open(path, "wb") as handle:
        handle.write(header)
        handle.truncate(64 * MiB)


def _tail_only(path: Path, tmp: Path) -> None:
    with open(path, "wb") as handle:
        handle.truncate(64 * MiB)
        handle.seek(64 * MiB - 512)
        handle.write(b"\x01" * 512)  # e.g. a trailing metadata block


@pytest.mark.parametrize("make", [_tar, _random, _qcow2, _tail_only])
def test_unidentified_data_is_never_formatted(rig: Rig, tmp_path: Path, make) -> None:  # type: ignore[no-untyped-def]
    file = rig.base / "data.img"
    rig.files.append(file)
    make(file, tmp_path)
    if make is not _random:  # random bytes may by chance look like something; the rest not
        assert subprocess.run(["blkid", "-p", str(file)], check=False).returncode == 2
    before = _sha(file)
    target = rig.pod("a")
    with pytest.raises(VolumeError, match="holds data flexhub cannot identify"):
        _mount(rig, target, file=file, fs_type="ext4")
    assert _sha(file) == before
    rig.assert_clean()


def test_blank_file_is_formatted(rig: Rig) -> None:
    file = rig.file(size=320 * MiB)
    target = rig.pod("a")
    _mount(rig, target, file=file, fs_type="xfs")
    (target / "x").write_text("y")
    _unmount(rig, target)
    rig.assert_clean()


def test_unreadable_devices_are_errors_not_blank(rig: Rig, tmp_path: Path) -> None:
    real = SubprocessRunner(timeout=30)
    ran: list[str] = []

    def runner(argv, **kw):  # type: ignore[no-untyped-def]
        ran.append(argv[0])
        return real(argv, **kw)

    where = tmp_path / "mnt"
    where.mkdir()
    # a block device node no driver answers (major 240: "local/experimental use")
    orphan = tmp_path / "orphan"
    os.mknod(orphan, 0o600 | stat.S_IFBLK, os.makedev(240, 77))
    assert subprocess.run(["blkid", "-p", str(orphan)], check=False).returncode == 2
    # an unbound loop device: blkid says "nothing found", it reads as empty
    free = subprocess.run(["losetup", "-f"], capture_output=True, text=True, check=True)
    unbound = free.stdout.strip()
    for device in (str(orphan), unbound, str(tmp_path / "missing")):
        with pytest.raises(CommandError):
            format_and_mount(runner, device, where, "ext4", False)
    assert "blkid" in ran and not [name for name in ran if name.startswith("mkfs")]
    assert not MountTable().is_mount_point(where)


def _ext4_with_error_flag(rig: Rig, text: str) -> Path:
    file = rig.file(size=64 * MiB)
    subprocess.run(["mkfs.ext4", "-F", "-q", str(file)], check=True)
    where = rig.base / "pre"
    where.mkdir()
    subprocess.run(["mount", "-o", "loop", str(file), str(where)], check=True)
    (where / "data").write_text(text)
    subprocess.run(["umount", str(where)], check=True)
    # mark the filesystem as having errors: fsck must run before a read-write mount
    subprocess.run(
        ["debugfs", "-w", "-R", "ssv state 2", str(file)], check=True, capture_output=True
    )
    return file


def _state(file: Path) -> str:
    out = subprocess.run(["dumpe2fs", "-h", str(file)], capture_output=True, text=True).stdout
    return next(line for line in out.splitlines() if line.startswith("Filesystem state:"))


def test_read_only_staging_is_checked_before_it_turns_read_write(rig: Rig) -> None:
    file = _ext4_with_error_flag(rig, "kept")
    assert "error" in _state(file)
    reader, writer = rig.pod("reader"), rig.pod("writer")
    staging = staging_dir(rig.node, rig.backend.volume_id(rig.volume(file)))
    _mount(rig, reader, file=file, read_only=True)
    assert MountTable().at(staging).read_only
    # a read-write pod while a read-only one uses the unchecked mount: refused, nothing changed
    with pytest.raises(VolumeError, match="read-only"):
        _mount(rig, writer, file=file)
    table = MountTable()
    assert table.at(staging).read_only and table.at(reader).read_only
    assert not table.is_mount_point(writer)
    assert (reader / "data").read_text() == "kept"
    _unmount(rig, reader)
    # now alone: unmounted, fsck'd, mounted read-write
    _mount(rig, writer, file=file)
    assert "error" not in _state(file)
    assert (writer / "data").read_text() == "kept"
    (writer / "more").write_text("new")
    _mount(rig, reader, file=file, read_only=True)  # a reader may join a read-write volume
    table = MountTable()
    assert not table.at(staging).read_only and not table.at(writer).read_only
    assert table.at(reader).read_only and (reader / "more").read_text() == "new"
    _unmount(rig, reader)
    _unmount(rig, writer)
    rig.assert_clean()


def test_leftover_read_only_staging_is_checked_before_read_write(rig: Rig) -> None:
    """A read-only staging mount nobody uses (a crash) is unmounted, fsck'd, mounted rw."""
    file = _ext4_with_error_flag(rig, "kept")
    reader, writer = rig.pod("reader"), rig.pod("writer")
    staging = staging_dir(rig.node, rig.backend.volume_id(rig.volume(file)))
    _mount(rig, reader, file=file, read_only=True)
    subprocess.run(["umount", str(reader)], check=True)  # the reader vanished, mount stays
    _mount(rig, writer, file=file)
    assert "error" not in _state(file)
    assert not MountTable().at(staging).read_only
    assert (writer / "data").read_text() == "kept"
    _unmount(rig, writer)
    _unmount(rig, reader)
    rig.assert_clean()


def test_fs_group_survives_a_crash_right_after_the_bind(rig: Rig) -> None:
    file = rig.file()
    target = rig.pod("a")
    crashed = rig.drive(
        "mount", target, file, env={"FLEXHUB_TEST_CRASH_AT": "bound"}, fs_group=4321
    )
    assert crashed.returncode == -9, crashed
    # kubelet's retry: the directory is a mount point now, so kubelet skips the driver (its
    # flexvolume mounter checks IsLikelyNotMountPoint first) and starts the pod as it is
    assert MountTable().is_mount_point(target)
    info = target.stat()
    assert info.st_gid == 4321, oct(info.st_mode)
    assert info.st_mode & stat.S_ISGID and (info.st_mode & 0o070) == 0o070
    assert rig.drive("unmount", target).returncode == 0
    rig.assert_clean()
