"""pytest plugin of the VM rig: the session-scoped ``vm`` fixture and the
``vm`` marker.  Load it with ``pytest_plugins = ["tests.rig.fixtures"]``.

The fixture skips (one line) only where the machine cannot run the rig at all
(not root, no qemu, no kernel).  With ``CI=true`` it fails instead of
skipping: the CI machine must run the VM tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.rig import services
from tests.rig.vm import COMMAND_STATS, VM, RigError, unavailable_reason
from tests.runtime_cache import cached_runtime


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vm: runs inside the qemu VM rig (real kernel NFS/iSCSI, needs root)"
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses the ``vm`` fixture with ``vm``."""
    for item in items:
        if "vm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vm)


def _on_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_rig() -> None:
    """Skip the calling test if this machine cannot run the rig (fail on CI)."""
    reason = unavailable_reason()
    if reason:
        if _on_ci():
            pytest.fail(f"CI=true but {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def vm() -> Iterator[VM]:
    """A booted guest (node set up: modules, udevd, iscsid), shared by the
    session and always killed at the end."""
    require_rig()
    # Built (or found) before the boot: the guest sees the host's files as they were then.
    machine = VM(runtime=str(cached_runtime()))
    try:
        machine.start()
        services.setup_node(machine)
    except RigError as exc:
        machine.close()
        pytest.fail(f"VM rig failed to start: {exc}", pytrace=False)
    except BaseException:
        machine.close()
        raise
    try:
        yield machine
    finally:
        _record_busiest(machine)
        machine.close()


#: The guest's processes by CPU time when its session ended (printed in the summary): what a
#: session left running, and what ate the one emulated core, are seen in every CI log.
GUEST_PROCESSES: list[str] = []


def _record_busiest(machine: VM) -> None:
    try:
        found = machine.run(
            ["ps", "-eo", "pid,ppid,time,etimes,args", "--sort=-time"], timeout=60, check=False
        )
    except (RigError, OSError) as exc:  # a guest already gone says so, and the session ends
        GUEST_PROCESSES.append(f"(no process list: {exc})")
        return
    GUEST_PROCESSES.extend(line[:160] for line in found.stdout.splitlines()[:16])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """What the session's guests ran, by kind: the VM tier's cost per call, measured; and
    their busiest processes at the end."""
    if GUEST_PROCESSES:
        terminalreporter.section("guest processes by CPU time at the session's end")
        for line in GUEST_PROCESSES:
            terminalreporter.write_line(line)
    if not COMMAND_STATS:
        return
    terminalreporter.section("guest commands (count, seconds in the guest, mean)")
    kinds = [(k, v) for k, v in COMMAND_STATS.items() if not k.startswith(" ")]
    for kind, (count, seconds) in sorted(kinds, key=lambda kv: -kv[1][1]):
        terminalreporter.write_line(
            f"{kind:40} {count:5} {seconds:8.1f} s {seconds / count:6.2f} s"
        )
        if kind == "other":  # its ten costliest programs, indented
            programs = [(k, v) for k, v in COMMAND_STATS.items() if k.startswith(" ")]
            for program, (n, secs) in sorted(programs, key=lambda kv: -kv[1][1])[:10]:
                terminalreporter.write_line(f"{program:40} {n:5} {secs:8.1f} s {secs / n:6.2f} s")
