"""SafeFormatAndMount on real loop devices: what ends up on the device and in the mount table.

These replace argv transcripts (tests/node/test_node_fs.py keeps only what has no real system
here: fsck's exit codes 4 and 8, which need a filesystem fsck cannot repair, and the growth
arithmetic on scripted sizes).
"""

from __future__ import annotations

import re
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from flexhub.errors import VolumeError
from flexhub.node.fs import format_and_mount
from flexhub.node.mounts import MountTable
from flexhub.node.runner import SubprocessRunner
from tests.conftest import needs_root

pytestmark = [needs_root, pytest.mark.root]

RUNNER = SubprocessRunner(timeout=120)


def blkid(device: str, tag: str) -> str:
    return subprocess.run(
        ["blkid", "-p", "-s", tag, "-o", "value", device], capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def device(tmp_path: Path) -> Iterator[str]:
    image = tmp_path / "disk.img"
    with open(image, "wb") as f:
        f.truncate(320 << 20)
    dev = subprocess.run(
        ["losetup", "--find", "--show", str(image)], capture_output=True, text=True, check=True
    ).stdout.strip()
    yield dev
    for point in [e.mount_point for e in MountTable().entries() if e.source == dev]:
        subprocess.run(["umount", point], check=False)
    subprocess.run(["losetup", "-d", dev], check=False)


@pytest.fixture
def target(tmp_path: Path) -> Path:
    path = tmp_path / "mnt"
    path.mkdir()
    return path


def mounted(target: Path) -> tuple[str, str, list[str]] | None:
    entry = MountTable().at(str(target))
    return None if entry is None else (entry.source, entry.fs_type, list(entry.options))


@pytest.mark.parametrize("fs_type", ["ext4", "ext3", "xfs"])
def test_blank_device_is_formatted_then_mounted(device: str, target: Path, fs_type: str) -> None:
    assert format_and_mount(RUNNER, device, target, fs_type, False, ["noatime"]) is True
    assert blkid(device, "TYPE") == fs_type
    source, kind, options = mounted(target)  # type: ignore[misc]
    assert (source, kind) == (device, fs_type) and "noatime" in options and "rw" in options
    if fs_type != "xfs":  # mkfs -m0: no blocks reserved for root; errors=remount-ro by default
        listed = subprocess.run(
            ["tune2fs", "-l", device], check=True, capture_output=True, text=True
        ).stdout
        assert re.search(r"^Reserved block count:\s+0$", listed, re.M), listed
        shown = subprocess.run(
            ["findmnt", "-n", "-o", "OPTIONS", "--mountpoint", str(target)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        assert "errors=remount-ro" in shown.strip().split(","), shown
    (target / "f").write_text("x")
    subprocess.run(["umount", str(target)], check=True)
    # mounted again: the filesystem is kept, not formatted a second time
    assert format_and_mount(RUNNER, device, target, fs_type, False) is False
    assert (target / "f").read_text() == "x"


def test_blank_device_read_only_is_never_formatted(device: str, target: Path) -> None:
    with pytest.raises(VolumeError, match="read-only: refusing to format"):
        format_and_mount(RUNNER, device, target, "ext4", True)
    assert blkid(device, "TYPE") == "" and mounted(target) is None


def test_other_filesystem_is_refused_and_kept(device: str, target: Path) -> None:
    subprocess.run(["mkfs.ext4", "-q", "-F", device], check=True, capture_output=True)
    uuid = blkid(device, "UUID")
    with pytest.raises(VolumeError) as info:
        format_and_mount(RUNNER, device, target, "xfs", False)
    assert "ext4" in str(info.value) and "xfs" in str(info.value)
    assert blkid(device, "TYPE") == "ext4" and blkid(device, "UUID") == uuid
    assert mounted(target) is None


def write_dos_label(device: str) -> None:
    """An MBR with one Linux partition from sector 2048 to the end (what ``sfdisk`` writes)."""
    entry = struct.pack("<B3sB3sII", 0, b"\x00\x02\x00", 0x83, b"\xfe\xff\xff", 2048, 600000)
    with open(device, "r+b") as disk:
        disk.seek(446)
        disk.write(entry + bytes(48) + b"\x55\xaa")


def test_partition_table_is_refused_and_kept(device: str, target: Path) -> None:
    write_dos_label(device)
    with pytest.raises(VolumeError, match="dos partition table"):
        format_and_mount(RUNNER, device, target, "ext4", False)
    assert blkid(device, "PTTYPE") == "dos" and blkid(device, "TYPE") == ""
    assert mounted(target) is None


def test_read_only_mount_of_ext4_is_read_only(device: str, target: Path) -> None:
    subprocess.run(["mkfs.ext4", "-q", "-F", device], check=True, capture_output=True)
    format_and_mount(RUNNER, device, target, "ext4", True, ["rw", "noatime"])
    _, _, options = mounted(target)  # type: ignore[misc]
    assert "ro" in options and "rw" not in options
    with pytest.raises(OSError, match="Read-only"):
        (target / "g").write_text("no")
