"""Two LUNs of one target mounted at once on a real kernel, one with session CHAP and one
without: the one without CHAP never rides the CHAP session while the CHAP mount is still in
flight (its journal record is only an intent then, its staging not mounted yet).

The CHAP mount is held in flight deterministically with the core's test hook
``FLEXHUB_TEST_PAUSE_AT``: it stops itself (SIGSTOP) right after its login and its disk, at
``attach-progress-multipath``, and goes on when the test sends SIGCONT. The target accepts
this node's initiator only with the session CHAP, so the mount without CHAP can reach LUN 1
only through the CHAP mount's session.
"""

from __future__ import annotations

import base64
import json
import shlex
import time

from tests.rig import services
from tests.rig.vm import KUBELET_ENV, VM
from tests.vm import test_iscsi
from tests.vm.test_iscsi import (
    SESSION_CHAP,
    USED_SECRETS,
    Kubelet,
    chap_secrets,
    go_json,
    read,
    sessions,
    write,
)

# The fixtures of the iSCSI VM tests (the driver installed in the guest, a clean slate).
kubelet = test_iscsi.kubelet
clean = test_iscsi.clean

pytest_plugins = ["tests.rig.fixtures"]

MiB = 1024 * 1024
PAUSE_AT = "attach-progress-multipath"  # after the login and the LUN's disk, before fencing


def start_paused_mount(
    vm: VM, kubelet: Kubelet, options: dict[str, str], out: str
) -> tuple[str, str]:
    """Start a driver ``mount`` in the background that stops itself at :data:`PAUSE_AT`;
    returns its pid, once it is stopped there, and its pod directory."""
    directory = kubelet.pod_dir(options["kubernetes.io/pvOrVolumeName"])
    options = {**options, "kubernetes.io/pod.uid": directory.split("/")[-4]}
    env = {**KUBELET_ENV, "FLEXHUB_TEST_PAUSE_AT": PAUSE_AT}
    words = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    call = f"env -i {words} {kubelet.driver} mount {directory} {shlex.quote(go_json(options))}"
    pid = vm.run(
        ["/bin/sh", "-c", f"setsid {call} >{out} 2>&1 </dev/null & echo $!"]
    ).stdout.strip()
    for _ in range(600):
        state = vm.run(["/bin/sh", "-c", f"cut -d')' -f2 /proc/{pid}/stat"], check=False)
        if state.rc != 0:
            raise AssertionError(f"the held mount ended: {vm.run(['cat', out]).stdout}")
        if state.stdout.split()[:1] == ["T"]:
            return pid, directory
        time.sleep(0.2)
    raise AssertionError("the held mount never reached its pause")


def finish(vm: VM, pid: str, out: str) -> dict[str, object]:
    """Let the held call go on; its reply."""
    vm.run(["kill", "-CONT", pid], check=False)
    for _ in range(600):
        if vm.run(["kill", "-0", pid], check=False).rc != 0:
            break
        time.sleep(0.5)
    reply = json.loads(vm.run(["cat", out]).stdout)
    assert isinstance(reply, dict)
    return reply


def test_a_lun_without_chap_never_rides_a_chap_session_in_flight(
    vm: VM, kubelet: Kubelet, clean: None
) -> None:
    target = services.iscsi_target(
        vm,
        lun_sizes=[32 * MiB, 32 * MiB],
        session_chap=SESSION_CHAP,
        initiators=[services.GUEST_INITIATOR],
    )
    options = {
        "backend": "iscsi",
        "targetPortal": target.portal,
        "iqn": target.iqn,
        "lun": "0",
        "chapAuthSession": "true",
        "kubernetes.io/fsType": "ext4",
        "kubernetes.io/readwrite": "rw",
        "kubernetes.io/pvOrVolumeName": "pv-chap",
    }
    for key, value in chap_secrets(SESSION_CHAP).items():
        USED_SECRETS.add(value)
        options[f"kubernetes.io/secret/{key}"] = base64.b64encode(value.encode()).decode()
    out = "/tmp/session-race.out"
    pid, chap_dir = start_paused_mount(vm, kubelet, options, out)
    try:
        # The CHAP mount is in flight: logged in with CHAP, LUN 0's disk there, nothing staged.
        assert len(sessions(vm, target.iqn)) == 1
        held_disks = services.session_disks(vm, target.iqn)
        assert len(held_disks) == 1, held_disks

        plain, reply = kubelet.mount(target, 1, pv="pv-plain")  # no CHAP at all
        assert reply["status"] == "Failure", reply
        message = str(reply["message"])
        assert "session CHAP" in message and "refusing to share its session" in message, message
        assert SESSION_CHAP.password not in message and SESSION_CHAP.userid not in message
        assert vm.run(["mountpoint", "-q", plain], check=False).rc != 0
        assert services.session_disks(vm, target.iqn) == held_disks  # LUN 1 never scanned
        assert len(sessions(vm, target.iqn)) == 1
    finally:
        reply = finish(vm, pid, out)
    assert reply == {"status": "Success"}, reply
    write(vm, chap_dir, "data", "lun zero")
    vm.run(["sync"])
    assert read(vm, chap_dir, "data") == "lun zero"
    assert kubelet.unmount(chap_dir) == {"status": "Success"}
    assert sessions(vm, target.iqn) == []
    assert services.session_disks(vm, target.iqn) == []
