"""mountinfo parsing, the mount table and mount option checks (no root needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexhub.errors import CommandError, InvalidOptions
from flexhub.node.mounts import (
    MountEntry,
    MountTable,
    check_mount_options,
    cleanup_mount_point,
    is_corrupted,
    unmount,
)
from flexhub.node.runner import RecordingRunner

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
36 22 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw,errors=continue
40 22 7:3 / /var/lib/flexhub/staging/abc rw,relatime shared:5 - ext4 /dev/loop3 rw
41 22 7:3 / /var/lib/kubelet/pods/u\\040v/volumes/a~b/my\\011vol ro,relatime shared:5 - ext4 /dev/loop3 rw
42 41 0:50 / /var/lib/kubelet/pods/u\\040v/volumes/a~b/my\\011vol rw - fuse back\\134slash rw
50 22 0:60 / /srv/nfs rw - nfs4 srv1:/export/a rw,vers=4.2
"""


@pytest.fixture
def table(tmp_path: Path) -> MountTable:
    path = tmp_path / "mountinfo"
    path.write_text(MOUNTINFO + "garbage line\n")
    return MountTable(path)


def test_parse_unescapes_and_splits_fields(table: MountTable) -> None:
    entries = table.entries()
    assert len(entries) == 6  # the garbage line is skipped
    pod = entries[3]
    assert pod.mount_point == "/var/lib/kubelet/pods/u v/volumes/a~b/my\tvol"
    assert pod.options == ("ro", "relatime") and pod.read_only
    assert (pod.fs_type, pod.source, pod.major_minor) == ("ext4", "/dev/loop3", "7:3")
    assert entries[1] == MountEntry(
        36,
        22,
        "98:0",
        "/mnt1",
        "/mnt/parent",
        ("rw", "noatime"),
        "ext3",
        "/dev/root",
        ("rw", "errors=continue"),
    )
    assert entries[4].source == "back\\slash"


def test_at_returns_the_topmost_mount(table: MountTable) -> None:
    top = table.at("/var/lib/kubelet/pods/u v/volumes/a~b/my\tvol/")
    assert top is not None and top.mount_id == 42 and top.fs_type == "fuse"
    assert table.is_mount_point("/srv/nfs") and not table.is_mount_point("/srv")


def test_users_of_and_by_source(table: MountTable) -> None:
    staging = table.at("/var/lib/flexhub/staging/abc")
    assert staging is not None
    assert [e.mount_id for e in table.users_of(staging)] == [40, 41]
    assert [e.mount_id for e in table.by_source("srv1:/export/a")] == [50]
    assert [e.mount_id for e in table.under("/var/lib/flexhub")] == [40]


@pytest.mark.parametrize(
    "option",
    [
        "remount",
        "bind",
        "rbind",
        "move",
        "make-shared",
        "X-mount.mkdir",
        "x-systemd.foo",
        "loop",
        "loop=/dev/loop1",
        "offset=4096",
        "sizelimit=1",
        "helper=x",
        "source=/dev/sda",
        "a b",
        "opt;rm",
        "o\nx",
        "-o",
        "=x",
        "uid=$(id)",
        "",
    ],
)
def test_forbidden_mount_options(option: str) -> None:
    with pytest.raises(InvalidOptions, match="not allowed"):
        check_mount_options(["noatime", option])


def test_allowed_mount_options() -> None:
    allowed = [
        "noatime",
        "nodev",
        "data=ordered",
        "vers=4.1",
        "context=system_u:object_r:x_t:s0",
        "ro",
        "discard",
        "nfsvers=3",
        "rsize=1048576",
    ]
    assert check_mount_options(allowed) == tuple(allowed)


def test_unmount_escalates_until_the_mount_is_gone(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text("40 22 7:3 / /p rw - ext4 /dev/loop3 rw\n")
    runner = RecordingRunner()
    runner.answer("umount", "-c", "--", rc=16, stderr="target is busy")

    def forced(argv: tuple[str, ...]):  # umount -f fails too, lazily detaching works
        from flexhub.node.runner import Result

        return Result(argv, 16, "", "busy")

    runner.script[("umount", "-c", "-f")] = forced

    def lazy(argv: tuple[str, ...]):
        from flexhub.node.runner import Result

        info.write_text("")
        return Result(argv, 0, "", "")

    runner.script[("umount", "-c", "-l")] = lazy
    unmount(runner, "/p", 5, MountTable(info))
    assert runner.calls == [
        ["umount", "-c", "--", "/p"],
        ["umount", "-c", "-f", "--", "/p"],
        ["umount", "-c", "-l", "--", "/p"],
    ]


def test_unmount_reports_failure_when_everything_fails(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text("40 22 7:3 / /p rw - ext4 /dev/loop3 rw\n")
    runner = RecordingRunner()
    runner.answer("umount", rc=32, stderr="no")
    with pytest.raises(CommandError, match="cannot unmount /p"):
        unmount(runner, "/p", 5, MountTable(info))


def test_cleanup_of_a_missing_or_unmounted_path_is_success(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text("")
    runner = RecordingRunner()
    cleanup_mount_point(runner, tmp_path / "nope", 5, MountTable(info))
    assert runner.calls == []
    assert not is_corrupted(tmp_path / "nope") and not is_corrupted(tmp_path)
