"""Unmount of an NFS mount that really answers ESTALE (the server removed and recreated the
export): Success, nothing left mounted, no umount process left; for v4 and for v3.

v4: the exported sub-directory is removed and made again, and the client's ``stat`` of the
mount point fails with ESTALE. A v3 client asked the same keeps answering ``stat`` of its
mount point (only ``readdir`` and ``statfs`` fail), so for v3 the server replaces the whole
exported filesystem: the export is removed, its ext4 made anew (a new UUID, from which the
server derives the file handle's fsid) and exported again at the same path, as when a server's
disk is replaced. The client's handle then names a filesystem the server no longer has, and a
plain ``stat`` of the mount point fails with ESTALE. Each test checks that errno before the
unmount, so a run where the mount was not stale cannot pass.
"""

from __future__ import annotations

import time
import uuid

import pytest

from tests.rig.vm import GUEST_PYTHON
from tests.vm.test_nfs import Rig, rig, share

__all__ = ["rig"]  # the fixture

#: Prints the errno name of a failed ``stat`` of argv[1] ("ok" if it did not fail).
STAT_ERRNO = (
    "import errno, os, sys\n"
    "try:\n    os.stat(sys.argv[1])\nexcept OSError as exc:\n"
    "    print(errno.errorcode[exc.errno])\nelse:\n    print('ok')\n"
)


def stat_errno(rig: Rig, path: str) -> str:
    return rig.vm.run([GUEST_PYTHON, "-c", STAT_ERRNO, path], timeout=60).stdout.strip()


def assert_unmounts_clean(rig: Rig, target: str) -> None:
    reply, _ = rig.unmount(target)  # also removes the directory, as kubelet does
    assert reply == {"status": "Success"}, reply
    assert rig.mounts(target) == []
    assert rig.mount_commands() == []
    assert rig.sh(f"test -e {target} || echo gone") == "gone\n"


@pytest.mark.parametrize("version", ["4.2"])
def test_unmount_of_a_stale_mount(rig: Rig, version: str) -> None:
    name = f"estale-{uuid.uuid4().hex[:6]}"
    target = rig.pod_dir()
    user = {
        **share(rig, version),
        "nfsVersion": version,
        "subPath": name,
        "createSubPath": "true",
        "mountOptions": "actimeo=1",  # the client sees the stale handle at once
    }
    assert rig.mount(target, user)[0] == {"status": "Success"}
    rig.sh(f"rm -rf {rig.server_path(name)} && mkdir {rig.server_path(name)}")
    time.sleep(1.5)  # past actimeo: the next stat goes to the server
    assert stat_errno(rig, target) == "ESTALE"
    assert_unmounts_clean(rig, target)


def test_unmount_of_a_stale_v3_mount_after_the_export_was_recreated(rig: Rig) -> None:
    tag = uuid.uuid4().hex[:6]
    export, image = f"/srv/estale-{tag}", f"/var/tmp/estale-{tag}.img"
    opts = "rw,sync,no_subtree_check,no_root_squash,insecure"
    client = f"127.0.0.0/8:{export}"
    make_export = (
        f"mkfs.ext4 -q -F {image} && mount -o loop {image} {export} && chmod 0777 {export}"
        f" && exportfs -o {opts} {client}"
    )
    rig.sh(f"truncate -s 32M {image} && mkdir -p {export} && {make_export}", timeout=120)
    try:
        target = rig.pod_dir()
        user = {
            "server": rig.server.host,
            "share": export,
            "nfsVersion": "3",
            "mountOptions": "actimeo=1",  # the client sees the stale handle at once
        }
        assert rig.mount(target, user)[0] == {"status": "Success"}
        rig.vm.write_file(f"{target}/data", "before")
        assert rig.sh(f"cat {export}/data") == "before"
        # the export removed, its filesystem made anew and exported again at the same path
        rig.sh(f"exportfs -u {client} && umount {export} && {make_export} && exportfs -f")
        time.sleep(1.5)  # past actimeo: the next stat goes to the server
        assert stat_errno(rig, target) == "ESTALE"
        assert_unmounts_clean(rig, target)
    finally:
        rig.sh(f"exportfs -u {client}; umount {export}; rmdir {export}; rm -f {image}", check=False)
