"""SafeFormatAndMount and growth logic with a recording runner, only where this machine has no
real system for it: fsck's exit codes (a filesystem fsck cannot repair is not made on demand),
refusals that must run no command at all, and the growth arithmetic on scripted sizes.
What formatting and mounting do to a real device is in test_node_fs_real.py."""

from __future__ import annotations

import pytest

from flexhub.errors import CommandError, InvalidOptions, VolumeError
from flexhub.node.fs import format_and_mount, grow_filesystem, probe
from flexhub.node.runner import RecordingRunner, Result

DEV = "/dev/loop9"


def _runner(blkid_rc: int = 2, blkid_out: str = "", fsck_rc: int = 0) -> RecordingRunner:
    runner = RecordingRunner()
    runner.answer("blkid", rc=blkid_rc, stdout=blkid_out)
    runner.answer("fsck", rc=fsck_rc, stdout="fsck output")
    return runner


def _commands(runner: RecordingRunner) -> list[str]:
    return [call[0] for call in runner.calls]


def test_probe_parses_blkid_export() -> None:
    assert probe(_runner(0, f"DEVNAME={DEV}\nTYPE=xfs\n"), DEV) == ("xfs", None)
    assert probe(_runner(0, "PTTYPE=gpt\n"), DEV) == (None, "gpt")
    assert probe(_runner(2), DEV) == (None, None)
    with pytest.raises(CommandError, match="exit 8"):
        probe(_runner(8), DEV)  # ambivalent probe: never treated as blank


@pytest.mark.parametrize("rc", [0, 1, 2])
def test_fsck_before_a_read_write_ext_mount(rc: int) -> None:
    runner = _runner(0, "TYPE=ext4\n", fsck_rc=rc)
    assert not format_and_mount(runner, DEV, "/s", "ext4", False)
    assert runner.calls[1] == ["fsck", "-a", "--", DEV]
    assert _commands(runner) == ["blkid", "fsck", "mount"]


@pytest.mark.parametrize("rc", [4, 8])
def test_fsck_uncorrected_errors_fail(rc: int) -> None:
    runner = _runner(0, "TYPE=ext4\n", fsck_rc=rc)
    with pytest.raises(VolumeError, match=f"could not fix \\(exit {rc}\\)"):
        format_and_mount(runner, DEV, "/s", "ext4", False)
    assert "mount" not in _commands(runner)


def test_read_only_and_xfs_skip_fsck() -> None:
    runner = _runner(0, "TYPE=ext4\n")
    format_and_mount(runner, DEV, "/s", "ext4", True, ["rw", "noatime"])
    assert _commands(runner) == ["blkid", "mount"]
    runner = _runner(0, "TYPE=xfs\n")
    format_and_mount(runner, DEV, "/s", "xfs", False)
    assert _commands(runner) == ["blkid", "mount"]


def test_unsupported_fs_type_and_bad_options_fail_before_any_command() -> None:
    runner = _runner()
    with pytest.raises(InvalidOptions, match="btrfs"):
        format_and_mount(runner, DEV, "/s", "btrfs", False)
    with pytest.raises(InvalidOptions, match="bind"):
        format_and_mount(runner, DEV, "/s", "ext4", False, ["bind"])
    assert runner.calls == []


def test_grow_refuses_to_report_success_when_nothing_grew() -> None:
    runner = RecordingRunner()
    runner.answer("xfs_info", stdout="data     =   bsize=4096   blocks=1000, imaxpct=25\n")
    runner.answer("blockdev", stdout=str(1 << 30))
    with pytest.raises(VolumeError, match="did not grow"):
        grow_filesystem(runner, DEV, "/s", "xfs")
    runner.answer("blockdev", stdout=str(4096 * 1000))  # already fills its device: a retry
    assert grow_filesystem(runner, DEV, "/s", "xfs") == 4096 * 1000

    def sizes(argv: tuple[str, ...]) -> Result:
        sizes.calls += 1  # type: ignore[attr-defined]
        blocks = 1000 if sizes.calls == 1 else 2000  # type: ignore[attr-defined]
        return Result(argv, 0, f"Block count:   {blocks}\nBlock size:   4096\n", "")

    sizes.calls = 0  # type: ignore[attr-defined]
    runner.script[("dumpe2fs",)] = sizes
    runner.answer("blockdev", stdout=str(4096 * 2000))
    assert grow_filesystem(runner, DEV, "/s", "ext4") == 4096 * 2000
    assert ["resize2fs", "--", DEV] in runner.calls
    runner.answer("resize2fs", rc=1, stderr="Permission denied to resize filesystem")
    with pytest.raises(CommandError, match="Permission denied"):
        grow_filesystem(runner, DEV, "/s", "ext4")
