"""SIGKILL at each step of an NFS mount (the shipped backend) through the installed driver in
the VM, then only the unmount (the pod deleted while its mount was failing): it converges and
nothing stays mounted. A crash followed by a retried mount is the conformance kit's
crash-mount check (tests/vm/test_kit_nfs.py, at every step a traced NFS mount reaches)."""

from __future__ import annotations

import pytest

from flexhub.admin.harness import Kubelet, go_json
from flexhub.node.volumes import CRASH_ENV
from tests.rig.vm import KUBELET_ENV
from tests.vm.test_nfs import Rig, rig, share  # noqa: F401 (fixture)

#: The steps of a filesystem backend's mount (flexhub/node/volumes.py).
STEPS = ("pod-record", "bound", "done")


@pytest.mark.parametrize("step", STEPS)
def test_sigkill_at_each_mount_step_then_unmount(rig: Rig, step: str) -> None:  # noqa: F811
    target = rig.pod_dir()
    user = {"backend": "nfs", **share(rig, "4.2"), "nfsVersion": "4.2"}
    options = Kubelet.mount_options(
        user, pv=target.rsplit("/", 1)[-1], pod_uid=target.split("/")[-4]
    )
    crashed = rig.vm.run(
        [rig.driver, "mount", target, go_json(options)],
        env={**KUBELET_ENV, CRASH_ENV: step},
        cwd="/",
        merge=True,
        check=False,
        timeout=120,
    )
    assert crashed.rc in (-9, 128 + 9) and crashed.output == "", (crashed.rc, crashed.output)
    assert rig.unmount(target)[0] == {"status": "Success"}
    assert rig.mounts(target) == []
    assert rig.sh(f"test -e {target} || echo gone") == "gone\n"
