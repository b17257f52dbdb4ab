"""The call deadline (``call_timeout``): no call, and so none of its locks, outlives it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_node_runner import freezer_cgroup

from flexhub.node.locks import lock
from tests.conftest import run_flexhub

__all__ = ["freezer_cgroup"]  # the fixture

#: The stuck command: it joins the freezer group and freezes it, itself included (a process
#: cannot be killed out of a frozen cgroup-v1 group: as stuck as a command in state D). A
#: shell, not Python: it must be frozen before the call's 2 s deadline, and a Python start-up
#: beside CI's other sessions once took longer than the 1 s deadline this test had.
FREEZE_SELF = 'echo $$ > "$1/cgroup.procs" && echo FROZEN > "$1/freezer.state" && sleep 60'

REPO = Path(__file__).resolve().parents[2]

HOLDER = """
import sys, time
from pathlib import Path
from flexhub.node.locks import lock
with lock(Path(sys.argv[1]), sys.argv[2], sys.argv[3], 5):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def hold() -> Iterator[object]:
    procs: list[subprocess.Popen[str]] = []

    def start(lock_dir: Path, kind: str, key: str) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(lock_dir), kind, key],
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_call_waiting_past_call_timeout_answers_failure(tmp_path: Path, hold) -> None:
    # Another call holds the pod directory's lock (as a hung call would); lock_timeout is
    # long, call_timeout short: the call answers at its deadline, naming it.
    config = tmp_path / "flexhub.toml"
    state = tmp_path / "state"
    config.write_text(
        f'state_dir = "{state}"\nlog_dir = "{tmp_path}/log"\nlock_timeout = 20\ncall_timeout = 1\n'
    )
    target = tmp_path / "pod" / "vol"
    target.mkdir(parents=True)
    hold(state / "locks", "pod", str(target))
    reply = run_flexhub(
        ["mount", str(target), json.dumps({"backend": "echo", "tag": "t1"})], config
    )
    assert reply.returncode == 1
    assert reply.status == "Failure"
    assert "mount ran past call_timeout (1s)" in reply.message
    assert not os.path.ismount(target)


STUCK_CALL = """
import os, sys
from pathlib import Path
from flexhub.driver.deadline import call_deadline
from flexhub.errors import CallTimeout
from flexhub.node.locks import lock
from flexhub.node.runner import SubprocessRunner
locks, cgroup, script = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
try:
    with call_deadline(2, 60, "unmount", lambda: os._exit(3)):
        with lock(locks, "volume", "vol-1", 5):
            # a command bounded by its own long timeout, stuck in the kernel when killed
            SubprocessRunner(100)(["/bin/sh", "-c", script, "sh", cgroup])
except CallTimeout as exc:
    print(exc, flush=True)
print("returned", flush=True)
"""


def test_a_call_stuck_on_a_command_in_the_kernel_releases_its_locks_at_the_deadline(
    tmp_path: Path, freezer_cgroup: Path
) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            STUCK_CALL,
            str(tmp_path / "locks"),
            str(freezer_cgroup),
            FREEZE_SELF,
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "unmount ran past call_timeout (2s)" in proc.stdout
    assert proc.stdout.endswith("returned\n")
    # The command is still stuck (frozen in the kernel) but the call and its lock are gone.
    pids = (freezer_cgroup / "cgroup.procs").read_text().split()
    assert len(pids) == 1, f"the command was not frozen before the deadline: {pids}"
    pid = int(pids[0])
    assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "D"
    with lock(tmp_path / "locks", "volume", "vol-1", 1):
        pass


WEDGED = """
import os, signal, time
from flexhub.driver.deadline import call_deadline
def expire():
    print("expired", flush=True)
    os._exit(3)
with call_deadline(0.5, 0.5, "mount", expire):
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # no handler can run now
    time.sleep(60)
print("not reached", flush=True)
"""


def test_a_call_that_cannot_unwind_is_ended_by_the_watchdog() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", WEDGED],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=60,
        check=False,
    )
    assert (proc.returncode, proc.stdout) == (3, "expired\n"), proc.stderr
