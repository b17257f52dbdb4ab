"""run_in_host tells 'the driver could not be started' from 'the driver ran' by an error pipe
the trampoline closes on exec, never by the driver's own output: a driver that ran, exited
127 and printed anything is its own reply, not an OSError nor a crash of run_in_host. Found
by a hostile review (2026-12-06) of the first trampoline, which read a marker from the
output."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flexhub.admin.deploy import run_in_host
from tests.conftest import needs_root

pytestmark = [needs_root]


def driver(where: Path, output: bytes) -> str:
    """A driver that writes ``output`` and exits 127 (as a wrapper whose own exec failed)."""
    path = where / "driver"
    path.write_text(f"#!{sys.executable} -I\nimport os\nos.write(1, {output!r})\nos._exit(127)\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize(
    "output",
    [b"\0flexhub-exec-failed 2", b"\0flexhub-exec-failed not-a-number\n"],
    ids=["errno-like", "text"],
)
def test_a_driver_that_ran_is_never_reported_as_unstartable(
    trusted_dir: Path, output: bytes
) -> None:
    host = trusted_dir / "host"
    host.symlink_to("/")  # a host root other than "/"
    program = driver(trusted_dir, output)
    # the driver ran: its own status and output are the answer, whatever they hold
    assert run_in_host(host, [program, "init"]) == (127, output)


def test_a_relative_host_root_is_the_caller_s(
    trusted_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trampoline now starts with cwd "/" (subprocess's ``cwd``) and chroots into
    ``argv[1]`` there, so a relative host root (``flexhub doctor --host-root host``) is
    resolved against "/" instead of the caller's directory, where ``check_runnable`` just
    checked it: the driver checked is not the driver run (or none is). The preexec_fn
    chrooted before its chdir("/")."""
    (trusted_dir / "host").symlink_to("/")
    monkeypatch.chdir(trusted_dir)
    assert run_in_host(Path("host"), ["/bin/echo", "reply"]) == (0, b"reply\n")
