"""Node locks: bounded waits, cross-process exclusion, no global lock, released on SIGKILL."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flexhub.errors import LockTimeout
from flexhub.node.locks import lock, lock_path

REPO = Path(__file__).resolve().parents[2]

HOLDER = """
import sys, time
from pathlib import Path
from flexhub.node.locks import lock
with lock(Path(sys.argv[1]), "volume", "vol-1", 5):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _hold(lock_dir: Path, seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock_dir), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_lock_files_are_private(tmp_path: Path) -> None:
    with lock(tmp_path / "locks", "pod", "/var/lib/kubelet/pods/x", 1):
        path = lock_path(tmp_path / "locks", "pod", "/var/lib/kubelet/pods/x")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert path.name.startswith("pod-") and len(path.name) == len("pod-") + 40 + 5


def test_other_process_times_out_with_a_clear_failure(tmp_path: Path) -> None:
    holder = _hold(tmp_path, 3)
    try:
        started = time.monotonic()
        with pytest.raises(LockTimeout) as info, lock(tmp_path, "volume", "vol-1", 0.3):
            pass
        assert 0.3 <= time.monotonic() - started < 1.5
        assert str(info.value) == "timed out after 0.3s waiting for the volume lock of vol-1"
        with lock(tmp_path, "volume", "vol-2", 0.3):  # another volume is not blocked
            pass
        with lock(tmp_path, "pod", "vol-1", 0.3):  # nor another kind
            pass
        started = time.monotonic()
        with lock(tmp_path, "volume", "vol-1", 10):  # granted when the holder leaves
            assert time.monotonic() - started > 1
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_holder_releases_the_lock(tmp_path: Path) -> None:
    holder = _hold(tmp_path, 60)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with lock(tmp_path, "volume", "vol-1", 1):
        pass


def test_lock_is_not_reentrant_across_descriptors(tmp_path: Path) -> None:
    with (
        lock(tmp_path, "volume", "v", 1),
        pytest.raises(LockTimeout),
        lock(tmp_path, "volume", "v", 0.1),
    ):
        pass
