"""Data safety for NFS and iSCSI in the VM rig (issue 10): kubelet's root reached through a
symlink, and an iSCSI LUN holding data blkid cannot name.

Operators often make ``/var/lib/kubelet`` a symlink to a data disk; kubelet then passes pod
directories through the symlink while ``/proc/self/mountinfo`` shows resolved paths. Every
mount, read-only mount and unmount must still find what it mounted: an unmount that found
nothing would answer Success while the mount stayed (the pod hangs in Terminating).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from flexhub.admin.harness import Kubelet, go_json, parse_reply
from tests.rig import services
from tests.rig.vm import VM

MiB = 1024 * 1024
BASE = "/var/lib/flexhub-safety-test"
CONFIG = f"{BASE}/flexhub.toml"
DISK = f"{BASE}/data-disk/kubelet"  # the "data disk" kubelet's root really lives on
LINK = f"{BASE}/kubelet"  # what kubelet is configured with: a symlink to DISK


@dataclass
class Node:
    vm: VM
    driver: str

    def call(self, *argv: str) -> dict[str, object]:
        rc, output = self.vm.call_driver(self.driver, list(argv), timeout=240)
        reply = parse_reply(output.encode())
        assert rc == (0 if reply["status"] == "Success" else 1), (rc, output)
        return reply

    def pod_dir(self, pv: str) -> str:
        path = f"{LINK}/pods/{uuid.uuid4()}/volumes/k8s~flexhub/{pv}"
        self.vm.run(["mkdir", "-p", "-m", "0750", path])
        return path

    def mount(self, target: str, user: dict[str, str], read_only: bool = False) -> object:
        options = Kubelet.mount_options(
            user, pv=target.rsplit("/", 1)[-1], pod_uid=target.split("/")[-4], read_only=read_only
        )
        return self.call("mount", target, go_json(options))

    def mounted(self, target: str) -> list[list[str]]:
        """The /proc/mounts entries of ``target`` (named by its resolved path)."""
        real = target.replace(LINK, DISK, 1)
        text = self.vm.run(["cat", "/proc/mounts"]).stdout
        return [line.split() for line in text.splitlines() if line.split()[1] == real]

    def state_mounts(self) -> list[str]:
        text = self.vm.run(["cat", "/proc/mounts"]).stdout
        return [line.split()[1] for line in text.splitlines() if f"{BASE}/state" in line]


@pytest.fixture(scope="module")
def node(vm: VM) -> Iterator[Node]:
    vm.run(["mkdir", "-p", DISK])
    vm.run(["ln", "-sfn", DISK, LINK])
    vm.write_file(
        CONFIG,
        f'state_dir = "{BASE}/state"\nlog_dir = "{BASE}/log"\nlog_level = "debug"\n'
        "[iscsi]\ndevice_timeout = 30\n[nfs]\nmount_timeout = 20\n",
    )
    yield Node(vm, vm.install_flexhub(f"{BASE}/plugins", config=CONFIG))


def test_nfs_through_a_symlinked_kubelet_root(node: Node) -> None:
    """An NFS pod mounted read-write and one read-only through the symlinked root; each
    unmount (one through the symlink, one by the resolved path) really unmounts."""
    server = services.start_nfs_server(node.vm)
    user = {"backend": "nfs", "server": server.host, "share": server.v3_path, "nfsVersion": "3"}
    writer, reader = node.pod_dir("pv-nfs"), node.pod_dir("pv-nfs")
    assert node.mount(writer, user) == {"status": "Success"}
    assert node.mount(reader, user, read_only=True) == {"status": "Success"}
    assert node.mounted(reader)[0][3].split(",")[0] == "ro"
    assert len(node.mounted(writer)) == 1
    assert node.call("unmount", reader) == {"status": "Success"}
    assert node.mounted(reader) == []
    assert node.call("unmount", writer.replace(LINK, DISK, 1)) == {"status": "Success"}
    assert node.mounted(writer) == []
    assert node.vm.run(["ls", f"{BASE}/state/pods"]).stdout.split() == []


def test_iscsi_through_a_symlinked_kubelet_root(node: Node) -> None:
    """An iSCSI LUN staged once, bound read-write and read-only through the symlinked root;
    the last unmount releases the staging mount and logs out."""
    target = services.iscsi_target(node.vm, lun_sizes=[64 * MiB])
    try:
        user = {"backend": "iscsi", "targetPortal": target.portal, "iqn": target.iqn, "lun": "0"}
        writer, reader = node.pod_dir("pv-iscsi"), node.pod_dir("pv-iscsi")
        assert node.mount(writer, user) == {"status": "Success"}
        assert node.mount(reader, user, read_only=True) == {"status": "Success"}
        assert node.mounted(reader)[0][3].split(",")[0] == "ro"
        assert node.mounted(writer)[0][3].split(",")[0] == "rw"
        assert node.call("unmount", reader) == {"status": "Success"}
        assert node.mounted(reader) == [] and len(node.mounted(writer)) == 1
        assert node.call("unmount", writer) == {"status": "Success"}
        assert node.mounted(writer) == [] and node.state_mounts() == []
        assert services.session_disks(node.vm, target.iqn) == []
    finally:
        services.reset_iscsi(node.vm)


def test_iscsi_lun_with_unidentified_data_is_never_formatted(node: Node) -> None:
    """A LUN holding a tar archive (no signature blkid knows) is a Failure; its bytes stay."""
    target = services.iscsi_target(node.vm, lun_sizes=[64 * MiB])
    try:
        header = b"dump.csv".ljust(100, b"\0") + b"0000644\0" + bytes(148) + b"ustar\x0000"
        services.lun_write(node.vm, target, 0, header.ljust(4096, b"x"))
        path = target.lun_paths[0]
        before = node.vm.run(["sha256sum", path]).stdout
        user = {"backend": "iscsi", "targetPortal": target.portal, "iqn": target.iqn, "lun": "0"}
        reply = node.mount(node.pod_dir("pv-tar"), user)
        assert reply["status"] == "Failure", reply
        assert "cannot identify" in str(reply["message"]), reply
        assert node.vm.run(["sha256sum", path]).stdout == before
        assert node.state_mounts() == []
        assert services.session_disks(node.vm, target.iqn) == []
    finally:
        services.reset_iscsi(node.vm)
