"""Self-test of the VM rig: the guest boots and runs commands, the guest NFS
server serves v3 and v4.2 to the kernel client, the LIO target enforces
discovery and session CHAP against open-iscsi, two portals both work (and
multipathd joins them), LUNs grow, and closing a VM leaves no qemu behind."""

from __future__ import annotations

import os
import time

import pytest

from tests.rig import services
from tests.rig.fixtures import require_rig
from tests.rig.services import Chap, MiB
from tests.rig.vm import VM, CommandError

pytestmark = pytest.mark.vm


def test_boot_and_run(vm: VM) -> None:
    assert vm.run(["uname", "-r"]).stdout.strip() == vm.kernel
    res = vm.run(["/bin/sh", "-c", "echo out; echo err >&2; exit 3"], check=False)
    assert (res.rc, res.stdout, res.stderr) == (3, "out\n", "err\n")
    with pytest.raises(CommandError):
        vm.run(["false"])
    res = vm.run(["sleep", "30"], timeout=1, check=False)
    assert res.timed_out and res.rc == 124
    assert vm.run(["cat"], input="hello").stdout == "hello"
    # The checkout is visible at the same path, read-only underneath an overlay.
    assert vm.run(["test", "-f", __file__], check=False).rc == 0


def test_the_guest_runs_flexhub_through_the_runtime(vm: VM) -> None:
    """The session VM runs flexhub as a node does: through the relocatable runtime built from
    this checkout, whose shim starts the runtime's interpreter with its own loader (not the
    test interpreter's editable install, whose ``site`` start-up costs a guest call about
    0.7 s more)."""
    assert vm.runtime and os.path.isfile(f"{vm.runtime}/flexhub-runtime.json")
    driver = vm.install_flexhub("/var/lib/rig-runtime/plugins")
    shim = vm.read_file(driver).decode()
    assert f"{vm.runtime}/lib/" in shim and vm.python not in shim, shim
    rc, out = vm.call_driver(driver, ["init"])
    assert rc == 0 and '"status":"Success"' in out.replace(" ", ""), out
    where = vm.run([vm.flexhub_python, "-c", "import flexhub, sys; print(flexhub.__file__)"])
    assert where.stdout.startswith(f"{vm.runtime}/"), where.stdout


@pytest.mark.parametrize("version", ["3", "4.2"])
def test_nfs_mount(vm: VM, version: str) -> None:
    server = services.start_nfs_server(vm)
    mnt = f"/mnt/nfs-{version}"
    try:
        vm.run(["mkdir", "-p", mnt])
        vm.run(
            ["mount", "-t", "nfs", "-o", f"vers={version}", server.source(version), mnt], timeout=60
        )
        try:
            mounts = vm.run(["cat", "/proc/mounts"]).stdout
            line = next(ln for ln in mounts.splitlines() if f" {mnt} " in ln)
            assert f"vers={version}" in line
            vm.write_file(f"{mnt}/hello-{version}", b"round trip\n")
            assert vm.read_file(f"{server.local_dir}/hello-{version}") == b"round trip\n"
        finally:
            vm.run(["umount", mnt], timeout=60)
    finally:
        services.stop_nfs_server(vm)


def test_iscsi_chap(vm: VM) -> None:
    dchap = Chap("disc-user", "disc-secret-123")
    schap = Chap("sess-user", "sess-secret-456")
    target = services.iscsi_target(
        vm, lun_sizes=[32 * MiB, 48 * MiB], discovery_chap=dchap, session_chap=schap
    )
    try:
        bad = services.discover(
            vm, target.portal, Chap(dchap.userid, "wrong-password1"), check=False
        )
        assert bad.rc != 0 and target.iqn not in bad.stdout
        good = services.discover(vm, target.portal, dchap)
        assert target.iqn in good.stdout

        bad = services.login(
            vm, target.iqn, target.portal, Chap(schap.userid, "wrong-password2"), check=False
        )
        assert bad.rc != 0
        assert "authorization failure" in bad.output
        services.login(vm, target.iqn, target.portal, schap)
        disks = services.session_disks(vm, target.iqn)
        assert len(disks) == 2
        sizes = sorted(int(vm.run(["blockdev", "--getsize64", d]).stdout) for d in disks)
        assert sizes == [32 * MiB, 48 * MiB]
        link = f"/dev/disk/by-path/ip-{target.portal}-iscsi-{target.iqn}-lun-1"
        assert vm.run(["readlink", "-f", link]).stdout.strip() in disks
        # I/O through the initiator reaches the backing file.
        vm.run(
            [
                "dd",
                "if=/dev/urandom",
                f"of={disks[0]}",
                "bs=4k",
                "count=4",
                "oflag=direct",
                "status=none",
            ]
        )
        services.logout(vm, target.iqn)
        assert services.session_disks(vm, target.iqn) == []
    finally:
        services.reset_iscsi(vm)


def test_iscsi_two_portals_and_grow(vm: VM) -> None:
    portals = ["127.0.0.1:3260", "127.0.0.2:3260"]
    target = services.iscsi_target(vm, lun_sizes=[16 * MiB], portals=portals)
    services.start_multipathd(vm)
    try:
        for portal in portals:
            assert target.iqn in services.discover(vm, portal).stdout
            services.login(vm, target.iqn, portal)
        sessions = vm.run(["iscsiadm", "-m", "session"]).stdout
        assert all(p in sessions for p in portals)
        disks = services.session_disks(vm, target.iqn)
        assert len(disks) == 2  # one LUN seen through two paths
        vm.run(["udevadm", "settle"], check=False)
        maps = vm.run(["multipath", "-ll"]).stdout
        assert "LIO-ORG" in maps and all(d.removeprefix("/dev/") in maps for d in disks)

        services.grow_lun(vm, target, 0, 24 * MiB)
        vm.run(["iscsiadm", "-m", "session", "-R"])
        vm.run(["udevadm", "settle"], check=False)
        for disk in disks:
            assert int(vm.run(["blockdev", "--getsize64", disk]).stdout) == 24 * MiB

        services.portal_down(vm, target, portals[1])
        assert services.discover(vm, portals[1], check=False).rc != 0
        assert target.iqn in services.discover(vm, portals[0]).stdout
        services.portal_up(vm, target, portals[1])
        assert target.iqn in services.discover(vm, portals[1]).stdout
    finally:
        services.stop_multipathd(vm)
        services.reset_iscsi(vm)


def test_close_leaves_no_qemu() -> None:
    require_rig()
    other = VM()
    other.start()
    pid = other.pid
    assert pid is not None and os.path.exists(f"/proc/{pid}")
    other.close()
    other.close()  # idempotent
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}")
