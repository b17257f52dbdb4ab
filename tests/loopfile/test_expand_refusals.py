"""expandfs refuses, changing nothing, when growing would be wrong (real loops, installed driver).

Each refusal is checked by its effect: the reply is a Failure naming the reason, and neither the
backing file nor the mounted filesystem changed size.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from flexhub.admin.harness import Kubelet
from tests.conftest import needs_root
from tests.loopfile.test_driver_e2e import MiB, mount

pytestmark = [needs_root, pytest.mark.root]

USER = {"backend": "loopfile", "file": "grow.img", "size": "400Mi"}


def fs_size(target: Path) -> int:
    st = os.statvfs(target)
    return st.f_blocks * st.f_frsize


def expand(k: Kubelet, uid: str) -> tuple[str, str]:
    options = Kubelet.base_options(USER, pv="pv-1", fs_type="xfs")
    reply = k.expandfs(uid, "pv-1", options, 800 * MiB, 400 * MiB)
    return reply.status, reply.message


def test_refused_on_a_read_only_mount(kube: Kubelet, node_tree: dict[str, Path]) -> None:
    writer = kube.new_pod_uid()
    assert mount(kube, writer, USER, fs_type="xfs").ok
    assert kube.unmount(writer, "pv-1").ok  # type: ignore[union-attr]
    uid = kube.new_pod_uid()
    assert mount(kube, uid, USER, fs_type="xfs", read_only=True).ok
    target = kube.pod_dir(uid, "pv-1")
    before = fs_size(target)
    status, message = expand(kube, uid)
    assert status == "Failure" and "read-only" in message, message
    assert (
        node_tree["loopfiles"] / "namespaces" / "default" / "grow.img"
    ).stat().st_size == 400 * MiB
    assert fs_size(target) == before
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]


def test_refused_when_the_file_was_replaced(kube: Kubelet, node_tree: dict[str, Path]) -> None:
    uid = kube.new_pod_uid()
    assert mount(kube, uid, USER, fs_type="xfs").ok
    target = kube.pod_dir(uid, "pv-1")
    before = fs_size(target)
    image = node_tree["loopfiles"] / "namespaces" / "default" / "grow.img"
    other = node_tree["loopfiles"] / "namespaces" / "default" / "other.img"
    with open(other, "wb") as f:
        f.truncate(400 * MiB)
    os.rename(image, node_tree["loopfiles"] / "namespaces" / "default" / "old.img")
    os.rename(other, image)  # the path now names a file the loop device does not map
    status, message = expand(kube, uid)
    assert status == "Failure" and "no longer maps" in message, message
    assert image.stat().st_size == 400 * MiB
    assert (
        node_tree["loopfiles"] / "namespaces" / "default" / "old.img"
    ).stat().st_size == 400 * MiB
    assert fs_size(target) == before
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]


def test_refused_when_the_journal_names_another_device(
    kube: Kubelet,
    node_tree: dict[str, Path],
    tmp_path: Path,
) -> None:
    uid = kube.new_pod_uid()
    assert mount(kube, uid, USER, fs_type="xfs").ok
    target = kube.pod_dir(uid, "pv-1")
    before = fs_size(target)
    spare_file = tmp_path / "spare.img"
    with open(spare_file, "wb") as f:
        f.truncate(64 * MiB)
    spare = subprocess.run(
        ["losetup", "--find", "--show", str(spare_file)], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        # a stale record (e.g. written before a reboot renumbered the loops) names another loop
        (record_file,) = (node_tree["state"] / "volumes").glob("*.json")
        record = json.loads(record_file.read_text())
        record["device"] = spare
        record_file.write_text(json.dumps(record))
        status, message = expand(kube, uid)
        assert status == "Failure" and "no longer the device" in message, message
        assert spare_file.stat().st_size == 64 * MiB
        assert (
            node_tree["loopfiles"] / "namespaces" / "default" / "grow.img"
        ).stat().st_size == 400 * MiB
        assert fs_size(target) == before
    finally:
        subprocess.run(["losetup", "-d", spare], check=False)
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]
