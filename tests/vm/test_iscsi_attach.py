"""What an iSCSI attach leaves on a real node, checked by its effect (real kernel, LIO, the
installed driver), where the host tests in ``tests/iscsi/`` could only read a fake runner's
argv: the node record's settings, which LUNs were scanned, the logout (and the node records'
removal) after a failed attach, the session kept for another LUN, and refusals that log in
nowhere (a missing iface, every portal down).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from flexhub_iscsi._options import dedicated_iface

from tests.rig import services
from tests.rig.vm import VM
from tests.vm.test_iscsi import Kubelet, node_records, read, sessions, write

pytest_plugins = ["tests.rig.fixtures"]

MiB = 1024 * 1024
ROOT = "/var/lib/flexhub-iscsi-attach-test"
#: Short, so that a LUN that never appears costs seconds, not the default 20.
DEVICE_TIMEOUT = 8


@pytest.fixture(scope="module")
def kubelet(vm: VM) -> Iterator[Kubelet]:
    vm.run(["mkdir", "-p", ROOT])
    config = f"{ROOT}/flexhub.toml"
    vm.write_file(
        config,
        f'state_dir = "{ROOT}/state"\nlog_dir = "{ROOT}/log"\nlog_level = "debug"\n'
        # every portal down waits login_timeout per portal: short, the test is the refusal
        f"[iscsi]\ndevice_timeout = {DEVICE_TIMEOUT}\nlogin_timeout = 15\n",
    )
    yield Kubelet(vm, vm.install_flexhub(f"{ROOT}/plugins", config=config))


@pytest.fixture
def clean(vm: VM) -> Iterator[None]:
    yield
    services.reset_iscsi(vm)


def scanned_luns(vm: VM, iqn: str) -> list[int]:
    """The LUN numbers of the SCSI disks in ``iqn``'s sessions (from their H:C:T:L)."""
    vm.run(["udevadm", "settle", "--timeout=30"], check=False)
    script = (
        "for s in /sys/class/iscsi_session/session*; do "
        '[ "$(cat $s/targetname)" = "$1" ] || continue; '
        'for b in $s/device/target*/*/block/*; do [ -e "$b" ] && echo ${b%/block/*}; done; '
        "done; true"
    )
    out = vm.run(["/bin/sh", "-c", script, "sh", iqn]).stdout.split()
    return sorted(int(os.path.basename(path).rsplit(":", 1)[-1]) for path in out)


def record_settings(vm: VM, iqn: str, portal: str) -> dict[str, str]:
    out = vm.run(["iscsiadm", "-m", "node", "-T", iqn, "-p", portal]).stdout
    return dict(
        (name.strip(), value.strip())
        for name, sep, value in (line.partition(" = ") for line in out.splitlines())
        if sep
    )


def test_attach_sets_the_record_and_scans_only_its_lun(
    vm: VM, kubelet: Kubelet, clean: None
) -> None:
    """Replaces the argv transcript of ``test_attach_sequence_without_chap``: the node record
    says manual start-up and manual scan, no CHAP, and of the target's three LUNs only the
    one asked for has a disk on the node. A node record of another target behind the portal
    that was there before (an operator's discovery) is kept."""
    target = services.iscsi_target(vm, lun_sizes=[16 * MiB, 32 * MiB, 16 * MiB])
    other = services.iscsi_target(vm)
    services.discover(vm, target.portal)  # records of both targets, made by someone else
    assert node_records(vm, other.iqn) != []
    directory, reply = kubelet.mount(target, 1, pv="pv-one")
    assert reply == {"status": "Success"}
    assert node_records(vm, other.iqn) != []
    assert len(sessions(vm, target.iqn)) == 1
    assert scanned_luns(vm, target.iqn) == [1]
    settings = record_settings(vm, target.iqn, target.portal)
    assert settings["node.startup"] == "manual", settings
    assert settings["node.session.scan"] == "manual", settings
    assert settings["node.session.auth.authmethod"] == "None", settings
    assert kubelet.unmount(directory) == {"status": "Success"}
    assert sessions(vm, target.iqn) == [] and node_records(vm, target.iqn) == []
    assert node_records(vm, other.iqn) != []


def test_initiator_name_has_its_own_iface_until_the_unmount(
    vm: VM, kubelet: Kubelet, clean: None
) -> None:
    """Replaces the argv checks of ``test_initiator_name_makes_and_removes_a_dedicated_iface``:
    with ``initiatorName`` the session really logs in under that name (the target accepts
    only it), through an iface flexhub made, which is gone after the unmount."""
    name = "iqn.2026-01.io.flexhub:attach-tenant"
    iface = dedicated_iface("default", name)
    target = services.iscsi_target(vm, initiators=[name])
    directory, reply = kubelet.mount(target, initiatorName=name)
    assert reply == {"status": "Success"}
    shown = vm.run(["iscsiadm", "-m", "iface", "-I", iface]).stdout
    assert f"iface.initiatorname = {name}" in shown.splitlines(), shown
    assert "iface.transport_name = tcp" in shown.splitlines(), shown
    names = vm.sh(
        "for s in /sys/class/iscsi_session/session*; do"
        f' [ "$(cat $s/targetname)" = {target.iqn} ] && cat $s/initiatorname $s/ifacename; done'
    ).stdout.split()
    assert names == [name, iface], names
    write(vm, directory, "tenant", "ok")
    assert kubelet.unmount(directory) == {"status": "Success"}
    assert sessions(vm, target.iqn) == [] and node_records(vm, target.iqn) == []
    gone = vm.run(["iscsiadm", "-m", "iface", "-I", iface], check=False)
    assert gone.rc != 0, gone.output


def test_a_lun_that_never_appears_alone(vm: VM, kubelet: Kubelet, clean: None) -> None:
    """Replaces the argv check of ``test_missing_lun_times_out_and_logs_out``: the failed
    attach logs out and deletes the node records it made."""
    target = services.iscsi_target(vm, lun_sizes=[16 * MiB])
    missing, reply = kubelet.mount(target, 5, pv="pv-missing")
    assert reply["status"] == "Failure"
    assert f"did not appear within {DEVICE_TIMEOUT}" in str(reply["message"]), reply
    assert sessions(vm, target.iqn) == [] and node_records(vm, target.iqn) == []
    assert vm.run(["mountpoint", "-q", missing], check=False).rc != 0


def test_a_lun_that_never_appears_beside_a_mounted_one(
    vm: VM, kubelet: Kubelet, clean: None
) -> None:
    """Replaces the argv check of ``test_failed_attach_keeps_session_of_other_lun``: beside a
    mounted LUN of the target, the failed attach keeps the session and the mounted LUN still
    works."""
    target = services.iscsi_target(vm, lun_sizes=[16 * MiB])
    zero, reply = kubelet.mount(target, 0, pv="pv-zero")
    assert reply == {"status": "Success"}
    missing, reply = kubelet.mount(target, 5, pv="pv-missing")
    assert reply["status"] == "Failure", reply
    assert f"did not appear within {DEVICE_TIMEOUT}" in str(reply["message"]), reply
    assert len(sessions(vm, target.iqn)) == 1 and node_records(vm, target.iqn) != []
    write(vm, zero, "still", "works")
    vm.run(["sync"])
    assert read(vm, zero, "still") == "works"
    assert vm.run(["mountpoint", "-q", missing], check=False).rc != 0
    assert kubelet.unmount(zero) == {"status": "Success"}
    assert sessions(vm, target.iqn) == [] and node_records(vm, target.iqn) == []


def test_a_missing_iface_logs_in_nowhere(vm: VM, kubelet: Kubelet, clean: None) -> None:
    """Replaces the argv check of ``test_missing_iface_is_invalid_options``: an
    ``iscsiInterface`` that does not exist fails naming it, and nothing logs in (no falling
    back to the default iface)."""
    target = services.iscsi_target(vm)
    directory, reply = kubelet.mount(target, iscsiInterface="eth9")
    assert reply["status"] == "Failure" and "eth9" in str(reply["message"]), reply
    assert sessions(vm, target.iqn) == [] and node_records(vm, target.iqn) == []
    assert vm.run(["mountpoint", "-q", directory], check=False).rc != 0


def test_every_portal_down_logs_in_nowhere(vm: VM, kubelet: Kubelet, clean: None) -> None:
    """Replaces the argv check of ``test_every_portal_failing_is_a_failure_naming_each``: a
    target whose every portal is down fails naming each portal, with no session and no node
    record left."""
    target = services.iscsi_target(vm, portals=["127.0.0.1:3260", "127.0.0.2:3260"])
    for portal in target.portals:
        services.portal_down(vm, target, portal)
    directory, reply = kubelet.mount(target, portals="127.0.0.2:3260")
    assert reply["status"] == "Failure", reply
    message = str(reply["message"])
    assert "127.0.0.1:3260" in message and "127.0.0.2:3260" in message, message
    assert sessions(vm, target.iqn) == [] and node_records(vm, target.iqn) == []
    assert vm.run(["mountpoint", "-q", directory], check=False).rc != 0
