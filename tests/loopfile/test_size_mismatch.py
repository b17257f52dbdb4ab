"""A loopfile's ``size`` is never ignored once the file exists (issue 19, finding 6).

Through the installed driver with real loop devices: a file the failing mount created is
removed by its rollback; an existing file smaller than ``size`` is refused with both sizes
named (never mounted at its old size); a larger one mounts and says so in the log.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flexhub.admin.harness import Kubelet
from tests.conftest import needs_root
from tests.loopfile.conftest import loops_of, mounts_under
from tests.loopfile.test_driver_e2e import mount

pytestmark = [needs_root, pytest.mark.root]

MiB = 1024 * 1024


def fs_size(target: Path) -> int:
    st = os.statvfs(target)
    return st.f_blocks * st.f_frsize


def image(node_tree: dict[str, Path], name: str = "x.img") -> Path:
    return node_tree["loopfiles"] / "namespaces" / "default" / name


def test_failed_first_mount_removes_the_file_it_created(
    kube: Kubelet,
    node_tree: dict[str, Path],
) -> None:
    """xfs below 300 MB cannot be made: the file this call created goes with the rollback,
    and the fixed PV (512Mi) then gets a 512 MiB filesystem."""
    small = {"backend": "loopfile", "file": "x.img", "size": "256Mi"}
    reply = mount(kube, kube.new_pod_uid(), small, fs_type="xfs")
    assert reply.status == "Failure", reply.reply
    assert not node_tree["loopfiles"].exists()  # nor the directories it made for the file
    assert loops_of(node_tree["loopfiles"]) == [] and mounts_under(node_tree["state"]) == []
    uid = kube.new_pod_uid()
    reply = mount(kube, uid, {**small, "size": "512Mi"}, fs_type="xfs")
    assert reply.ok, reply.reply
    assert image(node_tree).stat().st_size == 512 * MiB
    assert fs_size(kube.pod_dir(uid, "pv-1")) > 400 * MiB  # xfs keeps its log out of f_blocks
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]


def test_failed_mount_keeps_a_file_it_did_not_create(
    kube: Kubelet,
    node_tree: dict[str, Path],
) -> None:
    """An existing ext4 file asked for as xfs fails, and the file (with its data) stays."""
    user = {"backend": "loopfile", "file": "x.img", "size": "64Mi"}
    uid = kube.new_pod_uid()
    assert mount(kube, uid, user).ok
    (kube.pod_dir(uid, "pv-1") / "keep").write_text("data")
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]
    reply = mount(kube, kube.new_pod_uid(), user, fs_type="xfs")
    assert reply.status == "Failure", reply.reply
    assert image(node_tree).stat().st_size == 64 * MiB
    uid = kube.new_pod_uid()
    assert mount(kube, uid, user).ok
    assert (kube.pod_dir(uid, "pv-1") / "keep").read_text() == "data"
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]


def test_smaller_file_than_size_is_refused_naming_both(
    kube: Kubelet,
    node_tree: dict[str, Path],
) -> None:
    """A 256 MiB file and a PV of 512Mi: Failure naming both sizes, the file unchanged; the
    same while the 256 MiB volume is staged for another pod (which never calls attach)."""
    user = {"backend": "loopfile", "file": "x.img", "size": "256Mi"}
    bigger = {**user, "size": "512Mi"}
    uid = kube.new_pod_uid()
    assert mount(kube, uid, user).ok
    for staged in (True, False):
        reply = mount(kube, kube.new_pod_uid(), bigger)
        assert reply.status == "Failure", reply.reply
        assert "256.0 MiB" in reply.message and "512.0 MiB" in reply.message, reply.message
        assert image(node_tree).stat().st_size == 256 * MiB
        if staged:
            assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]
    assert loops_of(node_tree["loopfiles"]) == [] and mounts_under(node_tree["state"]) == []
    reply = mount(kube, kube.new_pod_uid(), bigger, read_only=True)
    assert reply.status == "Failure" and "512.0 MiB" in reply.message, reply.reply


def test_larger_file_than_size_mounts_and_says_so(
    kube: Kubelet,
    node_tree: dict[str, Path],
) -> None:
    """A PV of 256Mi on a 512 MiB file (e.g. grown by expandfs since): mounted at 512 MiB,
    the shrink it would ask for is logged as not done."""
    user = {"backend": "loopfile", "file": "x.img", "size": "512Mi"}
    uid = kube.new_pod_uid()
    assert mount(kube, uid, user).ok
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]
    uid = kube.new_pod_uid()
    reply = mount(kube, uid, {**user, "size": "256Mi"})
    assert reply.ok, reply.reply
    assert fs_size(kube.pod_dir(uid, "pv-1")) > 450 * MiB
    log = (node_tree["log"] / "flexhub.log").read_text()
    assert "larger than option 'size'" in log and "not shrunk" in log
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]


def given_image(node_tree: dict[str, Path], size: int) -> Path:
    """An operator's pre-provisioned image of ``size`` bytes (as `truncate -s` makes it)."""
    img = image(node_tree, "given.img")
    img.parent.mkdir(parents=True, exist_ok=True)
    with open(img, "wb") as handle:
        handle.truncate(size)
    os.chmod(img, 0o600)
    return img


def test_a_file_of_exactly_size_bytes_mounts(
    kube: Kubelet,
    node_tree: dict[str, Path],
) -> None:
    """ "100M" is 100,000,000 bytes, not a multiple of 4096: a file of exactly that many bytes
    is what the PV asks for and mounts, unchanged (only a file flexhub makes is rounded)."""
    img = given_image(node_tree, 100_000_000)
    uid = kube.new_pod_uid()
    reply = mount(kube, uid, {"backend": "loopfile", "file": "given.img", "size": "100M"})
    assert reply.ok, reply.reply
    assert fs_size(kube.pod_dir(uid, "pv-1")) > 80 * MiB
    assert img.stat().st_size == 100_000_000
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]
    assert "larger than option 'size'" not in (node_tree["log"] / "flexhub.log").read_text()


def test_a_file_a_byte_short_is_refused_in_exact_bytes(
    kube: Kubelet,
    node_tree: dict[str, Path],
) -> None:
    """One byte short of "100M": refused, and since both print as 95.4 MiB the message gives
    the exact byte counts."""
    img = given_image(node_tree, 99_999_999)
    reply = mount(
        kube, kube.new_pod_uid(), {"backend": "loopfile", "file": "given.img", "size": "100M"}
    )
    assert reply.status == "Failure", reply.reply
    assert "is 99999999 bytes but option 'size' asks for 100000000 bytes" in reply.message
    assert "\n" not in reply.message
    assert img.stat().st_size == 99_999_999
    assert loops_of(node_tree["loopfiles"]) == [] and mounts_under(node_tree["state"]) == []
