"""iSCSI tenant isolation in the real guest: connection identity, CHAP never on argv,
discovery records, and no target-wide lock held through a dead portal."""

from __future__ import annotations

import json
import shlex
import time

from tests.rig import services
from tests.rig.services import Chap
from tests.rig.vm import KUBELET_ENV, VM
from tests.vm import test_iscsi
from tests.vm.test_iscsi import (
    DISCOVERY_CHAP,
    REPLIES,
    SESSION_CHAP,
    USED_SECRETS,
    Kubelet,
    assert_no_chap_shown,
    chap_secrets,
    go_json,
    node_records,
    read,
    sessions,
    write,
)

# The fixtures of the iSCSI VM tests (the driver installed in the guest, a clean slate).
kubelet = test_iscsi.kubelet
clean = test_iscsi.clean

pytest_plugins = ["tests.rig.fixtures"]

SAMPLER = r"""
import os, sys
with open(sys.argv[2], "rb") as f:  # not on this argv: the sampler would find itself
    needles = f.read().split(b"\n")
out = open(sys.argv[3], "a", buffering=1)
scans = iscsiadm = 0
while not os.path.exists(sys.argv[1]):
    scans += 1
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read()
        except OSError:
            continue
        if b"iscsiadm" in argv.split(b"\0")[0]:
            iscsiadm += 1
        if any(n in argv for n in needles):
            out.write("HIT " + argv.replace(b"\0", b" ").decode("utf-8", "replace")[:200] + "\n")
out.write(f"DONE {scans} {iscsiadm}\n")
"""


def argv_hits(vm: VM) -> list[str]:
    """The command lines the sampler caught with a CHAP value so far."""
    text = vm.run(["cat", "/tmp/sampler.out"]).stdout
    return [line for line in text.splitlines() if line.startswith("HIT ")]


WRONG = "Wrong-Sess-Pw-q7Zt"


def test_chap_identity_argv_and_discovery_records(vm: VM, kubelet: Kubelet, clean: None) -> None:
    """Volume A (right CHAP) staged; B naming the same LUN with a wrong password, or without
    CHAP, fails naming what differs and leaves A alone, and so does a volume of another LUN
    that would reuse A's session; D with the same credentials shares.
    No CHAP value is ever in any process's argv; discovery leaves no record of the other
    target behind the portal."""
    target = services.iscsi_target(
        vm,
        lun_sizes=[64 << 20, 16 << 20],
        session_chap=SESSION_CHAP,
        discovery_chap=DISCOVERY_CHAP,
        initiators=[services.GUEST_INITIATOR],
    )
    other = services.iscsi_target(vm, discovery_chap=DISCOVERY_CHAP)
    USED_SECRETS.add(WRONG)
    since = len(REPLIES)
    needles = [SESSION_CHAP.password, DISCOVERY_CHAP.password, WRONG, SESSION_CHAP.userid]
    vm.write_file("/tmp/sampler.py", SAMPLER.encode())
    vm.run(["rm", "-f", "/tmp/sampler.stop"])
    vm.write_file("/tmp/sampler.needles", "\n".join(needles).encode())
    vm.run(["rm", "-f", "/tmp/sampler.out"])
    sampler = f"{vm.python} /tmp/sampler.py /tmp/sampler.stop /tmp/sampler.needles"
    vm.run(["/bin/sh", "-c", f"setsid {sampler} /tmp/sampler.out >/dev/null 2>&1 </dev/null &"])
    chap = {"chapAuthSession": "true", "chapAuthDiscovery": "true"}

    a, reply = kubelet.mount(
        target, secrets=chap_secrets(SESSION_CHAP, DISCOVERY_CHAP), pv="pv-a", **chap
    )
    assert reply == {"status": "Success"}
    assert argv_hits(vm) == [], "a CHAP value was on a command line"
    write(vm, a, "data", "from a")
    assert node_records(vm, other.iqn) == [], "discovery left the other target's record"

    wrong = Chap(SESSION_CHAP.userid, WRONG)
    b, reply = kubelet.mount(target, secrets=chap_secrets(wrong, DISCOVERY_CHAP), pv="pv-b", **chap)
    assert reply["status"] == "Failure"
    message = str(reply["message"])
    assert "session CHAP password" in message and "refusing to share" in message, message
    assert "user name" not in message, message  # only what differs
    for value in needles:
        assert value not in message
    assert vm.run(["mountpoint", "-q", b], check=False).rc != 0

    # another LUN of the target would reuse A's session (no login): same rule
    e, reply = kubelet.mount(
        target, 1, secrets=chap_secrets(wrong, DISCOVERY_CHAP), pv="pv-e", **chap
    )
    assert reply["status"] == "Failure"
    assert "session CHAP password" in str(reply["message"]), reply
    assert vm.run(["mountpoint", "-q", e], check=False).rc != 0

    c, reply = kubelet.mount(target, pv="pv-c")  # no CHAP at all
    assert reply["status"] == "Failure" and "CHAP" in str(reply["message"]), reply
    assert vm.run(["mountpoint", "-q", c], check=False).rc != 0
    assert read(vm, a, "data") == "from a"  # A unaffected

    d, reply = kubelet.mount(
        target, secrets=chap_secrets(SESSION_CHAP, DISCOVERY_CHAP), pv="pv-d", **chap
    )
    assert reply == {"status": "Success"}
    assert read(vm, d, "data") == "from a"
    assert kubelet.unmount(a) == {"status": "Success"}
    assert kubelet.unmount(d) == {"status": "Success"}
    assert sessions(vm, target.iqn) == []

    vm.run(["touch", "/tmp/sampler.stop"])
    for _ in range(100):
        done = [x for x in vm.run(["cat", "/tmp/sampler.out"]).stdout.split("\n") if "DONE" in x]
        if done:
            break
        time.sleep(0.2)
    scans, iscsiadm = (int(x) for x in done[0].split()[1:3])
    assert scans > 0 and iscsiadm > 0, done  # it did see iscsiadm running
    assert argv_hits(vm) == [], "a CHAP value was on a command line"
    assert_no_chap_shown(vm, since)  # nor in a reply or a file flexhub wrote


LISTENER = r"""
import socket, sys, time, os
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 3260))
s.listen(16)
held = []
while True:
    conn, _ = s.accept()  # accepts, never answers: a hung iSCSI server
    held.append(conn)
    open(sys.argv[2], "a").write("x\n")
"""


def test_dead_portal_does_not_block_other_volumes(vm: VM, kubelet: Kubelet, clean: None) -> None:
    """While a mount hangs on a dead portal of a target, another LUN of that target mounts
    and a third unmounts without waiting for it."""
    target = services.iscsi_target(vm, lun_sizes=[16 << 20] * 3)
    y, reply = kubelet.mount(target, 1, pv="pv-y")
    assert reply == {"status": "Success"}

    vm.write_file("/tmp/listener.py", LISTENER.encode())
    vm.run(["rm", "-f", "/tmp/listener.hit", "/tmp/x.out"])
    vm.run(["ip", "addr", "add", "127.0.0.3/8", "dev", "lo"], check=False)
    listener = f"{vm.python} /tmp/listener.py 127.0.0.3 /tmp/listener.hit"
    vm.run(["/bin/sh", "-c", f"setsid {listener} >/dev/null 2>&1 </dev/null &"])
    try:
        x = kubelet.pod_dir("pv-x")
        options = {
            "backend": "iscsi",
            "targetPortal": "127.0.0.3:3260",  # the dead one first
            "portals": target.portal,
            "iqn": target.iqn,
            "lun": "0",
            "kubernetes.io/fsType": "ext4",
            "kubernetes.io/readwrite": "rw",
            "kubernetes.io/pvOrVolumeName": "pv-x",
            "kubernetes.io/pod.uid": x.split("/")[-4],
        }
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in KUBELET_ENV.items())
        call = f"env -i {env} {kubelet.driver} mount {x} {shlex.quote(go_json(options))}"
        pid = vm.run(
            ["/bin/sh", "-c", f"setsid {call} >/tmp/x.out 2>&1 </dev/null & echo $!"]
        ).stdout.strip()
        for _ in range(300):  # the mount of X reached the dead portal
            if vm.run(["test", "-s", "/tmp/listener.hit"], check=False).rc == 0:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the mount of X never reached the dead portal")

        z, reply = kubelet.mount(target, 2, pv="pv-z")
        assert reply == {"status": "Success"}
        assert vm.run(["kill", "-0", pid], check=False).rc == 0, "X finished before Z mounted"
        assert kubelet.unmount(y) == {"status": "Success"}
        assert vm.run(["kill", "-0", pid], check=False).rc == 0, "X finished before Y unmounted"

        while vm.run(["kill", "-0", pid], check=False).rc == 0:
            time.sleep(1)
        reply = json.loads(vm.run(["cat", "/tmp/x.out"]).stdout)
        assert reply == {"status": "Success"}, reply  # the live portal was enough
        assert kubelet.unmount(x) == {"status": "Success"}
        assert kubelet.unmount(z) == {"status": "Success"}
    finally:  # the hung server goes with the test (it held its connections for the session)
        vm.run(["pkill", "-f", "/tmp/listener.py"], check=False)
        vm.run(["ip", "addr", "del", "127.0.0.3/8", "dev", "lo"], check=False)
    assert sessions(vm, target.iqn) == []
