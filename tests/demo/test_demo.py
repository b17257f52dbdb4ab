"""The project's main job, ``flexhub demo``, run as a newcomer runs it."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, needs_root


def _mounts_and_loops() -> tuple[str, str]:
    loops = subprocess.run(
        ["losetup", "--list", "--noheadings"], capture_output=True, text=True, check=False
    ).stdout
    return Path("/proc/self/mountinfo").read_text(), loops


def _in_terminal(argv: list[str]) -> tuple[int, str]:
    """Run ``argv`` with stdout and stderr on a pseudo-terminal, as a person does."""
    leader, follower = os.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError as exc:  # EIO once the demo closed the terminal
            assert exc.errno == errno.EIO
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return proc.wait(timeout=300), b"".join(chunks).decode().replace("\r\n", "\n")


STEPS = [
    "[1/8] init",
    "[2/8] pod-a mounts pv-demo",
    "[3/8] pod-b mounts pv-demo",
    "[4/8] pod-a unmounts",
    "[5/8] pod-b unmounts",
    "[6/8] pod-c mounts pv-demo",
    "[7/8] expandfs: grow to 1 GiB online",
    "[8/8] pod-c unmounts",
]


@needs_root
@pytest.mark.parametrize("fs_type", ["xfs", "ext4"])
def test_demo_replays_kubelet_and_leaves_nothing(fs_type: str) -> None:
    """xfs piped (no colour: a log or a CI job reads it), ext4 in a terminal (colour)."""
    argv = [PYTHON, "-m", "flexhub", "demo", "--fs-type", fs_type]
    if fs_type == "xfs":
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        code, out = proc.returncode, proc.stdout
        assert "\x1b[" not in out
    else:
        code, out = _in_terminal(argv)
        assert "\x1b[32mok\x1b[0m" in out and "\x1b[31mFAILED\x1b[0m" in out
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert "flexhub-demo-" not in _mounts_and_loops()[0]
    assert "flexhub-demo-" not in _mounts_and_loops()[1]
    lines = plain.splitlines()
    assert max(len(line) for line in lines) <= 80, plain
    progress = [line for line in lines if line.startswith("[")]
    assert len(progress) == len(STEPS), plain
    assert all(p.startswith(s) for p, s in zip(progress, STEPS, strict=True)), plain
    assert "      pod-b reads pod-a's file: ok" in lines
    assert "      pod-c finds the data after every pod went away: ok" in lines
    assert "  nothing left mounted or attached" in lines
    if fs_type == "xfs":
        assert code == 0, plain
        assert all(p.split()[-2] == "ok" for p in progress), plain
        assert "summary: ok: 8 of 8 kubelet calls ok" in lines
    else:
        # this machine lacks CAP_SYS_RESOURCE: ext4 cannot grow online here, and the demo
        # must say so plainly rather than claim success (on a real node it grows).
        assert code == 1, plain
        assert progress[6].split()[-2] == "FAILED"
        assert "summary: FAILED: 7 of 8 kubelet calls ok" in lines
        cause = plain.split("  cause: ", 1)[1].replace("\n  ", " ")
        assert cause.startswith(
            "ext4 grows online only with CAP_SYS_RESOURCE, which this process lacks"
        )


def test_the_demo_knows_a_missing_capability(tmp_path: Path) -> None:
    from flexhub.admin.demo import CAP_SYS_RESOURCE, lacks_capability

    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t000001ffffffffff\n")
    assert not lacks_capability(CAP_SYS_RESOURCE, status)
    status.write_text(f"CapEff:\t{0x1FFFFFFFFFF & ~(1 << CAP_SYS_RESOURCE):016x}\n")
    assert lacks_capability(CAP_SYS_RESOURCE, status)


def test_demo_without_root_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # the interpreter lives under /root here, so an unprivileged process cannot start it;
    # the check itself is what matters: one line, exit 1, nothing created.
    from flexhub.admin import demo

    monkeypatch.setattr(demo.os, "geteuid", lambda: 1000)
    lines: list[str] = []
    made = demo.tempfile.mkdtemp
    monkeypatch.setattr(demo.tempfile, "mkdtemp", lambda **kw: pytest.fail("created a tree"))
    assert demo.run_demo(out=lines.append) == 1
    monkeypatch.setattr(demo.tempfile, "mkdtemp", made)
    assert len(lines) == 1 and "needs root" in lines[0]


def test_an_fs_type_the_demo_cannot_make_is_refused_before_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--fs-type btrfs``: one line naming the ones it makes, exit 1, no tree, no driver (it
    used to install, replay and fail at the first mount)."""
    from flexhub.admin import demo

    made = demo.tempfile.mkdtemp
    monkeypatch.setattr(demo.tempfile, "mkdtemp", lambda **kw: pytest.fail("created a tree"))
    lines: list[str] = []
    assert demo.run_demo(fs_type="btrfs", out=lines.append) == 1
    monkeypatch.setattr(demo.tempfile, "mkdtemp", made)
    assert lines == ["flexhub demo: --fs-type btrfs is not one it makes: use ext3, ext4 or xfs"]
    proc = subprocess.run(
        [PYTHON, "-m", "flexhub", "demo", "--fs-type", "btrfs"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 1
    assert (proc.stdout + proc.stderr).splitlines() == lines


@needs_root
def test_verbose_shows_each_json_whole(tmp_path: Path) -> None:
    """``--verbose``: every call's options and every reply are one JSON document on one line
    (they were hard-wrapped at 78 columns, mid-token); the progress lines stay within 80."""
    proc = subprocess.run(
        [PYTHON, "-m", "flexhub", "demo", "--verbose"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    replies = [line.removeprefix("      <- ") for line in lines if line.startswith("      <- ")]
    calls = [line.removeprefix("      $ ") for line in lines if line.startswith("      $ ")]
    assert len(replies) == len(calls) == len(STEPS), proc.stdout
    for reply in replies:
        assert json.loads(reply)["status"] == "Success", reply
    options = [call.split(" '", 1)[1].split("'", 1)[0] for call in calls if " '" in call]
    assert len(options) == 4, calls  # the three mounts' options and expandfs's
    for text in options:
        assert json.loads(text)["backend"] == "loopfile", text
    others = [line for line in lines if not line.startswith(("      <- ", "      $ "))]
    assert max(len(line) for line in others) <= 80, proc.stdout
