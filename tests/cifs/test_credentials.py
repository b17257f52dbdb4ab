"""The credentials file: private, exclusive, never through a symlink, always removed."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
from flexhub_cifs._credentials import CRED_DIR, collect_leftovers, credentials_file

from flexhub.backend import VolumeError


def test_file_is_0600_in_a_0700_directory_and_removed_after(tmp_path: Path) -> None:
    with credentials_file(tmp_path, b"username=u\npassword=p\n") as path:
        info = os.lstat(path)
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
        assert stat.S_IMODE(os.lstat(tmp_path / CRED_DIR).st_mode) == 0o700
        assert Path(path).parent == tmp_path / CRED_DIR
        assert Path(path).read_bytes() == b"username=u\npassword=p\n"
        assert Path(path).name.startswith(f"{os.getpid()}-")
    assert not os.path.lexists(path)
    assert os.listdir(tmp_path / CRED_DIR) == []


def test_file_is_removed_when_the_mount_fails(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), credentials_file(tmp_path, b"password=p\n") as path:
        raise RuntimeError("mount failed")
    assert not os.path.lexists(path)


def test_umask_cannot_widen_and_a_wide_directory_is_narrowed(tmp_path: Path) -> None:
    (tmp_path / CRED_DIR).mkdir(mode=0o777)
    os.chmod(tmp_path / CRED_DIR, 0o777)
    old = os.umask(0)
    try:
        with credentials_file(tmp_path, b"x") as path:
            assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(tmp_path / CRED_DIR).st_mode) == 0o700


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    (state / CRED_DIR).symlink_to(elsewhere)
    with (
        pytest.raises(VolumeError, match="not a private directory"),
        credentials_file(state, b"password=p\n"),
    ):
        pass
    assert os.listdir(elsewhere) == []


def test_a_directory_of_another_owner_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root (chown)")
    (tmp_path / CRED_DIR).mkdir(mode=0o700)
    os.chown(tmp_path / CRED_DIR, 65534, 65534)
    with (
        pytest.raises(VolumeError, match="not flexhub's own"),
        credentials_file(tmp_path, b"password=p\n"),
    ):
        pass


def _name(pid: int, start: str | None = None) -> str:
    """A credentials file's name as credentials_file() makes it (``start``: the process's
    start time; by default, the true one)."""
    if start is None:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        start = fields[19]
    return f"{pid}-{start}-{os.urandom(8).hex()}.cred"


def test_leftovers_of_dead_processes_are_collected(tmp_path: Path) -> None:
    with credentials_file(tmp_path, b"x"):
        pass
    base = tmp_path / CRED_DIR
    proc = subprocess.Popen(["true"])
    proc.wait()
    gone = base / _name(proc.pid, "12345")
    gone.write_bytes(b"password=left\n")
    legacy = base / f"{proc.pid}-{os.urandom(8).hex()}.cred"  # an earlier version's name
    legacy.write_bytes(b"password=left\n")
    collect_leftovers(tmp_path)
    assert os.listdir(base) == []


def test_a_reused_pid_does_not_keep_a_leftover(tmp_path: Path) -> None:
    """The pid in the name is alive, but that process started at another time: it is not
    the call that made the file (pids are reused), so the file is a leftover."""
    with credentials_file(tmp_path, b"x"):
        pass
    base = tmp_path / CRED_DIR
    with subprocess.Popen(["sleep", "60"]) as proc:
        try:
            (base / _name(proc.pid, "1")).write_bytes(b"password=left\n")
            collect_leftovers(tmp_path)
            assert os.listdir(base) == []
        finally:
            proc.kill()


def test_a_live_process_keeps_its_file_for_an_hour(tmp_path: Path) -> None:
    with credentials_file(tmp_path, b"x"):
        pass
    base = tmp_path / CRED_DIR
    with subprocess.Popen(["sleep", "60"]) as proc:
        try:
            busy = base / _name(proc.pid)
            busy.write_bytes(b"password=busy\n")
            collect_leftovers(tmp_path)
            assert os.listdir(base) == [busy.name]
            now = time.time()
            os.utime(busy, (now - 3700, now - 3700))
            collect_leftovers(tmp_path)  # older than MAX_AGE: removed anyway
            assert os.listdir(base) == []
        finally:
            proc.kill()


def test_only_files_flexhub_made_are_collected(tmp_path: Path) -> None:
    """Nothing but a regular file of flexhub's own name pattern and owner is removed; a
    symlink is not followed (nor removed), whatever its name."""
    with credentials_file(tmp_path, b"x"):
        pass
    base = tmp_path / CRED_DIR
    dead = 2**22 + 12345  # above pid_max's ceiling: never a live process
    outside = tmp_path / "precious"
    outside.write_text("keep\n")
    (base / _name(dead, "7")).symlink_to(outside)
    (base / f"{dead}-notes.txt").write_text("not ours\n")
    (base / "README").write_text("not ours\n")
    (base / _name(dead, "7").replace(".cred", ".dir")).mkdir()
    foreign = base / _name(dead, "7")
    foreign.write_text("password=another-owner\n")
    os.chown(foreign, 65534, 65534)
    kept = sorted(os.listdir(base))
    ours = base / _name(dead, "7")
    ours.write_text("password=left\n")
    collect_leftovers(tmp_path)
    assert sorted(os.listdir(base)) == kept
    assert outside.read_text() == "keep\n"
