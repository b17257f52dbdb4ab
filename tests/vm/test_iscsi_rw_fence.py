"""A read-only staging mount left by a crash, then turned read-write, is fenced first: on a
real kernel LIO target, with two flexhub installations in the guest as two nodes (see
``tests/vm/test_iscsi_fence.py``, whose nodes these are).

Node A mounts LUN 0 read-only (staged ``ro,norecovery``, never registered), its unmount is
SIGKILLed right after the pod's bind went (``unbound``), so the read-only staging mount stays
with no pod; then a read-write pod of A restages it read-write. That read-write staging must
register A's key and reserve the LUN like any first read-write mount, so node B can neither
mount it read-write nor write to it.
"""

from __future__ import annotations

from tests.rig import services
from tests.rig.vm import KUBELET_ENV, VM
from tests.vm import test_iscsi_fence
from tests.vm.test_iscsi_fence import FakeNode, no_pr, pr_state, sessions_of

# The fixtures of the fencing VM tests: two installations, a clean slate afterwards.
nodes = test_iscsi_fence.nodes
clean = test_iscsi_fence.clean

pytest_plugins = ["tests.rig.fixtures"]


def staging_options(vm: VM, node: FakeNode) -> list[list[str]]:
    """The options of every staging mount of ``node``."""
    root = f"/var/lib/flexhub-fence-{node.name}/state/staging/"
    out = vm.run(["findmnt", "-rn", "-o", "TARGET,OPTIONS"]).stdout
    return [
        line.split()[1].split(",") for line in out.splitlines() if line.split()[0].startswith(root)
    ]


def test_a_read_only_staging_turned_read_write_is_fenced_first(
    vm: VM, nodes: tuple[FakeNode, FakeNode], clean: None
) -> None:
    a, b = nodes
    target = services.iscsi_target(vm)
    first, reply = a.mount(target)  # formats the LUN
    assert reply == {"status": "Success"}
    vm.run(["/bin/sh", "-c", f"echo from-a > {first}/data && sync"])
    a.unmount(first)
    assert sessions_of(vm, a) == 0 and no_pr(vm, target)

    reader, reply = a.mount(target, "ro")
    assert reply == {"status": "Success"}
    (options,) = staging_options(vm, a)
    assert "ro" in options and "norecovery" in options, options
    crashed = vm.run(
        [a.driver, "unmount", reader],
        timeout=240,
        check=False,
        env={**KUBELET_ENV, "FLEXHUB_TEST_CRASH_AT": "unbound"},
        cwd="/",
        merge=True,
    )
    assert "status" not in crashed.output, crashed.output  # SIGKILLed: no reply
    assert vm.run(["mountpoint", "-q", reader], check=False).rc != 0
    assert len(staging_options(vm, a)) == 1  # the read-only staging mount stays, no pod

    writer, reply = a.mount(target)
    assert reply == {"status": "Success"}, reply
    (options,) = staging_options(vm, a)
    assert "rw" in options and "norecovery" not in options, options
    a_disk = a.disk(target)
    a_key, registered = pr_state(vm, a_disk)
    assert a_key is not None and registered == [a_key], (a_key, registered)
    vm.run(["/bin/sh", "-c", f"echo again > {writer}/more && sync"])

    # Node B: no read-write mount, and its own path to the LUN cannot write.
    refused, reply = b.mount(target)
    assert reply["status"] == "Failure", reply
    assert f"reserved for writing by key 0x{int(a_key, 16):016x}" in str(reply["message"])
    assert vm.run(["mountpoint", "-q", refused], check=False).rc != 0
    looking, reply = b.mount(target, "ro")
    assert reply == {"status": "Success"}, reply
    b_disk = b.disk(target)
    size = int(vm.run(["blockdev", "--getsize64", b_disk]).stdout)
    last = size // 4096 - 1  # far from the filesystem's superblock, should this ever pass
    denied = vm.run(
        [
            "dd",
            "if=/dev/zero",
            f"of={b_disk}",
            "bs=4096",
            "count=1",
            f"seek={last}",
            "oflag=direct",
        ],
        check=False,
    )
    assert denied.rc != 0, denied.output
    assert pr_state(vm, b_disk) == (a_key, [a_key])

    b.unmount(looking)
    a.unmount(writer)
    assert sessions_of(vm, a) == 0 and sessions_of(vm, b) == 0
    assert no_pr(vm, target)
