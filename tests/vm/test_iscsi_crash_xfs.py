"""iSCSI with CHAP in the VM, through the installed driver: SIGKILL at each step of mount and
unmount converges (no session, node record or mount left), and xfs grows online on expandfs."""

from __future__ import annotations

import base64

import pytest

from flexhub.node.volumes import CHECKPOINTS, CRASH_ENV, UNMOUNT_CHECKPOINTS
from tests.rig import services
from tests.rig.services import IscsiTarget
from tests.rig.vm import KUBELET_ENV, VM
from tests.vm.test_iscsi import (
    SESSION_CHAP,
    Kubelet,
    chap_secrets,
    clean,  # noqa: F401 (fixture)
    go_json,
    kubelet,  # noqa: F401 (fixture)
    node_records,
    read,
    sessions,
    write,
)

MiB = 1024 * 1024
OK = {"status": "Success"}


def options(target: IscsiTarget, directory: str, fs_type: str = "ext4") -> str:
    opts = {
        "backend": "iscsi",
        "targetPortal": target.portal,
        "iqn": target.iqn,
        "lun": "0",
        "chapAuthSession": "true",
        "kubernetes.io/fsType": fs_type,
        "kubernetes.io/readwrite": "rw",
        "kubernetes.io/pvOrVolumeName": "pv-crash",
        "kubernetes.io/pod.name": "web-0",
        "kubernetes.io/pod.namespace": "default",
        "kubernetes.io/pod.uid": directory.split("/")[-4],
        "kubernetes.io/serviceAccount.name": "default",
    }
    for key, value in chap_secrets(SESSION_CHAP).items():
        opts[f"kubernetes.io/secret/{key}"] = base64.b64encode(value.encode()).decode()
    return go_json(opts)


def killed(vm: VM, driver: str, argv: list[str], step: str) -> None:
    res = vm.run(
        [driver, *argv],
        env={**KUBELET_ENV, CRASH_ENV: step},
        cwd="/",
        merge=True,
        check=False,
        timeout=240,
    )
    assert res.rc in (-9, 128 + 9) and res.output == "", (step, res.rc, res.output)


def assert_clean(vm: VM, target: IscsiTarget, directory: str) -> None:
    assert sessions(vm, target.iqn) == [] and node_records(vm, target.iqn) == []
    assert vm.run(["mountpoint", "-q", directory], check=False).rc != 0


#: Every step, with and without a retry before the unmount (the attach's progress journal
#: lets the unmount of a crash right after the login log out without logging in again).
MOUNT_CASES = [
    pytest.param(step, retry, id=f"{step}-{'retry-then-unmount' if retry else 'unmount'}")
    for step in CHECKPOINTS
    for retry in (True, False)
]


@pytest.mark.parametrize(("step", "retry"), MOUNT_CASES)
def test_sigkill_at_each_mount_step_with_chap(
    vm: VM,
    kubelet: Kubelet,  # noqa: F811
    clean: None,  # noqa: F811
    step: str,
    retry: bool,
) -> None:
    target = services.iscsi_target(vm, session_chap=SESSION_CHAP)
    directory = kubelet.pod_dir("pv-crash")
    killed(vm, kubelet.driver, ["mount", directory, options(target, directory)], step)
    if retry:
        assert kubelet.call("mount", ["mount", directory, options(target, directory)]) == OK
        write(vm, directory, "data", step)
        assert read(vm, directory, "data") == step
    assert kubelet.unmount(directory) == OK
    assert_clean(vm, target, directory)


@pytest.mark.parametrize("step", UNMOUNT_CHECKPOINTS)
def test_sigkill_at_each_unmount_step_with_chap(
    vm: VM,
    kubelet: Kubelet,  # noqa: F811
    clean: None,  # noqa: F811
    step: str,
) -> None:
    target = services.iscsi_target(vm, session_chap=SESSION_CHAP)
    directory = kubelet.pod_dir("pv-crash")
    assert kubelet.call("mount", ["mount", directory, options(target, directory)]) == OK
    killed(vm, kubelet.driver, ["unmount", directory], step)
    assert kubelet.unmount(directory) == OK
    assert_clean(vm, target, directory)


def test_xfs_grows_online(vm: VM, kubelet: Kubelet, clean: None) -> None:  # noqa: F811
    target = services.iscsi_target(vm, lun_sizes=[320 * MiB], session_chap=SESSION_CHAP)
    directory = kubelet.pod_dir("pv-crash")
    assert kubelet.call("mount", ["mount", directory, options(target, directory, "xfs")]) == OK

    def size() -> int:
        return int(vm.run(["df", "-B1", "--output=size", directory]).stdout.split()[-1])

    old = size()
    services.grow_lun(vm, target, 0, 640 * MiB)
    base = {
        "backend": "iscsi",
        "targetPortal": target.portal,
        "iqn": target.iqn,
        "lun": "0",
        "kubernetes.io/fsType": "xfs",
        "kubernetes.io/readwrite": "rw",
        "kubernetes.io/pvOrVolumeName": "pv-crash",
    }
    argv = ["expandfs", go_json(base), "", directory, str(640 * MiB), str(320 * MiB)]
    assert kubelet.call("expandfs", argv) == OK
    assert size() > old + 256 * MiB, (old, size())
    assert kubelet.unmount(directory) == OK
    assert_clean(vm, target, directory)
