"""Unmount of an NFS mount that really answers ESTALE (the server removed and recreated the
exported directory): Success, nothing left mounted, no umount process left.

Only v4 here: on this rig a v3 client keeps answering ``stat`` on the recreated directory (no
ESTALE reaches it), so a v3 variant would not test a stale mount at all."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.vm.test_nfs import Rig, rig, share  # noqa: F401 (fixture)


@pytest.mark.parametrize("version", ["4.2"])
def test_unmount_of_a_stale_mount(rig: Rig, version: str) -> None:  # noqa: F811
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
    # stat, not stat -f: v3 mounts of one server share a superblock, whose statfs answers
    probe = rig.vm.run(["stat", target], check=False, timeout=30)
    assert probe.rc != 0 and "Stale file handle" in probe.output, probe.output
    reply, _ = rig.unmount(target)  # also removes the directory, as kubelet does
    assert reply == {"status": "Success"}, reply
    assert rig.mounts(target) == []
    assert rig.mount_commands() == []
    assert rig.sh(f"test -e {target} || echo gone") == "gone\n"
