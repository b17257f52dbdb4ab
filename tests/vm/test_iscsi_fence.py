"""Fencing of iSCSI LUNs between two nodes, against a real kernel LIO target.

The two "nodes" are two flexhub installations in the one guest, each with its own node
config and state directory (so its own reservation key), reaching the target with their own
initiator name (``initiatorName``: a dedicated open-iscsi iface, so their own session and
I_T nexus). Persistent reservations are checked with ``sg_persist`` on the nodes' own SCSI
disks. Driver calls are few (each costs seconds in the emulated guest).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.rig import services
from tests.rig.services import IscsiTarget
from tests.rig.vm import VM

pytest_plugins = ["tests.rig.fixtures"]

PODS = "/var/lib/kubelet/pods"


@dataclass
class FakeNode:
    """One flexhub installation driven the way kubelet drives it."""

    vm: VM
    name: str
    driver: str
    config: str
    initiator: str
    pods: int = 0

    def call(self, argv: list[str]) -> dict[str, object]:
        rc, output = self.vm.call_driver(self.driver, argv, timeout=240)
        reply = json.loads(output)  # strict: nothing but the one JSON object
        assert isinstance(reply, dict)
        assert (rc == 0) == (reply["status"] == "Success"), (rc, output)
        return reply

    def mount(
        self, target: IscsiTarget, readwrite: str = "rw", **extra: str
    ) -> tuple[str, dict[str, object]]:
        self.pods += 1
        uid = f"{self.name}-{self.pods:04d}"
        directory = f"{PODS}/{uid}/volumes/k8s~flexhub/pv-shared"
        self.vm.run(["mkdir", "-p", "-m", "0750", directory])
        options = {
            "backend": "iscsi",
            "targetPortal": target.portal,
            "iqn": target.iqn,
            "lun": "0",
            "initiatorName": self.initiator,
            "kubernetes.io/fsType": "ext4",
            "kubernetes.io/readwrite": readwrite,
            "kubernetes.io/pvOrVolumeName": "pv-shared",
            "kubernetes.io/pod.uid": uid,
            **extra,
        }
        return directory, self.call(["mount", directory, json.dumps(options)])

    def unmount(self, directory: str) -> None:
        assert self.call(["unmount", directory]) == {"status": "Success"}

    def disk(self, target: IscsiTarget) -> str:
        """This node's SCSI disk of LUN 0 (its own session, found by initiator name)."""
        script = (
            "for s in /sys/class/iscsi_session/session*; do "
            '[ "$(cat $s/targetname)" = "$1" ] && [ "$(cat $s/initiatorname)" = "$2" ] || '
            "continue; for b in $s/device/target*/*/block/*; do echo /dev/${b##*/}; done; done"
        )
        out = self.vm.run(["/bin/sh", "-c", script, "sh", target.iqn, self.initiator]).stdout
        disks = out.split()
        assert len(disks) == 1, out
        return disks[0]


def pr_state(vm: VM, disk: str) -> tuple[str | None, list[str]]:
    """(holder key or None, registered keys) as the target reports them."""
    res = vm.run(["sg_persist", "--no-inquiry", "--read-reservation", disk]).stdout
    holder = re.search(r"Key=(0x[0-9a-f]+)", res)
    keys = vm.run(["sg_persist", "--no-inquiry", "--read-keys", disk]).stdout
    registered = re.findall(r"^\s+(0x[0-9a-f]+)\s*$", keys, re.M)
    return (holder.group(1) if holder else None), registered


def no_pr(vm: VM, target: IscsiTarget) -> bool:
    """Nothing reserved or registered, seen through a throw-away session of the rig."""
    services.discover(vm, target.portal)
    services.login(vm, target.iqn, target.portal)
    try:
        disks = services.session_disks(vm, target.iqn)
        assert disks, "the rig's session has no disk"
        return pr_state(vm, disks[0]) == (None, [])
    finally:
        services.logout(vm, target.iqn, target.portal)
        vm.run(["iscsiadm", "-m", "node", "-T", target.iqn, "-o", "delete"], check=False)


def key_of(value: int) -> str:
    return f"{value:#x}"


def refused_generation(reply: dict[str, object]) -> str:
    """The PR generation a refused read-write mount names in its fence preempt hint."""
    found = re.search(r"--generation (0x[0-9a-f]+)'", str(reply["message"]))
    assert reply["status"] == "Failure" and found is not None, reply
    return found.group(1)


def generation_of(vm: VM, disk: str) -> str:
    out = vm.run(["sg_persist", "--no-inquiry", "--read-keys", disk]).stdout
    found = re.search(r"PR generation=(0x[0-9a-f]+)", out)
    assert found is not None, out
    return found.group(1)


def fence(vm: VM, node: FakeNode, *argv: str, check: bool = True) -> str:
    """``flexhub fence ...`` as the operator runs it on ``node``; its output."""
    res = vm.run(
        [vm.flexhub_python, "-m", "flexhub", "fence", *argv, "--config", node.config], check=False
    )
    assert (res.rc == 0) == check, res.output
    return res.output


@pytest.fixture(scope="module")
def nodes(vm: VM) -> Iterator[tuple[FakeNode, FakeNode]]:
    made = []
    for name in ("a", "b"):
        root = f"/var/lib/flexhub-fence-{name}"
        config = f"{root}/flexhub.toml"
        vm.run(["mkdir", "-p", root])
        vm.write_file(
            config,
            f'state_dir = "{root}/state"\nlog_dir = "{root}/log"\nlog_level = "debug"\n'
            "[iscsi]\ndevice_timeout = 30\n",
        )
        driver = vm.install_flexhub(f"{root}/plugins", config=config)
        made.append(FakeNode(vm, name, driver, config, f"iqn.2026-01.io.flexhub:node-{name}"))
    yield made[0], made[1]


@pytest.fixture
def clean(vm: VM) -> Iterator[None]:
    yield
    services.reset_iscsi(vm)


def sessions_of(vm: VM, node: FakeNode) -> int:
    script = (
        "n=0; for s in /sys/class/iscsi_session/session*; do "
        '[ -e "$s" ] && [ "$(cat $s/initiatorname)" = "$1" ] && n=$((n+1)); done; echo $n'
    )
    return int(vm.run(["/bin/sh", "-c", script, "sh", node.initiator]).stdout)


def test_two_nodes_one_writer_readers_and_handover(
    vm: VM, nodes: tuple[FakeNode, FakeNode], clean: None
) -> None:
    a, b = nodes
    target = services.iscsi_target(vm)

    # A mounts read-write and writes; it alone holds the LUN.
    a_dir, reply = a.mount(target)
    assert reply == {"status": "Success"}
    vm.run(["/bin/sh", "-c", f"echo from-a > {a_dir}/data && sync"])
    # Push the journal to the filesystem proper: a reader elsewhere never replays it.
    vm.run(["fsfreeze", "-f", a_dir])
    vm.run(["fsfreeze", "-u", a_dir])
    a_disk = a.disk(target)
    a_key, registered = pr_state(vm, a_disk)
    assert a_key is not None and registered == [a_key]

    # B's read-write mount fails cleanly, naming A's key and the way out; A is untouched.
    b_dir, reply = b.mount(target)
    assert reply["status"] == "Failure"
    message = str(reply["message"])
    assert "\n" not in message
    assert f"reserved for writing by key 0x{int(a_key, 16):016x}" in message, message
    assert "flexhub fence preempt" in message, message
    assert vm.run(["mountpoint", "-q", b_dir], check=False).rc != 0
    assert sessions_of(vm, b) == 0
    assert pr_state(vm, a_disk) == (a_key, [a_key])
    assert vm.run(["cat", f"{a_dir}/data"]).stdout == "from-a\n"

    # B's read-only mount works, without journal recovery, and sees A's data.
    b_ro, reply = b.mount(target, "ro")
    assert reply == {"status": "Success"}
    assert vm.run(["cat", f"{b_ro}/data"]).stdout == "from-a\n"
    options = vm.run(["findmnt", "-n", "-o", "OPTIONS", "--target", b_ro]).stdout
    assert "ro" in options.split(",") and "norecovery" in options, options
    assert pr_state(vm, b.disk(target)) == (a_key, [a_key])  # a reader does not register
    vm.run(["/bin/sh", "-c", f"echo more > {a_dir}/more && sync"])  # A still writes
    b.unmount(b_ro)

    # A goes away: its reservation and registration go with it.
    a.unmount(a_dir)
    assert sessions_of(vm, a) == 0

    # Now B mounts read-write, finds A's data, and holds the LUN until its last unmount.
    b_dir, reply = b.mount(target)
    assert reply == {"status": "Success"}
    assert vm.run(["cat", f"{b_dir}/data", f"{b_dir}/more"]).stdout == "from-a\nmore\n"
    b_key, registered = pr_state(vm, b.disk(target))
    assert b_key is not None and b_key != a_key and registered == [b_key]
    b.unmount(b_dir)
    assert sessions_of(vm, b) == 0
    assert no_pr(vm, target)


def test_dead_holder_is_preempted_only_by_the_operator(
    vm: VM, nodes: tuple[FakeNode, FakeNode], clean: None
) -> None:
    a, b = nodes
    target = services.iscsi_target(vm)
    a_dir, reply = a.mount(target)
    assert reply == {"status": "Success"}
    a_disk = a.disk(target)
    a_key, _ = pr_state(vm, a_disk)
    assert a_key is not None
    full = f"0x{int(a_key, 16):016x}"
    # A "dies": it never unmounts. B is refused until the operator acts.
    b_dir, reply = b.mount(target)
    assert reply["status"] == "Failure" and full in str(reply["message"]), reply
    generation = refused_generation(reply)
    volume = f"iscsi:{target.iqn}:0"
    argv = ["fence", "preempt", "--volume", volume, "--key", full, "--generation", generation]
    res = vm.run([vm.flexhub_python, "-m", "flexhub", *argv, "--config", b.config])
    assert "will preempt key" in res.stdout, res.output
    b_dir, reply = b.mount(target)
    assert reply == {"status": "Success"}, reply
    b_disk = b.disk(target)
    b_key, registered = pr_state(vm, b_disk)
    assert b_key not in (None, a_key) and registered == [b_key]
    # A can no longer write to the LUN (its registration is gone): the fence holds.
    denied = vm.run(
        ["dd", "if=/dev/zero", f"of={a_disk}", "bs=4096", "count=1", "oflag=direct"],
        check=False,
    )
    assert denied.rc != 0, denied.output
    # The authorization was used up: B's next unmount and A's late cleanup leave nothing.
    b.unmount(b_dir)
    a.unmount(a_dir)
    assert sessions_of(vm, a) == 0 and sessions_of(vm, b) == 0
    assert no_pr(vm, target)


def test_target_without_reservations_refuses_read_write_unless_opted_out(
    vm: VM, nodes: tuple[FakeNode, FakeNode], clean: None
) -> None:
    a, _ = nodes
    target = services.iscsi_target(vm, persistent_reservations=False)
    directory, reply = a.mount(target)
    assert reply["status"] == "Failure"
    message = str(reply["message"])
    assert "persistent reservations" in message and 'fencing: "none"' in message, message
    assert sessions_of(vm, a) == 0
    directory, reply = a.mount(target, fencing="none")
    assert reply == {"status": "Success"}
    vm.run(["/bin/sh", "-c", f"echo unfenced > {directory}/f && sync"])
    a.unmount(directory)
    assert sessions_of(vm, a) == 0


def test_a_permission_is_void_once_the_holder_registers_again_or_it_expires(
    vm: VM, nodes: tuple[FakeNode, FakeNode], clean: None
) -> None:
    """An operator allows B to preempt A while A looks dead; A is alive and registers again
    (what its next attach does): the permission no longer matches the reservation's
    generation, so B's mount is refused and A keeps the LUN. A permission that expired is
    refused too. ``fence list`` shows a pending one; ``fence cancel`` withdraws it."""
    a, b = nodes
    target = services.iscsi_target(vm)
    volume = f"iscsi:{target.iqn}:0"
    a_dir, reply = a.mount(target)
    assert reply == {"status": "Success"}
    a_disk = a.disk(target)
    a_key, _ = pr_state(vm, a_disk)
    assert a_key is not None
    full = f"0x{int(a_key, 16):016x}"

    # B has a path to the LUN (a reader's session): the CLI reads the generation itself.
    b_ro, reply = b.mount(target, "ro")
    assert reply == {"status": "Success"}
    before = generation_of(vm, a_disk)
    out = fence(vm, b, "preempt", "--volume", volume, "--key", full)
    assert f"at PR generation {before}" in out, out
    listed = fence(vm, b, "list").splitlines()
    assert listed[1].split()[:3] == [volume, full, before], listed
    b.unmount(b_ro)

    # A registers again: the target's generation moves on.
    vm.run(
        [
            "sg_persist",
            "--no-inquiry",
            "--out",
            "--register-ignore",
            f"--param-sark={a_key}",
            a_disk,
        ]
    )
    after = generation_of(vm, a_disk)
    assert int(after, 16) > int(before, 16)
    _, reply = b.mount(target)
    message = str(reply["message"])
    assert f"generation {before} then, {after} now" in message, reply
    assert refused_generation(reply) == after
    assert pr_state(vm, a_disk) == (a_key, [a_key])  # A still holds, alone
    assert sessions_of(vm, b) == 0
    assert "no pending preemption" in fence(vm, b, "list")  # the void one was deleted

    # A permission that expired before the mount is refused, and deleted.
    fence(vm, b, "preempt", "--volume", volume, "--key", full, "--generation", after, "--ttl", "1")
    vm.run(["sleep", "2"])
    _, reply = b.mount(target)
    assert "expired at" in str(reply["message"]), reply
    assert pr_state(vm, a_disk) == (a_key, [a_key])
    assert "no pending preemption" in fence(vm, b, "list")

    # cancel: a pending permission withdrawn is never used
    fence(vm, b, "preempt", "--volume", volume, "--key", full, "--generation", after)
    assert "cancelled" in fence(vm, b, "cancel", "--volume", volume, "--key", full)
    assert "no pending preemption" in fence(vm, b, "cancel", "--volume", volume, check=False)
    _, reply = b.mount(target)
    assert reply["status"] == "Failure" and pr_state(vm, a_disk) == (a_key, [a_key]), reply

    a.unmount(a_dir)
    assert sessions_of(vm, a) == 0 and sessions_of(vm, b) == 0
    assert no_pr(vm, target)


def test_a_clone_with_the_same_key_is_refused_by_its_initiator(
    vm: VM, nodes: tuple[FakeNode, FakeNode], clean: None
) -> None:
    """A third installation configured with A's key (what a machine cloned with A's machine
    id and initiator file would derive) but its own initiator name: its read-write mount sees
    "its own" key holding the LUN, but READ FULL STATUS shows A's initiator holding it: the
    mount is refused and its registration withdrawn; A keeps writing."""
    a, _ = nodes
    target = services.iscsi_target(vm)
    a_dir, reply = a.mount(target)
    assert reply == {"status": "Success"}
    a_disk = a.disk(target)
    a_key, _ = pr_state(vm, a_disk)
    assert a_key is not None
    root = "/var/lib/flexhub-fence-clone"
    config = f"{root}/flexhub.toml"
    vm.run(["mkdir", "-p", root])
    vm.write_file(
        config,
        f'state_dir = "{root}/state"\nlog_dir = "{root}/log"\n'
        f'[iscsi]\ndevice_timeout = 30\nreservation_key = "{a_key}"\n',
    )
    clone = FakeNode(
        vm,
        "clone",
        vm.install_flexhub(f"{root}/plugins", config=config),
        config,
        "iqn.2026-01.io.flexhub:node-clone",
    )
    _, reply = clone.mount(target)
    message = str(reply["message"])
    assert reply["status"] == "Failure", reply
    assert f"through initiator {a.initiator}, which is not this node's" in message, message
    assert clone.initiator in message and "\n" not in message
    assert sessions_of(vm, clone) == 0
    assert pr_state(vm, a_disk) == (a_key, [a_key])
    vm.run(["/bin/sh", "-c", f"echo still-a > {a_dir}/f && sync"])

    # A clone that registered A's key anyway (an older flexhub, a hand-made registration),
    # here through a session of the guest's default iface (initiator rig-node): A's doctor
    # names it.
    rig = ["iscsiadm", "-m", "node", "-T", target.iqn, "-p", target.portal, "-I", "default"]
    vm.run([*rig, "-o", "new"])
    vm.run([*rig, "--login"], timeout=90)
    try:
        vm.run(["udevadm", "settle", "--timeout=30"], check=False)
        rig_node = FakeNode(vm, "rig", "", "", "iqn.2026-01.io.flexhub:rig-node")
        rig_disk = rig_node.disk(target)
        register = ["sg_persist", "--no-inquiry", "--out", "--register-ignore"]
        vm.run([*register, f"--param-sark={a_key}", rig_disk])
        plugins = a.driver.removesuffix("/k8s~flexhub/flexhub")
        doctor = [vm.flexhub_python, "-m", "flexhub", "doctor", "--json", "--config", a.config]
        res = vm.run([*doctor, "--plugin-dir", plugins], check=False)
        found = [c for c in json.loads(res.stdout) if c["name"] == "iscsi fencing identity"]
        assert [c["status"] for c in found] == ["fail"], res.output
        assert rig_node.initiator in found[0]["detail"] and a.initiator in found[0]["detail"]
        vm.run([*register, "--param-sark=0", rig_disk])
    finally:
        vm.run([*rig, "--logout"], check=False, timeout=60)
        vm.run([*rig, "-o", "delete"], check=False)
    a.unmount(a_dir)
    assert no_pr(vm, target)


def test_an_lio_target_without_its_pr_directory_is_named_in_the_refusal(
    vm: VM, nodes: tuple[FakeNode, FakeNode], clean: None
) -> None:
    """LIO whose ``<dbroot>/pr`` is missing registers the key, then answers NOT READY: the
    read-write mount is refused in one line naming that cause and its fix, and the key the
    target registered anyway is unregistered (judged by reading the keys back)."""
    a, _ = nodes
    target = services.iscsi_target(vm)
    dbroot = vm.run(["cat", "/sys/kernel/config/target/dbroot"]).stdout.strip()
    assert dbroot.startswith("/"), dbroot
    pr_dir, aside = f"{dbroot}/pr", f"{dbroot}/pr.flexhub-test-aside"
    vm.run(["mv", "-T", pr_dir, aside])
    try:
        directory, reply = a.mount(target)
    finally:
        vm.run(["mv", "-T", aside, pr_dir])
    message = str(reply["message"])
    assert reply["status"] == "Failure" and "\n" not in message, reply
    assert "NOT READY" in message and "<dbroot>/pr" in message, message
    assert 'mkdir -p "$(cat /sys/kernel/config/target/dbroot)/pr"' in message, message
    assert vm.run(["mountpoint", "-q", directory], check=False).rc != 0
    assert sessions_of(vm, a) == 0
    assert no_pr(vm, target)
