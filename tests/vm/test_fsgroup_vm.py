"""fsGroup in the VM, through the installed driver: NFS never changes ownership, as ``stat`` on
the server side shows.

A block volume's fsGroup is the core's (flexhub/node/volumes.py, whatever the block backend):
the root only, a read-only mount unchanged and the legacy key are shown on real loop devices in
tests/loopfile/test_fsgroup_e2e.py, and the group with g+rwxs on an iSCSI volume's root by the
kit's sequence check (tests/vm/test_kit_iscsi.py, fs_group 3000)."""

from __future__ import annotations

import uuid

from tests.rig.vm import VM
from tests.vm.test_nfs import Rig, rig, share  # noqa: F401 (fixture)

OK = {"status": "Success"}


def stat(vm: VM, *paths: str) -> list[str]:
    return vm.run(["stat", "-c", "%g %a", *paths]).stdout.split("\n")[: len(paths)]


def test_nfs_never_chowns(rig: Rig) -> None:  # noqa: F811
    name = f"fsg-{uuid.uuid4().hex[:8]}"
    server_dir = rig.server_path(name)
    rig.sh(f"mkdir -m 0755 {server_dir} && echo x > {server_dir}/file && chown -R 0:0 {server_dir}")
    before = stat(rig.vm, server_dir, f"{server_dir}/file")
    assert before == ["0 755", "0 644"]
    for key, gid in (
        ("kubernetes.io/mounterArgs.FsGroup", "4321"),
        ("kubernetes.io/fsGroup", "777"),
    ):
        target = rig.pod_dir()
        reply, _ = rig.mount(target, {**share(rig, "4.2"), "subPath": name, key: gid})
        assert reply == OK
        assert stat(rig.vm, server_dir, f"{server_dir}/file") == before  # on the server
        assert rig.unmount(target)[0] == OK
