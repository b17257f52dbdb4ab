"""The project's main job, ``flexhub demo``, run as a newcomer runs it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, needs_root


def _mounts_and_loops() -> tuple[str, str]:
    loops = subprocess.run(
        ["losetup", "--list", "--noheadings"], capture_output=True, text=True, check=False
    ).stdout
    return Path("/proc/self/mountinfo").read_text(), loops


@needs_root
@pytest.mark.parametrize("fs_type", ["xfs", "ext4"])
def test_demo_replays_kubelet_and_leaves_nothing(fs_type: str) -> None:
    proc = subprocess.run(
        [PYTHON, "-m", "flexhub", "demo", "--fs-type", fs_type],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = proc.stdout
    assert "flexhub-demo-" not in _mounts_and_loops()[0]
    assert "flexhub-demo-" not in _mounts_and_loops()[1]
    for step in (
        "init",
        "pod-a: mount",
        "pod-b: mount",
        "pod-a: unmount",
        "pod-b: unmount",
        "pod-c: mount",
        "expandfs",
        "pod-c: unmount",
    ):
        assert step in out, out
    assert "ok: pod-b reads pod-a's file" in out
    assert "ok: pod-c finds the data" in out
    if fs_type == "xfs":
        assert proc.returncode == 0, out + proc.stderr
        assert "summary: 8 kubelet calls, 0 problem(s); nothing left mounted or attached" in out
    else:
        # this machine lacks CAP_SYS_RESOURCE: ext4 cannot grow online here, and the demo
        # must say so rather than claim success (on a real node it grows).
        assert proc.returncode == 1, out
        assert "FAILED: df inside pod-c" in out or "problem: kubelet expandfs" in out
        assert "nothing left mounted or attached" in out


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
