"""Smoke run of the VM data-path benchmark (``benchmarks/datapath_vm.py --smoke``) on the
session's VM: the fio jobs run in the guest on its loop-device disk, on an NFS volume and on an
iSCSI volume both mounted through the installed driver as kubelet mounts them. Every job and
target prints a figure, labelled emulated (the figures themselves are reported, never
asserted), and nothing of the benchmark stays mounted, exported, logged in or attached."""

from __future__ import annotations

import re
import sys

from tests.conftest import REPO
from tests.rig.vm import VM

pytest_plugins = ["tests.rig.fixtures"]

JOBS = (
    "randread-4k-qd1",
    "randread-4k-qd32",
    "randwrite-4k-qd1",
    "randwrite-4k-qd32",
    "seqread-1m-qd8",
    "seqwrite-1m-qd8",
    "fsync-4k-write",
)
TARGETS = ("guest-disk", "nfs", "iscsi")


def test_vm_datapath_smoke_prints_a_figure_per_job_and_target(vm: VM) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))  # as `python3 benchmarks/datapath_vm.py` has
    import datapath_vm

    def sessions() -> str:
        return vm.run(["iscsiadm", "-m", "session"], check=False).stdout

    before = sessions()
    lines = datapath_vm.benchmark(vm, smoke=True)
    text = "\n".join(lines)
    assert lines[0].startswith("# flexhub data-path benchmark in the VM rig, EMULATED"), text
    for job in JOBS:
        for target in TARGETS:
            unit = "MiB/s" if job.startswith("seq") else "IOPS"
            ratio = "" if target == "guest-disk" else r".* [0-9.]+x guest-disk \(.*"
            figure = re.compile(
                rf"^{job} +{target} +([0-9.]+) {re.escape(unit)} {ratio}.*\| emulated$", re.M
            )
            found = figure.search(text)
            assert found is not None and float(found.group(1)) > 0, (job, target, text)
    # what each target was: the guest's loop device, NFS 4.2 and an iSCSI disk
    assert re.search(r"^# guest-disk: ext4 /dev/loop\d+ .* on a loop device", text, re.M), text
    assert re.search(r"^# nfs: nfs4 127\.0\.0\.1:/flexhub-bench \(.*vers=4\.2", text, re.M), text
    assert re.search(r"^# iscsi: ext4 /dev/(sd[a-z]+|dm-\d+|mapper/\S+) ", text, re.M), text
    # nothing left behind in the guest
    mounts = vm.read_file("/proc/mounts").decode()
    assert "flexhub-bench" not in mounts and "pv-bench-" not in mounts, mounts
    assert "disk.img" not in vm.run(["losetup", "-a"]).stdout
    assert "flexhub-bench" not in vm.run(["exportfs", "-v"]).stdout
    assert sessions() == before
    assert vm.run(["test", "-e", datapath_vm.ROOT], check=False).rc != 0
