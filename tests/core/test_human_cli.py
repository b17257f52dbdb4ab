"""The human CLI as a person runs it: the installed ``flexhub`` script, in a pseudo-terminal
where the rule depends on one, against kubelet's side of the same rule (no terminal at all).

The rule (flexhub/__main__.py, README "kubelet's calls and people's commands"): a kubelet
operation is always the kubelet protocol; an admin command or option is always the CLI; any
other word is a person's typo when stdin, stdout or stderr is a terminal, and a later
kubelet's operation ("Not supported") when none is.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest

import flexhub
from tests.conftest import KUBELET_ENV, PYTHON, TEST_SITE

FLEXHUB = str(Path(PYTHON).parent / "flexhub")  # the console script pip installed


@pytest.fixture
def node(tmp_path: Path) -> dict[str, object]:
    config = tmp_path / "flexhub.toml"
    config.write_text(f"state_dir = '{tmp_path / 'state'}'\nlog_dir = '{tmp_path / 'log'}'\n")
    env = {**KUBELET_ENV, "PYTHONPATH": str(TEST_SITE), "FLEXHUB_CONFIG": str(config)}
    return {"env": env, "log": tmp_path / "log", "state": tmp_path / "state"}


def in_terminal(
    args: list[str], env: dict[str, str], *, stderr_pipe: bool = False
) -> tuple[int, str, str]:
    """Run ``flexhub ARGS`` with stdin and stdout (and stderr unless ``stderr_pipe``) on a
    pseudo-terminal; returns (exit code, terminal output, piped stderr)."""
    leader, follower = os.openpty()
    proc = subprocess.Popen(
        [FLEXHUB, *args],
        stdin=follower,
        stdout=follower,
        stderr=subprocess.PIPE if stderr_pipe else follower,
        env=env,
        cwd="/",
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError as exc:  # EIO: the last writer closed the terminal
            assert exc.errno == errno.EIO
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    err = proc.stderr.read().decode() if proc.stderr else ""
    code = proc.wait(timeout=60)
    return code, b"".join(chunks).decode().replace("\r\n", "\n"), err


def piped(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """As kubelet runs a driver: stdin /dev/null, stdout and stderr one pipe."""
    return subprocess.run(
        [FLEXHUB, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd="/",
        text=True,
        timeout=60,
        check=False,
    )


def test_a_mistyped_command_in_a_terminal(node: dict[str, object]) -> None:
    env = node["env"]
    assert isinstance(env, dict)
    code, out, err = in_terminal(["valdate", "pv.yaml"], env, stderr_pipe=True)
    assert code == 2
    assert out == ""
    assert err == "flexhub: unknown command 'valdate', did you mean validate?\n"
    assert not Path(str(node["log"])).exists() and not Path(str(node["state"])).exists()


def test_a_mistyped_command_piped_to_a_pager(node: dict[str, object]) -> None:
    """``flexhub stat | less``: stdout is a pipe, but the person's terminal is on stdin."""
    env = node["env"]
    assert isinstance(env, dict)
    leader, follower = os.openpty()
    try:
        proc = subprocess.run(
            [FLEXHUB, "stat"], stdin=follower, capture_output=True, text=True, env=env, check=False
        )
    finally:
        os.close(follower)
        os.close(leader)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "flexhub: unknown command 'stat', did you mean state?\n"
    assert not Path(str(node["log"])).exists()


def test_kubelet_calling_an_unknown_operation_gets_not_supported(node: dict[str, object]) -> None:
    env = node["env"]
    assert isinstance(env, dict)
    for word in ("valdate", "stat", "getvolumeprops"):
        proc = piped([word, "{}"], env)
        assert json.loads(proc.stdout) == {"status": "Not supported"}, proc.stdout
        assert proc.returncode == 1
    log = Path(str(node["log"])) / "flexhub.log"
    assert '"op": "getvolumeprops"' in log.read_text()  # kubelet's calls are logged, as today


def test_a_kubelet_operation_in_a_terminal_is_still_the_protocol(node: dict[str, object]) -> None:
    env = node["env"]
    assert isinstance(env, dict)
    code, out, _ = in_terminal(["init"], env)
    assert code == 0
    assert json.loads(out)["status"] == "Success"


def test_flexhub_alone_prints_help(node: dict[str, object]) -> None:
    env = node["env"]
    assert isinstance(env, dict)
    code, out, _ = in_terminal([], env)
    assert code == 0
    assert out.startswith("Usage: flexhub") and "validate" in out and "--version" in out
    assert piped([], env).stdout.startswith("Usage: flexhub")  # kubelet never calls it so


@pytest.mark.parametrize(
    "args",
    [["-h"], ["--help"], ["validate", "-h"], ["fence", "--help"], ["fence", "key", "-h"], ["help"]],
)
def test_help_everywhere(node: dict[str, object], args: list[str]) -> None:
    env = node["env"]
    assert isinstance(env, dict)
    code, out, _ = in_terminal(args, env)
    assert code == 0, out
    assert out.startswith("Usage: flexhub"), out


def test_version_is_the_packages(node: dict[str, object]) -> None:
    env = node["env"]
    assert isinstance(env, dict)
    code, out, _ = in_terminal(["--version"], env)
    assert code == 0
    assert out == f"flexhub {version('flexhub')}\n"
    assert version("flexhub") == flexhub.__version__


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["validate", "/nonexistent.yaml"],
            "flexhub: /nonexistent.yaml: No such file or directory\n",
        ),
        (
            ["schema", "broken"],
            "flexhub: backend 'broken' failed to import: ImportError: libfrobnicate.so.1: cannot open shared object file\n",
        ),
        (["state", "--config", "/"], "flexhub: cannot read node config /: Is a directory\n"),
        # (fence has a `list` now: the suggestion is click's own, still one line)
        (["fence", "lst"], "flexhub: No such command 'lst'. Did you mean 'list'?\n"),
    ],
)
def test_errors_are_one_line_without_traceback(
    node: dict[str, object], args: list[str], line: str
) -> None:
    env = node["env"]
    assert isinstance(env, dict)
    code, out, err = in_terminal(args, env, stderr_pipe=True)
    assert code != 0
    assert (out, err) == ("", line)


def test_backends_hides_import_tracebacks_unless_debug(node: dict[str, object]) -> None:
    env = node["env"]
    assert isinstance(env, dict)
    code, out, err = in_terminal(["backends"], env, stderr_pipe=True)
    assert code == 1
    assert "broken" in out and "BROKEN" in out
    assert "Traceback" not in out + err
    code, out, err = in_terminal(["--debug", "backends"], env, stderr_pipe=True)
    assert "Traceback" in err and "libfrobnicate" in err


def test_an_operations_help_at_a_terminal(node: dict[str, object]) -> None:
    env = node["env"]
    assert isinstance(env, dict)
    code, out, _ = in_terminal(["mount", "--help"], env)
    assert code == 0
    assert out.startswith("Usage: flexhub mount <podVolumeDir> <json>\n")
    proc = piped(["mount", "--help"], env)  # kubelet never passes an option: as today
    assert json.loads(proc.stdout)["status"] == "Failure"
