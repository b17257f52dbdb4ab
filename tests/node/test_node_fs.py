"""SafeFormatAndMount and growth logic with a recording runner, only where this machine has no
real system for it: fsck's exit codes (a filesystem fsck cannot repair is not made on demand),
refusals that must run no command at all, the order of the blank proof, and the growth
arithmetic on scripted sizes. What formatting and mounting do to a real device (a blank one
formatted with no reserved blocks and mounted with errors=remount-ro, a read-only blank one never
formatted, another filesystem and a partition table refused and kept) is in
test_node_fs_real.py."""

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
    runner.answer("blockdev", stdout=str(64 << 20))
    return runner


def _commands(runner: RecordingRunner) -> list[str]:
    return [call[0] for call in runner.calls]


def test_probe_parses_blkid_export() -> None:
    assert probe(_runner(0, f"DEVNAME={DEV}\nTYPE=xfs\n"), DEV) == ("xfs", None)
    assert probe(_runner(0, "PTTYPE=gpt\n"), DEV) == (None, "gpt")
    assert probe(_runner(2), DEV) == (None, None)
    with pytest.raises(CommandError, match="exit 8"):
        probe(_runner(8), DEV)  # ambivalent probe: never treated as blank
    runner = _runner(2)
    runner.answer("blkid", rc=2, stderr="error: /dev/loop9: Permission denied")
    with pytest.raises(CommandError, match="Permission denied"):
        probe(runner, DEV)  # exit 2 with a message is an error, never "no signature"
    with pytest.raises(VolumeError, match="without a type"):
        probe(_runner(0, f"DEVNAME={DEV}\n"), DEV)  # found something, named nothing


@pytest.mark.parametrize("which", ["head", "tail"])
def test_unknown_data_without_signature_is_never_formatted(which: str) -> None:
    runner = _runner()

    def cmp(argv: tuple[str, ...]) -> Result:
        head = argv[4] == "0:0"
        if head == (which == "head"):
            return Result(argv, 1, f"{DEV} /dev/zero differ: byte 3, line 1\n", "")
        return Result(argv, 0, "", "")

    runner.script[("cmp",)] = cmp
    with pytest.raises(VolumeError, match="holds data flexhub cannot identify"):
        format_and_mount(runner, DEV, "/s", "ext4", False, label=f"{DEV} (file /x.img)")
    assert not any(c.startswith("mkfs") for c in _commands(runner))
    # the blank proof compares the first and the last MiB (of 64 MiB here) with zeros
    cmps = [call for call in runner.calls if call[0] == "cmp"]
    assert cmps[0] == ["cmp", "-n", "1048576", "-i", "0:0", "--", DEV, "/dev/zero"]
    if which == "tail":
        assert cmps[1][4] == f"{(64 << 20) - (1 << 20)}:0"


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (("blockdev", 1, "", "blockdev: cannot open /dev/loop9: No such device"), CommandError),
        (("blockdev", 0, "0", ""), CommandError),  # an unbound loop device: size 0
        (("cmp", 2, "", "cmp: /dev/loop9: Input/output error"), CommandError),
        (("cmp", 1, "", "cmp: EOF on /dev/loop9 after byte 5"), CommandError),
    ],
)
def test_unreadable_device_is_an_error_not_blank(
    answer: tuple[str, int, str, str], error: type[Exception]
) -> None:
    runner = _runner()
    runner.answer(answer[0], rc=answer[1], stdout=answer[2], stderr=answer[3])
    with pytest.raises(error):
        format_and_mount(runner, DEV, "/s", "ext4", False)
    assert not any(c.startswith("mkfs") for c in _commands(runner))


def test_backend_hint_decides_without_reading() -> None:
    runner = _runner()
    assert format_and_mount(runner, DEV, "/s", "xfs", False, blank_hint=True)
    assert _commands(runner) == ["blkid", "blockdev", "blkid", "mkfs.xfs", "mount"]
    runner = _runner()
    with pytest.raises(VolumeError, match="cannot identify"):
        format_and_mount(runner, DEV, "/s", "xfs", False, blank_hint=False)
    assert _commands(runner) == ["blkid", "blockdev"]


def test_a_signature_appearing_before_mkfs_stops_it() -> None:
    runner = _runner()
    answers = iter([Result((), 2, "", ""), Result((), 0, "TYPE=ext4\n", "")])
    runner.script[("blkid",)] = lambda argv: next(answers)
    with pytest.raises(VolumeError, match="changed while"):
        format_and_mount(runner, DEV, "/s", "ext4", False)
    assert not any(c.startswith("mkfs") for c in _commands(runner))


@pytest.mark.parametrize("rc", [0, 1, 2])
def test_fsck_before_a_read_write_ext_mount(rc: int) -> None:
    runner = _runner(0, "TYPE=ext4\n", fsck_rc=rc)
    assert not format_and_mount(runner, DEV, "/s", "ext4", False)
    assert runner.calls[1] == ["fsck", "-a", DEV]
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
    assert runner.calls[-1] == [
        "mount",
        "-t",
        "ext4",
        "-o",
        "noatime,errors=remount-ro,ro",
        "--",
        DEV,
        "/s",
    ]
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
