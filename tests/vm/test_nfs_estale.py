"""Unmount of an NFS mount that really answers ESTALE (the server removed and recreated the
exported directory), for v3 and v4: Success, nothing left mounted, no umount process left."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.vm.test_nfs import Rig, rig, share  # noqa: F401 (fixture)


@pytest.mark.parametrize("version", ["3", "4.2"])
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
    probe = rig.vm.run(["stat", "-f", target], check=False, timeout=30)
    assert probe.rc != 0 and "Stale file handle" in probe.output, probe.output
    reply, _ = rig.unmount(target)  # also removes the directory, as kubelet does
    assert reply == {"status": "Success"}, reply
    assert rig.mounts(target) == []
    assert rig.mount_commands() == []
    assert rig.sh(f"test -e {target} || echo gone") == "gone\n"
