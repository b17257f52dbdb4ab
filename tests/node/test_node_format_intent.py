"""Format intents (flexhub/node/formatintent.py): which device an intent names, and the rules
of :func:`format_and_mount` around one, with a recording runner for the rules (what really
happens to a loop device killed while mkfs runs is tests/loopfile/test_first_mount_crash.py).

An intent is honoured only for the exact device identity it names (a SCSI or dm device: in this
boot and this attachment; a device without an identity gets none), only while blkid finds
nothing or the filesystem that format was making, and never for a read-only mount."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from flexhub.errors import VolumeError
from flexhub.node import formatintent
from flexhub.node.formatintent import FormatIntent, device_identity
from flexhub.node.fs import format_and_mount
from flexhub.node.journal import Journal
from flexhub.node.runner import RecordingRunner
from tests.conftest import needs_root

MAJOR, MINOR = 8, 240


@pytest.fixture
def sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """A block device node (8:240) and a sysfs tree for it: a SCSI disk of 64 MiB."""
    if os.geteuid() != 0:
        pytest.skip("needs root (mknod)")
    dev = tmp_path / "sdz"
    os.mknod(dev, 0o600 | stat.S_IFBLK, os.makedev(MAJOR, MINOR))
    block = tmp_path / "sys" / "dev" / "block" / f"{MAJOR}:{MINOR}"
    (block / "device").mkdir(parents=True)
    (block / "size").write_text(f"{(64 << 20) // 512}\n")
    (block / "device" / "wwid").write_text("naa.6001405abcdef\n")
    (block / "diskseq").write_text("41\n")
    boot = tmp_path / "boot_id"
    boot.write_text("boot-1\n")
    monkeypatch.setattr(formatintent, "BOOT_ID", boot)
    return str(dev), tmp_path / "sys"


def _block(sys: Path) -> Path:
    return sys / "dev" / "block" / f"{MAJOR}:{MINOR}"


def test_a_scsi_device_is_named_by_wwid_size_and_this_attachment(sysfs: tuple[str, Path]) -> None:
    dev, sys = sysfs
    assert device_identity(dev, sys) == {
        "kind": "scsi",
        "wwid": "naa.6001405abcdef",
        "size": str(64 << 20),
        "boot_id": "boot-1",
        "diskseq": "41",
    }
    (_block(sys) / "dm").mkdir()
    (_block(sys) / "dm" / "uuid").write_text("mpath-36001405abcdef\n")
    assert device_identity(dev, sys)["kind"] == "dm"  # type: ignore[index]


@pytest.mark.parametrize("missing", ["device/wwid", "diskseq", "size"])
def test_a_device_without_identity_gets_no_intent(
    sysfs: tuple[str, Path], tmp_path: Path, missing: str
) -> None:
    dev, sys = sysfs
    (_block(sys) / missing).unlink()
    assert device_identity(dev, sys) is None
    journal = Journal(tmp_path / "state")
    FormatIntent(journal, "v", dev, sys).begin("ext4")
    assert journal.get_format("v") is None


def test_an_intent_names_one_device_and_one_attachment(
    sysfs: tuple[str, Path], tmp_path: Path
) -> None:
    dev, sys = sysfs
    journal = Journal(tmp_path / "state")
    intent = FormatIntent(journal, "v", dev, sys)
    intent.begin("xfs")
    assert intent.unfinished() == "xfs"
    assert FormatIntent(journal, "w", dev, sys).unfinished() is None  # another volume's
    intent.finish()
    assert intent.unfinished() is None
    assert list((tmp_path / "state" / "formats").iterdir()) == []
    for change in ("diskseq", "wwid"):  # detached and attached again; another LUN at the name
        intent.begin("xfs")
        before = (_block(sys) / "diskseq").read_text(), (_block(sys) / "device/wwid").read_text()
        if change == "diskseq":
            (_block(sys) / "diskseq").write_text("42\n")
        else:
            (_block(sys) / "device" / "wwid").write_text("naa.other\n")
        assert intent.unfinished() is None
        (_block(sys) / "diskseq").write_text(before[0])
        (_block(sys) / "device" / "wwid").write_text(before[1])
        # the same device again: the intent was dropped when it named another, so a filesystem
        # mounted (and written) meanwhile is never formatted when the names match again
        assert intent.unfinished() is None
        assert list((tmp_path / "state" / "formats").iterdir()) == []


def test_a_forged_or_broken_intent_is_ignored(sysfs: tuple[str, Path], tmp_path: Path) -> None:
    dev, sys = sysfs
    journal = Journal(tmp_path / "state")
    FormatIntent(journal, "v", dev, sys).begin("ext4")
    (path,) = (tmp_path / "state" / "formats").iterdir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    text = path.read_text()
    path.write_text(text.replace('"volume_id": "v"', '"volume_id": "w"'))
    assert FormatIntent(journal, "v", dev, sys).unfinished() is None
    path.write_text("{not json")
    assert FormatIntent(journal, "v", dev, sys).unfinished() is None


class _Intent(FormatIntent):
    """An intent whose device identity is given (the rules of format_and_mount)."""

    def __init__(self, journal: Journal, begun: str | None) -> None:
        super().__init__(journal, "vol", "/dev/loop9")
        if begun:
            journal.put_format("vol", {"kind": "test"}, begun)

    def unfinished(self) -> str | None:
        found = self.journal.get_format(self.volume_id)
        return found[1] if found else None

    def begin(self, fs_type: str) -> None:
        self.journal.put_format(self.volume_id, {"kind": "test"}, fs_type)


def _runner(blkid_rc: int = 2, blkid_out: str = "") -> RecordingRunner:
    runner = RecordingRunner()
    runner.answer("blkid", rc=blkid_rc, stdout=blkid_out)
    runner.answer("blockdev", stdout=str(64 << 20))
    runner.answer("cmp", rc=1, stdout="/dev/loop9 /dev/zero differ: byte 3, line 1\n")
    return runner


def _commands(runner: RecordingRunner) -> list[str]:
    return [call[0] for call in runner.calls]


@pytest.mark.parametrize("found", ["", "TYPE=ext4\n"])
def test_an_unfinished_format_is_done_again(tmp_path: Path, found: str) -> None:
    """No signature (mkfs stopped before its superblock), or the filesystem it was making
    (stopped after it): formatted again, without the blank proof, and the intent is gone."""
    journal = Journal(tmp_path / "state")
    runner = _runner(0 if found else 2, found)
    formatted = format_and_mount(
        runner, "/dev/loop9", tmp_path / "s", "ext4", False, intent=_Intent(journal, "ext4")
    )
    assert formatted
    assert "cmp" not in _commands(runner) and "fsck" not in _commands(runner)
    assert ["mkfs.ext4", "-F", "-m0", "--", "/dev/loop9"] in runner.calls
    assert journal.get_format("vol") is None


def test_without_an_intent_data_is_still_refused(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "state")
    runner = _runner()
    with pytest.raises(VolumeError, match="cannot identify"):
        format_and_mount(
            runner, "/dev/loop9", tmp_path / "s", "ext4", False, intent=_Intent(journal, None)
        )
    assert not any(c.startswith("mkfs") for c in _commands(runner))


@pytest.mark.parametrize(
    ("found", "error"),
    [("TYPE=xfs\n", "already holds a xfs"), ("PTTYPE=gpt\n", "partition table")],
)
def test_what_no_format_of_flexhub_made_is_never_formatted(
    tmp_path: Path, found: str, error: str
) -> None:
    """Another filesystem or a partition table is not what that mkfs was making: the intent
    is dropped and the usual refusal stands."""
    journal = Journal(tmp_path / "state")
    runner = _runner(0, found)
    with pytest.raises(VolumeError, match=error):
        format_and_mount(
            runner, "/dev/loop9", tmp_path / "s", "ext4", False, intent=_Intent(journal, "ext4")
        )
    assert not any(c.startswith("mkfs") for c in _commands(runner))
    assert journal.get_format("vol") is None


def test_a_read_only_mount_never_finishes_a_format(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "state")
    runner = _runner(0, "TYPE=ext4\n")
    with pytest.raises(VolumeError, match="read-only"):
        format_and_mount(
            runner, "/dev/loop9", tmp_path / "s", "ext4", True, intent=_Intent(journal, "ext4")
        )
    assert not any(c.startswith(("mkfs", "mount")) for c in _commands(runner))
    assert journal.get_format("vol") == ({"kind": "test"}, "ext4")


def test_a_failed_mkfs_keeps_its_intent_a_finished_one_clears_it(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "state")
    runner = _runner()
    runner.answer("cmp", rc=0)
    runner.answer("mkfs.ext4", rc=1, stderr="mkfs.ext4: Device or resource busy")
    with pytest.raises(Exception, match="busy"):
        format_and_mount(
            runner, "/dev/loop9", tmp_path / "s", "ext4", False, intent=_Intent(journal, None)
        )
    assert journal.get_format("vol") == ({"kind": "test"}, "ext4")
    runner.answer("mkfs.ext4", rc=0)
    runner.answer("blkid", rc=2)
    assert format_and_mount(
        runner, "/dev/loop9", tmp_path / "s", "ext4", False, intent=_Intent(journal, None)
    )
    assert journal.get_format("vol") is None


@needs_root
def test_a_loop_device_is_named_by_its_backing_file(tmp_path: Path) -> None:
    """A real loop device: the backing file's numbers (and inode generation where the
    filesystem has one), stable across a detach; another file at the same path differs."""
    import subprocess

    image = tmp_path / "a.img"
    image.write_bytes(b"")
    os.truncate(image, 16 << 20)
    loop = subprocess.run(
        ["losetup", "--find", "--show", str(image)], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        first = device_identity(loop)
        assert first is not None and first["kind"] == "loop"
        assert first["file_ino"] == str(image.stat().st_ino)
        assert first["size"] == str(16 << 20)
    finally:
        subprocess.run(["losetup", "--detach", loop], check=True)
    other = tmp_path / "b.img"
    other.write_bytes(b"")
    os.truncate(other, 16 << 20)
    os.replace(other, image)
    loop = subprocess.run(
        ["losetup", "--find", "--show", str(image)], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        assert device_identity(loop) != first
    finally:
        subprocess.run(["losetup", "--detach", loop], check=True)
