"""loopfile through the installed driver with a state_dir that turned read-only (real mounts)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from flexhub.admin.harness import Kubelet
from tests.conftest import needs_root
from tests.loopfile.conftest import loops_of, mounts_under
from tests.loopfile.test_driver_e2e import VOL, mount

pytestmark = [needs_root, pytest.mark.root]


def test_unmount_with_a_read_only_state_dir_unmounts_and_detaches(
    kube: Kubelet, node_tree: dict[str, Path]
) -> None:
    state = node_tree["state"]
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "state", str(state)], check=True)
    uid = kube.new_pod_uid()
    assert mount(kube, uid, VOL).ok
    image = node_tree["loopfiles"] / "namespaces" / "default" / "vols" / "a.img"
    assert len(loops_of(image)) == 1
    subprocess.run(["mount", "-o", "remount,ro", str(state)], check=True)

    reply = kube.unmount(uid, "pv-1")
    assert reply is not None and reply.ok, reply
    assert "journal not updated" in reply.message
    assert mounts_under(node_tree["kubelet"]) == []
    assert mounts_under(state) == [str(state)]  # only the tmpfs itself: staging unmounted
    assert loops_of(image) == []  # the loop device too (its ownership marker stays)
    log = (node_tree["log"] / "flexhub.log").read_text()
    assert "cannot remove the marker of" in log


@pytest.mark.parametrize(
    "options",
    [
        {**VOL, "size": "lots"},  # refused by the schema, before the node services
        {**VOL, "file": "../escape.img"},  # refused by the backend
        {**VOL, "fsType": "nosuchfs"},  # a failing mkfs, after the node services
    ],
)
def test_a_first_mount_that_fails_leaves_state_dir_private(
    kube: Kubelet, node_tree: dict[str, Path], options: dict[str, str]
) -> None:
    state = node_tree["state"]
    assert not state.exists()
    reply = mount(kube, kube.new_pod_uid(), options)
    assert reply.status == "Failure", reply.reply
    assert state.is_dir()  # the call made it (the memo and the locks live there)
    modes = {
        str(p.relative_to(state.parent)): f"{p.stat().st_mode & 0o7777:04o}"
        for p in [state, *state.iterdir()]
        if p.is_dir()
    }
    assert set(modes.values()) == {"0700"}, modes
