"""A credentials file left by a cifs ``mount`` that was SIGKILLed is removed by the pod's
``unmount`` through the real driver, also when nothing was ever mounted on the directory or
the directory is gone (the core calls the backend's leftover collection on every unmount of
its volumes). The kill is real (tests/cifs/killed_mount.py); no CIFS server is involved, so
this is a host test."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_flexhub


def _killed_mount(state: Path, target: Path) -> list[str]:
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "cifs" / "killed_mount.py"), str(state), str(target)],
        cwd=REPO,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc
    return sorted(os.listdir(state / "cifs-creds"))


@pytest.mark.parametrize("directory", ["never mounted", "gone"])
def test_unmount_removes_the_credentials_file_of_a_killed_mount(
    tmp_path: Path, directory: str
) -> None:
    state = tmp_path / "state"
    config = tmp_path / "flexhub.toml"
    config.write_text(f'state_dir = "{state}"\nlog_dir = "{tmp_path / "log"}"\n')
    target = tmp_path / "pods" / "uid-1" / "volumes" / "k8s~flexhub" / "pv-smb"
    left = _killed_mount(state, target)
    assert len(left) == 1 and re.fullmatch(r"\d+-\d+-[0-9a-f]{16}\.cred", left[0]), left
    assert "left-behind-pw" in (state / "cifs-creds" / left[0]).read_text()
    assert os.listdir(state / "pods")  # the pod record the killed call wrote
    if directory == "gone":
        target.rmdir()

    reply = run_flexhub(["unmount", str(target)], config)
    assert reply.status == "Success", reply
    assert os.listdir(state / "cifs-creds") == []
    assert os.listdir(state / "pods") == []
