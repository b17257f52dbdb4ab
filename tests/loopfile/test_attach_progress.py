"""An attach killed after the loop device is attached is released, never attached again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexhub.admin.harness import KUBELET_ENV, Kubelet, ReplyError
from tests.conftest import needs_root
from tests.loopfile.conftest import loops_of, mounts_under
from tests.loopfile.test_driver_e2e import VOL

pytestmark = [needs_root, pytest.mark.root]


def _crash_mount(kube: Kubelet, uid: str, point: str) -> None:
    crashing = Kubelet(
        driver=kube.driver, root=kube.root, env={**KUBELET_ENV, "FLEXHUB_TEST_CRASH_AT": point}
    )
    options = Kubelet.mount_options(VOL, pv="pv-1", pod_uid=uid)
    with pytest.raises(ReplyError):  # SIGKILLed: no reply at all
        crashing.mount(uid, "pv-1", options)


def test_sigkill_after_the_loop_device_is_attached_then_unmount_releases_it(
    kube: Kubelet, node_tree: dict[str, Path]
) -> None:
    uid = kube.new_pod_uid()
    _crash_mount(kube, uid, "attach-progress-loop")
    image = node_tree["loopfiles"] / "namespaces" / "default" / "vols" / "a.img"
    (loop,) = loops_of(image)
    backing = Path("/sys/block") / Path(loop).name / "loop" / "backing_file"
    assert backing.read_text().strip() == str(image)
    (record,) = (node_tree["state"] / "volumes").iterdir()
    assert json.loads(record.read_text())["partial"] == {"file": str(image), "loop": loop}
    # Attaching again is impossible now (as for a CHAP target whose secret only mount has):
    # the file is gone, and an attach would make a new one on another loop device.
    image.unlink()

    reply = kube.unmount(uid, "pv-1")
    assert reply is not None and reply.ok, reply
    assert not backing.exists()  # the very device the crashed attach made is released
    assert not image.exists()  # nothing was attached again (that would recreate the file)
    assert loops_of(image) == []
    assert mounts_under(node_tree["kubelet"]) == []
    assert not list((node_tree["state"] / "volumes").iterdir())
    log = (node_tree["log"] / "flexhub.log").read_text()
    assert f"releasing what it reported (file={image}, loop={loop})" in log
    assert "re-attaching" not in log


def test_sigkill_after_the_loop_device_is_attached_then_the_retry_reuses_it(
    kube: Kubelet, node_tree: dict[str, Path]
) -> None:
    uid = kube.new_pod_uid()
    _crash_mount(kube, uid, "attach-progress-loop")
    image = node_tree["loopfiles"] / "namespaces" / "default" / "vols" / "a.img"
    (loop,) = loops_of(image)
    options = Kubelet.mount_options(VOL, pv="pv-1", pod_uid=uid)
    reply = kube.call("mount", str(kube.pod_dir(uid, "pv-1")), json.dumps(options))
    assert reply.ok, reply
    assert loops_of(image) == [loop]
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]
    assert loops_of(image) == []
    assert not list((node_tree["state"] / "volumes").iterdir())
