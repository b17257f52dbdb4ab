"""The credentials file: private, exclusive, never through a symlink, always removed."""

from __future__ import annotations

import os
import stat
import subprocess
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


def test_leftovers_of_dead_processes_are_collected(tmp_path: Path) -> None:
    with credentials_file(tmp_path, b"x"):
        pass
    base = tmp_path / CRED_DIR
    proc = subprocess.Popen(["true"])
    proc.wait()
    gone = base / f"{proc.pid}-abc.cred"
    gone.write_bytes(b"password=left\n")
    alive = base / f"{os.getppid()}-def.cred"
    alive.write_bytes(b"password=busy\n")
    collect_leftovers(tmp_path)
    assert sorted(os.listdir(base)) == [alive.name]
    old = 1_000_000_000
    os.utime(alive, (old, old))
    collect_leftovers(tmp_path)
    assert os.listdir(base) == []
