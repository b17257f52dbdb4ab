"""fsGroup in the VM, through the installed driver: iSCSI gets the group and setgid on the
volume's root only (never recursively; a read-only mount changes nothing; the legacy key works),
and NFS never changes ownership, as ``stat`` on the server side shows."""

from __future__ import annotations

import uuid

from tests.rig import services
from tests.rig.vm import VM
from tests.vm.test_iscsi import Kubelet, clean, kubelet  # noqa: F401 (fixtures)
from tests.vm.test_nfs import Rig, rig, share  # noqa: F401 (fixture)

OK = {"status": "Success"}


def stat(vm: VM, *paths: str) -> list[str]:
    return vm.run(["stat", "-c", "%g %a", *paths]).stdout.split("\n")[: len(paths)]


def test_iscsi_fs_group_on_the_root_only(vm: VM, kubelet: Kubelet, clean: None) -> None:  # noqa: F811
    target = services.iscsi_target(vm)
    first, reply = kubelet.mount(target, pv="pv-fsg")
    assert reply == OK
    vm.sh(f"mkdir {first}/sub && echo x > {first}/sub/file && chmod 0755 {first} && sync")
    assert kubelet.unmount(first) == OK

    pod, reply = kubelet.mount(target, pv="pv-fsg", **{"kubernetes.io/mounterArgs.FsGroup": "4321"})
    assert reply == OK
    assert stat(vm, pod, f"{pod}/sub", f"{pod}/sub/file") == ["4321 2775", "0 755", "0 644"]
    vm.sh(f"echo y > {pod}/new && sync")
    assert stat(vm, f"{pod}/new")[0].split()[0] == "4321"  # setgid: new files get the group
    vm.sh(
        f"chgrp 0 {pod} && chmod 0755 {pod} && chmod g-s {pod} && sync"
    )  # back to root's, for the next pods
    assert kubelet.unmount(pod) == OK

    ro, reply = kubelet.mount(
        target,
        pv="pv-fsg",
        **{"kubernetes.io/mounterArgs.FsGroup": "4321", "kubernetes.io/readwrite": "ro"},
    )
    assert reply == OK
    assert stat(vm, ro) == ["0 755"]  # read-only: nothing applied
    assert kubelet.unmount(ro) == OK

    legacy, reply = kubelet.mount(target, pv="pv-fsg", **{"kubernetes.io/fsGroup": "777"})
    assert reply == OK
    assert stat(vm, legacy) == ["777 2775"]
    assert kubelet.unmount(legacy) == OK


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
