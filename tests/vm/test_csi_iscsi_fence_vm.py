"""Under CSI, an iSCSI LUN staged read-write on one node is fenced from another node's
read-write NodeStageVolume (SCSI-3 persistent reservations), on a real kernel LIO target.

The two nodes are two ``flexhub csi --mode node`` plugins in the one guest, each with its own
node config and state directory (so its own reservation key) and its own initiator name
(``initiatorName`` in the volume context: a dedicated open-iscsi iface, so its own session and
I_T nexus), as the FlexVolume path's tests/vm/test_iscsi_fence.py does with two installations.
Node B's read-write stage is refused (``FAILED_PRECONDITION``, naming A's key and the way
out) and leaves no session; once A unstages (its key unregistered), B's stage takes the LUN
over with A's data.

The same plugin's NodeGetVolumeHealth of a staged LUN follows its path from the kernel: its
portal taken down on the target (the session FAILED while open-iscsi reconnects, the disk
blocked) is ``INACCESSIBLE``/``PathsDown`` although the staging mount still answers a stat;
once the portal is back, the session logs in again and the volume is healthy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.rig import services
from tests.rig.services import IscsiTarget
from tests.rig.vm import VM
from tests.vm import csiguest, test_iscsi_fence
from tests.vm.test_iscsi_fence import FakeNode, no_pr, pr_state, sessions_of

pytest_plugins = ["tests.rig.fixtures"]

clean = test_iscsi_fence.clean
#: Seconds of each phase, printed at the end (the emulated guest's cost).
SECONDS: dict[str, float] = {}


def _base(node: FakeNode) -> str:
    return f"/run/flexhub-csi-fence-{node.name}"


@pytest.fixture(scope="module")
def csi_nodes(vm: VM) -> Iterator[tuple[FakeNode, FakeNode]]:
    """Two node plugins; the nodes' disks and sessions are found by their initiator names
    (:class:`FakeNode`'s lookups: no FlexVolume driver is installed here)."""
    started = time.monotonic()
    made: list[tuple[FakeNode, int]] = []
    try:
        for name in ("a", "b"):
            base = f"/run/flexhub-csi-fence-{name}"
            config = csiguest.prepare(vm, base, "[iscsi]\ndevice_timeout = 30\n")
            pid = csiguest.start(vm, base, "node", f"csi-node-{name}")
            made.append((FakeNode(vm, name, "", config, f"iqn.2026-01.io.flexhub:csi-{name}"), pid))
        SECONDS["two plugins started"] = time.monotonic() - started
        yield made[0][0], made[1][0]
    finally:
        for node, pid in made:
            csiguest.stop(vm, _base(node), pid)


def stage(vm: VM, node: FakeNode, target: IscsiTarget) -> tuple[str, str]:
    """NodeStageVolume of LUN 0 read-write (ext4, single node writer) on ``node``."""
    staging = f"{_base(node)}/stage/s"
    vm.run(["mkdir", "-p", staging])
    request = {
        "volume_id": f"iscsi-static-{target.iqn.rsplit(':', 1)[-1]}",
        "staging_target_path": staging,
        "volume_capability": {
            "mount": {"fs_type": "ext4"},
            "access_mode": {"mode": "SINGLE_NODE_WRITER"},
        },
        "volume_context": {
            "backend": "iscsi",
            "targetPortal": target.portal,
            "iqn": target.iqn,
            "lun": "0",
            "initiatorName": node.initiator,
        },
    }
    started = time.monotonic()
    answer = csiguest.node_call(vm, _base(node), "NodeStageVolume", request)
    SECONDS[f"stage on {node.name} ({answer[0]})"] = time.monotonic() - started
    return answer


def unstage(vm: VM, node: FakeNode, target: IscsiTarget) -> None:
    request = {
        "volume_id": f"iscsi-static-{target.iqn.rsplit(':', 1)[-1]}",
        "staging_target_path": f"{_base(node)}/stage/s",
    }
    started = time.monotonic()
    assert csiguest.node_call(vm, _base(node), "NodeUnstageVolume", request) == ("OK", "")
    SECONDS[f"unstage on {node.name}"] = time.monotonic() - started


def test_a_second_node_s_read_write_stage_is_fenced_until_the_first_unstages(
    vm: VM, csi_nodes: tuple[FakeNode, FakeNode], clean: None
) -> None:
    a, b = csi_nodes
    target = services.iscsi_target(vm)
    assert stage(vm, a, target) == ("OK", "")  # formats the LUN
    a_staging = f"{_base(a)}/stage/s"
    vm.run(["/bin/sh", "-c", f"echo from-a > {a_staging}/data && sync"])
    # Push the journal to the filesystem proper: B reads the data after the handover.
    vm.run(["fsfreeze", "-f", a_staging])
    vm.run(["fsfreeze", "-u", a_staging])
    a_disk = a.disk(target)
    a_key, registered = pr_state(vm, a_disk)
    assert a_key is not None and registered == [a_key], (a_key, registered)

    # B: refused, naming A's key and the way out; nothing staged, no session; A untouched.
    code, message = stage(vm, b, target)
    assert code == "FAILED_PRECONDITION", (code, message)
    assert f"reserved for writing by key 0x{int(a_key, 16):016x}" in message, message
    assert "flexhub fence preempt" in message and "\n" not in message, message
    assert vm.run(["mountpoint", "-q", f"{_base(b)}/stage/s"], check=False).rc != 0
    assert sessions_of(vm, b) == 0
    assert pr_state(vm, a_disk) == (a_key, [a_key])
    assert vm.run(["cat", f"{a_staging}/data"]).stdout == "from-a\n"

    # A unstages (its key goes with its session); B's stage now takes the LUN, A's data on it.
    unstage(vm, a, target)
    assert sessions_of(vm, a) == 0
    assert stage(vm, b, target) == ("OK", "")
    assert vm.run(["cat", f"{_base(b)}/stage/s/data"]).stdout == "from-a\n"
    b_key, registered = pr_state(vm, b.disk(target))
    assert b_key is not None and b_key != a_key and registered == [b_key], (b_key, registered)
    unstage(vm, b, target)
    assert sessions_of(vm, b) == 0
    assert no_pr(vm, target)
    print(", ".join(f"{what} {seconds:.1f} s" for what, seconds in SECONDS.items()))


def health(vm: VM, node: FakeNode, target: IscsiTarget) -> list[tuple[str, str, str]]:
    request = {"volume_id": f"iscsi-static-{target.iqn.rsplit(':', 1)[-1]}"}
    code, message, reply = csiguest.node_answer(vm, _base(node), "NodeGetVolumeHealth", request)
    assert code == "OK", (code, message)
    entries = reply.get("volumeHealth", {}).get("healthStatuses", [])
    return [(e["status"], e["reason"], e["message"]) for e in entries]


def test_a_staged_lun_whose_portal_is_down_is_inaccessible_until_it_is_back(
    vm: VM, csi_nodes: tuple[FakeNode, FakeNode], clean: None
) -> None:
    a, _ = csi_nodes
    target = services.iscsi_target(vm)
    assert stage(vm, a, target) == ("OK", "")
    try:
        assert health(vm, a, target) == []
        services.portal_down(vm, target, target.portal)
        started = time.monotonic()
        found: list[tuple[str, str, str]] = []
        while not found and time.monotonic() - started < 90:
            found = health(vm, a, target)
        SECONDS["portal down seen"] = time.monotonic() - started
        assert [(status, reason) for status, reason, _ in found] == [
            ("INACCESSIBLE", "PathsDown")
        ], found
        message = found[0][2]
        assert message.startswith(f"iSCSI {target.iqn} lun 0: no path: "), message
        assert f"the session on {target.portal} is FAILED" in message, message
        # the staging mount itself still answers: only the backend's check sees the path
        assert vm.run(["stat", "-f", f"{_base(a)}/stage/s"], check=False).rc == 0
        services.portal_up(vm, target, target.portal)
        started = time.monotonic()
        while found and time.monotonic() - started < 120:
            found = health(vm, a, target)
        SECONDS["portal back seen"] = time.monotonic() - started
        assert found == []
    finally:
        if target.down:
            services.portal_up(vm, target, target.portal)
        unstage(vm, a, target)
    assert sessions_of(vm, a) == 0
    print(", ".join(f"{what} {seconds:.1f} s" for what, seconds in SECONDS.items()))
