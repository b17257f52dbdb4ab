"""expandfs on iSCSI refuses, changing nothing, when growing would be wrong (real kernel, LIO).

The LUN has grown on the target each time, so a grow would succeed if it were attempted; the
refusal is checked by its effect: a Failure naming the reason, and neither the SCSI disk (no
rescan) nor the mounted filesystem changed size. ext4 and xfs growth themselves are in
``test_iscsi.py::test_expandfs_after_the_lun_grew`` and
``test_iscsi_crash_xfs.py::test_xfs_grows_online``.
"""

from __future__ import annotations

import hashlib
import json

from tests.rig import services
from tests.rig.services import IscsiTarget
from tests.rig.vm import VM
from tests.vm import test_iscsi
from tests.vm.test_iscsi import STATE, Kubelet, go_json, source_of

# The fixtures of the iSCSI VM tests (the driver installed in the guest, a clean slate).
kubelet = test_iscsi.kubelet
clean = test_iscsi.clean

pytest_plugins = ["tests.rig.fixtures"]

MiB = 1024 * 1024


def fs_size(vm: VM, directory: str) -> int:
    return int(vm.run(["df", "-B1", "--output=size", directory]).stdout.split()[-1])


def disk_size(vm: VM, device: str) -> int:
    return int(vm.run(["blockdev", "--getsize64", device]).stdout)


def expandfs(
    kubelet: Kubelet, target: IscsiTarget, lun: int, pv: str, directory: str, new: int, old: int
) -> dict[str, object]:
    options = {
        "backend": "iscsi",
        "targetPortal": target.portal,
        "iqn": target.iqn,
        "lun": str(lun),
        "kubernetes.io/fsType": "ext4",
        "kubernetes.io/readwrite": "rw",
        "kubernetes.io/pvOrVolumeName": pv,
    }
    argv = ["expandfs", go_json(options), "", directory, str(new), str(old)]
    return kubelet.call("expandfs", argv)


def test_refused_on_a_read_only_mount(vm: VM, kubelet: Kubelet, clean: None) -> None:
    target = services.iscsi_target(vm, lun_sizes=[64 * MiB])
    services.lun_mkfs(vm, target, 0, "ext4")
    directory, reply = kubelet.mount(target, pv="pv-ro", **{"kubernetes.io/readwrite": "ro"})
    assert reply == {"status": "Success"}
    refused = vm.run(["touch", f"{directory}/x"], check=False)
    assert refused.rc != 0 and "Read-only file system" in refused.output, refused.output
    device = source_of(vm, directory)
    before = fs_size(vm, directory)
    services.grow_lun(vm, target, 0, 160 * MiB)
    reply = expandfs(kubelet, target, 0, "pv-ro", directory, 160 * MiB, 64 * MiB)
    assert reply["status"] == "Failure" and "read-only" in str(reply["message"]), reply
    assert fs_size(vm, directory) == before
    assert disk_size(vm, device) == 64 * MiB  # not even rescanned
    assert kubelet.unmount(directory) == {"status": "Success"}


def test_refused_when_the_journal_names_another_device(
    vm: VM, kubelet: Kubelet, clean: None
) -> None:
    """The volume's record names a device that is not the one mounted on its staging
    directory (here LUN 1's disk, as a stale record could after the disks were renumbered):
    expandfs must not grow either of them. With the record put right, the same call grows."""
    target = services.iscsi_target(vm, lun_sizes=[64 * MiB, 64 * MiB])
    zero, reply = kubelet.mount(target, 0, pv="pv-zero")
    assert reply == {"status": "Success"}
    one, reply = kubelet.mount(target, 1, pv="pv-one")
    assert reply == {"status": "Success"}
    disk0, disk1 = source_of(vm, zero), source_of(vm, one)
    sizes = (fs_size(vm, zero), fs_size(vm, one))
    record_file = (
        f"{STATE}/volumes/{hashlib.sha256(f'iscsi:{target.iqn}:0'.encode()).hexdigest()}.json"
    )
    original = vm.read_file(record_file)
    record = json.loads(original)
    assert record["device"] == disk0, record
    record["device"] = disk1
    vm.write_file(record_file, json.dumps(record), mode=0o600)
    services.grow_lun(vm, target, 0, 160 * MiB)
    services.grow_lun(vm, target, 1, 160 * MiB)
    try:
        reply = expandfs(kubelet, target, 0, "pv-zero", zero, 160 * MiB, 64 * MiB)
        assert reply["status"] == "Failure", reply
        assert "no longer the device" in str(reply["message"]), reply
        assert (fs_size(vm, zero), fs_size(vm, one)) == sizes
        assert disk_size(vm, disk0) == disk_size(vm, disk1) == 64 * MiB  # nothing rescanned
    finally:
        vm.write_file(record_file, original, mode=0o600)
    reply = expandfs(kubelet, target, 0, "pv-zero", zero, 160 * MiB, 64 * MiB)
    assert reply == {"status": "Success"}, reply
    assert fs_size(vm, zero) > sizes[0] + 64 * MiB
    assert fs_size(vm, one) == sizes[1]
    assert kubelet.unmount(zero) == {"status": "Success"}
    assert kubelet.unmount(one) == {"status": "Success"}
    assert test_iscsi.sessions(vm, target.iqn) == []
