"""The command runner: no shell, no inherited stdio, group kill on timeout, secrets masked."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flexhub.errors import CommandError, CommandTimeout
from flexhub.node.runner import RecordingRunner, Result, SubprocessRunner, mask


def test_mask_hides_secret_values_and_iscsiadm_passwords() -> None:
    argv = [
        "iscsiadm",
        "-m",
        "node",
        "-n",
        "node.session.auth.password",
        "-v",
        "s3cr3t",
        "-n",
        "node.session.auth.username",
        "-v",
        "alice",
    ]
    assert mask(argv) == [
        "iscsiadm",
        "-m",
        "node",
        "-n",
        "node.session.auth.password",
        "-v",
        "***",
        "-n",
        "node.session.auth.username",
        "-v",
        "alice",
    ]
    assert mask(["mount", "-o", "user=bob,password=p,ro", "//s/x", "/m"]) == [
        "mount",
        "-o",
        "user=bob,password=***,ro",
        "//s/x",
        "/m",
    ]
    assert mask(["tool", "--password", "pw", "x"]) == ["tool", "--password", "***", "x"]
    assert mask(["tool", "prefix-TOPSECRET-suffix"], ["TOPSECRET"]) == ["tool", "prefix-***-suffix"]


def test_runs_without_shell_with_devnull_stdin_and_minimal_env() -> None:
    run = SubprocessRunner(timeout=10)
    assert run(["echo", "$HOME", "*"]).stdout == "$HOME *\n"  # no shell expansion
    assert run(["cat"]).stdout == ""  # stdin is /dev/null: returns at once
    env = run(["env"], env={"EXTRA": "1"}).stdout.splitlines()
    assert "PATH=/usr/sbin:/usr/bin:/sbin:/bin" in env and "LC_ALL=C" in env
    assert "EXTRA=1" in env and not any(line.startswith("HOME=") for line in env)
    # Its own session, hence its own process group.
    out = run(["sh", "-c", "ps -o sid= -p $$; ps -o pgid= -p $$; echo $$"]).stdout.split()
    assert out[0] == out[1] == out[2]


def test_failure_names_command_and_exit_status_with_secrets_masked() -> None:
    run = SubprocessRunner(timeout=10)
    with pytest.raises(CommandError) as info:
        run(["sh", "-c", "echo bad pass=$0 >&2; exit 3", "hunter2"], secrets=["hunter2"])
    message = str(info.value)
    assert message.startswith("sh -c")
    assert "failed (exit 3)" in message and "bad pass=***" in message
    assert "hunter2" not in message and info.value.returncode == 3
    assert run(["false"], check=False).returncode == 1
    with pytest.raises(CommandError, match="could not start"):
        run(["/nonexistent/tool"])


def test_debug_log_is_masked(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="flexhub.node.runner")
    SubprocessRunner(timeout=10)(["echo", "topsecret"], secrets=["topsecret"])
    assert "echo *** exited 0" in caplog.text and "topsecret" not in caplog.text


def test_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child"
    run = SubprocessRunner(timeout=10)
    started = time.monotonic()
    with pytest.raises(CommandTimeout, match=r"timed out after 0\.5s"):
        run(["sh", "-c", f"sleep 30 & echo $! > {pidfile}; wait"], timeout=0.5)
    assert time.monotonic() - started < 3
    child = int(pidfile.read_text())
    time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for init to reap it does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_timeout_returns_even_if_an_escaped_grandchild_holds_the_pipes(tmp_path: Path) -> None:
    pidfile = tmp_path / "escaped"
    run = SubprocessRunner(timeout=10)
    started = time.monotonic()
    try:
        with pytest.raises(CommandTimeout):
            # setsid puts the grandchild out of our group; it keeps stdout open.
            run(
                ["sh", "-c", f"setsid sh -c 'echo $$ > {pidfile}; exec sleep 30' & wait"],
                timeout=0.5,
            )
        assert time.monotonic() - started < 5
    finally:
        if pidfile.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)


FREEZER = Path("/sys/fs/cgroup/freezer")

#: The command: joins the freezer group, then becomes ``sleep`` (the readiness the test waits
#: for before it freezes the group: a shell starts in milliseconds, Python did not).
JOIN_AND_SLEEP = 'echo $$ > "$1/cgroup.procs" && exec sleep 60'


@pytest.fixture
def freezer_cgroup() -> Iterator[Path]:
    """A cgroup-v1 freezer group: a frozen task is in uninterruptible sleep (state D) and a
    SIGKILL takes effect only once it is thawed, like I/O to a multipath map with no path."""
    if os.geteuid() != 0 or not FREEZER.is_dir():
        pytest.skip("needs root and the cgroup-v1 freezer")
    cgroup = FREEZER / f"flexhub-test-{os.getpid()}"
    try:
        cgroup.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a freezer cgroup: {exc}")
    try:
        yield cgroup
    finally:
        (cgroup / "freezer.state").write_text("THAWED")
        for _ in range(100):  # a killed task exits once thawed
            pids = (cgroup / "cgroup.procs").read_text().split()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.05)
        cgroup.rmdir()


def test_a_killed_command_stuck_in_the_kernel_does_not_hang_the_call(
    freezer_cgroup: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import threading

    run = SubprocessRunner(timeout=10)
    outcome: list[BaseException] = []
    bound = 5.0  # the command's timeout: the test freezes it well before

    def call() -> None:
        try:
            run(["sh", "-c", JOIN_AND_SLEEP, "sh", str(freezer_cgroup)], timeout=bound)
        except BaseException as exc:
            outcome.append(exc)

    with caplog.at_level(logging.ERROR):
        thread = threading.Thread(target=call, daemon=True)
        started = time.monotonic()
        thread.start()
        pid = _wait_for_sleep_in(freezer_cgroup, started + bound)
        (freezer_cgroup / "freezer.state").write_text("FROZEN")
        _wait_until(lambda: (freezer_cgroup / "freezer.state").read_text().strip() == "FROZEN")
        assert time.monotonic() - started < bound, "frozen only after the command's timeout"
        thread.join(60)  # generous; without a bound on the reap it would wait for ever
        returned = not thread.is_alive()
        assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "D"
        (freezer_cgroup / "freezer.state").write_text("THAWED")
        thread.join(60)
    assert returned
    assert len(outcome) == 1 and isinstance(outcome[0], CommandTimeout)
    assert f"pid {pid} is stuck in the kernel and was left behind" in str(outcome[0])
    assert f"pid {pid} did not exit" in caplog.text


def _wait_until(done: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the event did not come"
        time.sleep(0.01)


def _wait_for_sleep_in(cgroup: Path, deadline: float) -> int:
    """The pid of the command once it is in ``cgroup`` and has become ``sleep``; fails at
    ``deadline``."""
    while time.monotonic() < deadline:
        pids = (cgroup / "cgroup.procs").read_text().split()
        if pids and Path(f"/proc/{pids[0]}/comm").read_text().strip() == "sleep":
            return int(pids[0])
        time.sleep(0.01)
    raise AssertionError("the command never joined the freezer group and became sleep")


def test_recording_runner_scripts_by_longest_prefix() -> None:
    runner = RecordingRunner()
    runner.answer("blkid", rc=2)
    runner.answer("blkid", "-p", "/dev/x", rc=0, stdout="TYPE=ext4\n")
    runner.script[("boom",)] = CommandError("boom")
    assert runner(["blkid", "-p", "/dev/x"]).stdout == "TYPE=ext4\n"
    assert runner(["blkid", "/dev/y"], check=False).returncode == 2
    assert runner(["other"]) == Result(("other",), 0, "", "")
    with pytest.raises(CommandError):
        runner(["boom"])
    runner(["login", "pw"], secrets=["pw"])
    assert runner.calls[-1] == ["login", "***"]


def test_input_goes_to_stdin_never_to_the_command_line(tmp_path: Path) -> None:
    """``input=``: how a secret reaches a command (the iSCSI provisioner's ssh); the
    recording runner keeps it masked."""
    secret = "Stdin-Only-Pw-8qW"
    runner = SubprocessRunner(timeout=10)
    script = tmp_path / "echo.py"
    script.write_text("import sys\nprint(sys.stdin.read()[::-1])\n")
    result = runner(["python3", str(script)], input=f"pw={secret}", secrets=[secret])
    assert result.stdout.splitlines()[0] == f"pw={secret}"[::-1]
    assert secret not in " ".join(result.argv)
    recording = RecordingRunner()
    recording(["ssh", "host"], input=f"pw={secret}\n", secrets=[secret])
    recording(["true"])
    assert recording.inputs == ["pw=***\n", None]
