"""Two LUNs of one target at once, on a real kernel: one LUN unmounts (its release would log
out of the target) while the other LUN's mount is in flight. The session stays for the LUN
being mounted, both calls answer Success, and the last unmount logs out.

The mount is held in flight deterministically, without any test hook: its first portal is a
listener that accepts the connection and never answers (a hung portal), so its discovery waits
out ``login_timeout`` while the target's live portal already has the session, which the mount
reuses. The unmount runs while the mount is still waiting; only then does the mount go on to
scan its LUN through that session.
"""

from __future__ import annotations

import json
import shlex
import time

from tests.rig import services
from tests.rig.vm import KUBELET_ENV, VM
from tests.vm import test_iscsi
from tests.vm.test_iscsi import Kubelet, go_json, node_records, read, sessions, write
from tests.vm.test_iscsi_security import LISTENER

# The fixtures of the iSCSI VM tests (the driver installed in the guest, a clean slate).
kubelet = test_iscsi.kubelet
clean = test_iscsi.clean

pytest_plugins = ["tests.rig.fixtures"]

MiB = 1024 * 1024
DEAD = "127.0.0.3"


def test_one_lun_unmounts_while_another_mounts(vm: VM, kubelet: Kubelet, clean: None) -> None:
    target = services.iscsi_target(vm, lun_sizes=[32 * MiB, 32 * MiB])
    leaving, reply = kubelet.mount(target, 1, pv="pv-leaving")
    assert reply == {"status": "Success"}
    leaving_disk = test_iscsi.source_of(vm, leaving)
    write(vm, leaving, "data", "lun one")

    vm.write_file("/tmp/conc-listener.py", LISTENER.encode())
    vm.run(["rm", "-f", "/tmp/conc-listener.hit", "/tmp/conc.out"])
    vm.run(["ip", "addr", "add", f"{DEAD}/8", "dev", "lo"], check=False)
    listener = f"{vm.python} /tmp/conc-listener.py {DEAD} /tmp/conc-listener.hit"
    listener_pid = vm.run(
        ["/bin/sh", "-c", f"setsid {listener} >/dev/null 2>&1 </dev/null & echo $!"]
    ).stdout.strip()
    try:
        coming = kubelet.pod_dir("pv-coming")
        options = {
            "backend": "iscsi",
            "targetPortal": f"{DEAD}:3260",  # hangs: keeps this mount in flight
            "portals": target.portal,  # has the session already: reused, no login
            "iqn": target.iqn,
            "lun": "0",
            "kubernetes.io/fsType": "ext4",
            "kubernetes.io/readwrite": "rw",
            "kubernetes.io/pvOrVolumeName": "pv-coming",
            "kubernetes.io/pod.uid": coming.split("/")[-4],
        }
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in KUBELET_ENV.items())
        call = f"env -i {env} {kubelet.driver} mount {coming} {shlex.quote(go_json(options))}"
        pid = vm.run(
            ["/bin/sh", "-c", f"setsid {call} >/tmp/conc.out 2>&1 </dev/null & echo $!"]
        ).stdout.strip()
        for _ in range(300):  # the mount is in flight: it reached the hung portal
            if vm.run(["test", "-s", "/tmp/conc-listener.hit"], check=False).rc == 0:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the mount of LUN 0 never reached the hung portal")

        # The only staged user of the target leaves while LUN 0's mount is in flight.
        assert kubelet.unmount(leaving) == {"status": "Success"}
        assert vm.run(["kill", "-0", pid], check=False).rc == 0, "the mount ended too early"
        assert len(sessions(vm, target.iqn)) == 1, "logged out under an attach in flight"
        assert node_records(vm, target.iqn) != []
        assert vm.run(["mountpoint", "-q", leaving], check=False).rc != 0
        assert leaving_disk not in services.session_disks(vm, target.iqn)  # LUN 1 removed

        while vm.run(["kill", "-0", pid], check=False).rc == 0:
            time.sleep(1)
        reply = json.loads(vm.run(["cat", "/tmp/conc.out"]).stdout)
        assert reply == {"status": "Success"}, reply
        write(vm, coming, "data", "lun zero")
        vm.run(["sync"])
        assert read(vm, coming, "data") == "lun zero"
        assert len(services.session_disks(vm, target.iqn)) == 1  # LUN 0's disk only

        assert kubelet.unmount(coming) == {"status": "Success"}
        assert sessions(vm, target.iqn) == [] and node_records(vm, target.iqn) == []
        assert services.session_disks(vm, target.iqn) == []
        # and LUN 1's data survived its part in the race
        again, reply = kubelet.mount(target, 1, pv="pv-leaving")
        assert reply == {"status": "Success"}
        assert read(vm, again, "data") == "lun one"
        assert kubelet.unmount(again) == {"status": "Success"}
        assert sessions(vm, target.iqn) == []
    finally:
        vm.run(["kill", listener_pid], check=False)
