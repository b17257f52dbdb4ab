"""A mount on a kernel without the filesystem's module names that cause, not a device or a
package. Real driver processes and real ``mount`` commands against this machine's kernel
(CI's has neither nfs nor cifs; on a kernel with them the mount fails for want of a server,
and the message must not blame the kernel)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flexhub.admin.harness import Kubelet, go_json
from flexhub.node.kernel import kernel_knows, missing_filesystem
from tests.conftest import needs_root, run_flexhub

CASES = {
    "nfs": {"backend": "nfs", "server": "127.0.0.1", "share": "/export"},
    "cifs": {"backend": "cifs", "server": "127.0.0.1", "share": "data"},
}
#: Plain values: Kubelet.mount_options base64-encodes them as kubelet does. (Encoded here too,
#: they reached mount.cifs as the username "dQ==", which cifs-utils 7.0-2+deb12u1 refuses as
#: "Invalid username in credentials file" before it ever asks the kernel.)
SECRETS = {"username": "u", "password": "pw"}


@needs_root
@pytest.mark.parametrize("fs_type", list(CASES))
def test_mount_names_the_missing_kernel_module(tmp_path: Path, fs_type: str) -> None:
    config = tmp_path / "flexhub.toml"
    config.write_text(
        f"state_dir = '{tmp_path / 'state'}'\nlog_dir = '{tmp_path / 'log'}'\nmount_timeout = 10\n"
    )
    target = tmp_path / "pods" / "uid-1" / "volumes" / "k8s~flexhub" / "pv-1"
    target.mkdir(parents=True)
    options = Kubelet.mount_options(
        CASES[fs_type],
        pv="pv-1",
        pod_uid="uid-1",
        secrets=SECRETS if fs_type == "cifs" else None,
    )
    reply = run_flexhub(["mount", str(target), go_json(options)], config)
    assert reply.status == "Failure", reply.reply
    if kernel_knows(fs_type):  # a kernel with the module: no server answers, and it says so
        assert "kernel has no" not in reply.message, reply.message
    else:
        assert reply.message.endswith(
            f"the running kernel has no {fs_type} module; modprobe {fs_type}"
        ), reply.message
        assert "install" not in reply.message
    assert not os.path.ismount(target)


def test_other_mount_failures_are_not_blamed_on_the_kernel(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "filesystems").write_text("nodev\ttmpfs\n\text4\n")
    assert missing_filesystem("ext4", "mount: No such device", proc) == ""  # it is there
    assert missing_filesystem("nfs", "mount.nfs: access denied by server", proc) == ""
    assert missing_filesystem("nfs", "mount.nfs: No such device", proc) == (
        "the running kernel has no nfs module; modprobe nfs"
    )
    assert missing_filesystem("nfs", "mount.nfs: No such device", tmp_path / "none") == ""
