"""run_in_host tells 'the driver could not be started' from 'the driver ran' only by
subprocess's own exec error report, never by the driver's output: a driver that ran, exited
127 and printed anything is its own reply, not an OSError nor a crash of run_in_host. Found
by a hostile review (2026-12-06) of a trampoline that read a marker from the output (since
removed: the node runtime's Python cannot be started as a second interpreter without its
loader)."""

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
    """run_in_host starts its child in cwd "/" (subprocess's ``cwd``) before the chroot, so a
    relative host root (``flexhub doctor --host-root host``) would be resolved against "/"
    instead of the caller's directory, where ``check_runnable`` just checked it: the driver
    checked would not be the driver run (or none). The root is made absolute first."""
    (trusted_dir / "host").symlink_to("/")
    monkeypatch.chdir(trusted_dir)
    assert run_in_host(Path("host"), ["/bin/echo", "reply"]) == (0, b"reply\n")
