"""A read-only or full state_dir, and lock files under pod churn (real mounts, processes)."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Rig

from flexhub.errors import LockTimeout, StateError
from flexhub.node.locks import lock, lock_path
from flexhub.node.volumes import mount_volume, unmount_volume

pytestmark = pytest.mark.root

REPO = Path(__file__).resolve().parents[2]


def _tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "state", str(where)], check=True)


def _fill(directory: Path) -> None:
    """Write until the filesystem is full (ENOSPC)."""
    with open(directory / "filler", "wb") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def test_unmount_with_a_read_only_state_dir_still_unmounts(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    _tmpfs(rig.state, "16m")
    file = rig.file()
    target = rig.pod("a")
    mount_volume(rig.node, rig.backend, target, rig.volume(file))
    subprocess.run(["mount", "-o", "remount,ro", str(rig.state)], check=True)
    with caplog.at_level(logging.WARNING):
        message = unmount_volume(rig.node, target, lambda name: rig.backend)
    assert [m for m in rig.mounts() if m != str(rig.state)] == []
    assert rig.loops() == []
    assert "journal not updated" in message and "Read-only file system" in message
    assert "unmounted, but the journal was not updated" in caplog.text
    # Writable again: a second unmount finds nothing mounted and forgets the records.
    subprocess.run(["mount", "-o", "remount,rw", str(rig.state)], check=True)
    assert unmount_volume(rig.node, target, lambda name: rig.backend) == ""
    assert rig.records() == []


def test_full_state_dir_fails_mount_cleanly_and_still_unmounts(rig: Rig) -> None:
    _tmpfs(rig.state, "1m")
    file = rig.file()
    mounted = rig.pod("a")
    mount_volume(rig.node, rig.backend, mounted, rig.volume(file))
    _fill(rig.state)
    with pytest.raises(StateError, match="No space left"):
        mount_volume(rig.node, rig.backend, rig.pod("b"), rig.volume(file))
    assert unmount_volume(rig.node, mounted, lambda name: rig.backend) == ""
    assert [m for m in rig.mounts() if m != str(rig.state)] == []
    assert rig.loops() == []
    assert rig.records() == []


def test_lock_files_do_not_pile_up_with_pod_churn(rig: Rig) -> None:
    file = rig.file()
    for i in range(5):
        target = rig.pod(f"p{i}")
        mount_volume(rig.node, rig.backend, target, rig.volume(file))
        unmount_volume(rig.node, target, lambda name: rig.backend)
    assert os.listdir(rig.state / "locks") == []
    rig.assert_clean()


CONTENDER = """
import os, sys
from pathlib import Path
from flexhub.node.locks import lock
locks, owner, rounds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
for _ in range(rounds):
    with lock(locks, "pod", "/churn", 60):
        # Two holders at once would collide here (O_EXCL), whatever the timing.
        fd = os.open(owner, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.close(fd)
        os.unlink(owner)
"""


def test_removing_lock_files_never_lets_two_processes_hold_one_lock(tmp_path: Path) -> None:
    # Every release unlinks the file; a waiter that opened the old file must not take it.
    env = dict(os.environ, PYTHONPATH=str(REPO))
    argv = [sys.executable, "-c", CONTENDER, str(tmp_path / "locks"), str(tmp_path / "owner")]
    procs = [
        subprocess.Popen([*argv, "300"], env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, errors
    assert os.listdir(tmp_path / "locks") == []


HOLDER = """
import sys, time
from pathlib import Path
from flexhub.node.locks import lock
with lock(Path(sys.argv[1]), "pod", "/x", 5):
    print("held", flush=True)
    time.sleep(30)
"""


def test_an_existing_lock_file_on_a_read_only_state_dir_still_locks(tmp_path: Path) -> None:
    locks = tmp_path / "state" / "locks"
    _tmpfs(tmp_path / "state", "1m")
    holder = None
    try:
        locks.mkdir()
        lock_path(locks, "pod", "/x").touch()  # left by a holder that was SIGKILLed
        subprocess.run(["mount", "-o", "remount,ro", str(tmp_path / "state")], check=True)
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(locks)],
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(LockTimeout), lock(locks, "pod", "/x", 0.3):
            pass
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        subprocess.run(["umount", "-l", str(tmp_path / "state")], check=False)
