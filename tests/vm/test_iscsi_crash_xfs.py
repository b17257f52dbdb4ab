"""iSCSI with CHAP in the VM, through the installed driver: a mount SIGKILLed at each step and
then only unmounted (the pod deleted; kubelet gives unmount no secret) converges (no session,
node record, disk or mount left); a new LUN's first mount killed in its format converges on the
retry; and xfs grows online on expandfs.

A crash followed by a retried mount, and a crash during unmount, are the conformance kit's
crash-mount and crash-unmount checks with CHAP (tests/vm/test_kit_iscsi.py: each step a traced
mount and unmount reach, sessions, node records and new disks counted as attached)."""

from __future__ import annotations

import base64

import pytest

from flexhub.node.volumes import CHECKPOINTS, CRASH_ENV
from tests.rig import services
from tests.rig.services import IscsiTarget
from tests.rig.vm import KUBELET_ENV, VM
from tests.vm.test_iscsi import (
    LOGS,
    REPLIES,
    SESSION_CHAP,
    USED_SECRETS,
    Kubelet,
    assert_no_chap_shown,
    chap_secrets,
    clean,  # noqa: F401 (fixture)
    go_json,
    kubelet,  # noqa: F401 (fixture)
    node_records,
    sessions,
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
        USED_SECRETS.add(value)  # what assert_no_chap_shown looks for
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
    assert services.session_disks(vm, target.iqn) == []
    assert vm.run(["mountpoint", "-q", directory], check=False).rc != 0


#: The steps after the login: a crash there leaves a session the unmount must log out of.
LOGGED_IN = ("attached", "volume-record", "staged", "bound", "done")


@pytest.mark.parametrize("step", CHECKPOINTS)
def test_sigkill_at_each_mount_step_with_chap_then_unmount(
    vm: VM,
    kubelet: Kubelet,  # noqa: F811
    clean: None,  # noqa: F811
    step: str,
) -> None:
    """With CHAP, the session cannot be re-created by ``unmount``: the only way not to leak it
    is to release what the attach journalled as it went, never attaching again."""
    since = len(REPLIES)
    target = services.iscsi_target(
        vm, session_chap=SESSION_CHAP, initiators=[services.GUEST_INITIATOR]
    )
    directory = kubelet.pod_dir("pv-crash")
    log = f"{LOGS}/flexhub.log"
    logged = len(vm.read_file(log)) if vm.run(["test", "-e", log], check=False).rc == 0 else 0
    killed(vm, kubelet.driver, ["mount", directory, options(target, directory)], step)
    if step in LOGGED_IN:
        assert len(sessions(vm, target.iqn)) == 1  # logged in, device present
        assert node_records(vm, target.iqn) != []
    assert kubelet.unmount(directory) == OK
    assert_clean(vm, target, directory)
    if step == "attached":  # logged in, not yet journalled as a volume record
        text = vm.read_file(log)[logged:].decode()
        assert "was interrupted during attach: releasing what it reported" in text
        assert "re-attaching" not in text
    assert_no_chap_shown(vm, since)


def test_first_mount_killed_in_its_format_converges_on_retry(
    vm: VM,
    kubelet: Kubelet,  # noqa: F811
    clean: None,  # noqa: F811
) -> None:
    """A new LUN's first mount SIGKILLed once its format intent is journalled, then bytes
    without a signature written where mkfs writes first (what a kill in the middle of mkfs
    leaves): the retry, on the same attachment (its wwid and diskseq), formats the LUN again
    and mounts it, where without the intent it was refused on every retry as holding data
    flexhub cannot identify (issue 32)."""
    target = services.iscsi_target(
        vm, session_chap=SESSION_CHAP, initiators=[services.GUEST_INITIATOR]
    )
    directory = kubelet.pod_dir("pv-crash")
    killed(vm, kubelet.driver, ["mount", directory, options(target, directory)], "format-intent")
    (disk,) = services.session_disks(vm, target.iqn)
    vm.write_file("/tmp/partial-mkfs", b"half-made by mkfs " * 4096)
    vm.run(["dd", "if=/tmp/partial-mkfs", f"of={disk}", "bs=4096", "seek=16", "conv=fsync"])
    assert kubelet.call("mount", ["mount", directory, options(target, directory)]) == OK
    vm.write_file(f"{directory}/data", "ok")
    assert kubelet.unmount(directory) == OK
    assert_clean(vm, target, directory)
    again = kubelet.pod_dir("pv-crash")
    assert kubelet.call("mount", ["mount", again, options(target, again)]) == OK
    assert vm.read_file(f"{again}/data") == b"ok"
    assert kubelet.unmount(again) == OK
    assert_clean(vm, target, again)


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
