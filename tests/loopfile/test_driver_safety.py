"""Data safety through the installed driver with real loop devices (issue 10): unknown data
in a loopfile is never formatted, a symlinked kubelet root, expandfs of a file that is
already large enough."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from flexhub.admin.harness import DriverReply, Kubelet
from tests.conftest import needs_root
from tests.loopfile.conftest import loops_of, mounts_under
from tests.loopfile.test_driver_e2e import mount

pytestmark = [needs_root, pytest.mark.root]

MiB = 1024 * 1024


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tar_image(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = b"id,name\n1,precious\n" * 500
    with tarfile.open(path, "w") as archive:
        info = tarfile.TarInfo("dump.csv")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    os.truncate(path, 64 * MiB)


def test_loopfile_holding_a_tar_archive_is_never_formatted(
    kube: Kubelet,
    node_tree: dict[str, Path],
) -> None:
    image = node_tree["loopfiles"] / "namespaces" / "default" / "vols" / "a.img"
    _tar_image(image)
    before = _sha(image)
    uid = kube.new_pod_uid()
    reply = mount(kube, uid, {"backend": "loopfile", "file": "vols/a.img"})
    assert reply.status == "Failure", reply.reply
    assert str(image) in reply.message and "cannot identify" in reply.message, reply.message
    assert _sha(image) == before
    assert loops_of(image) == [] and mounts_under(node_tree["kubelet"]) == []


@pytest.fixture
def linked(kube: Kubelet, tmp_path: Path) -> Iterator[Kubelet]:
    """kubelet's root is a symlink to a 'data disk' directory, as operators often set up."""
    disk = (tmp_path / "data-disk" / "kubelet").resolve()
    disk.mkdir(parents=True)
    link = tmp_path / "kubelet-link"
    link.symlink_to(disk)
    yield Kubelet(driver=kube.driver, root=link)
    for point in reversed(mounts_under(disk)):
        subprocess.run(["umount", "-l", point], check=False)


def _resolved_mounts(linked: Kubelet) -> list[str]:
    return mounts_under(Path(os.path.realpath(linked.root)))


def test_symlinked_kubelet_root_mount_read_only_and_unmount(
    linked: Kubelet, node_tree: dict[str, Path]
) -> None:
    writer, reader = linked.new_pod_uid(), linked.new_pod_uid()
    vol = {"backend": "loopfile", "file": "vols/s.img", "size": "64Mi"}
    assert mount(linked, writer, vol).ok
    (linked.pod_dir(writer, "pv-1") / "f").write_text("data")
    reply = mount(linked, reader, vol, read_only=True)
    assert reply.ok, reply.reply
    target = linked.pod_dir(reader, "pv-1")
    assert (target / "f").read_text() == "data"
    with pytest.raises(OSError):
        (target / "g").write_text("no")
    assert len(_resolved_mounts(linked)) == 2
    # unmount with the symlinked path (as kubelet passes it): really unmounted
    assert linked.unmount(reader, "pv-1").ok  # type: ignore[union-attr]
    assert len(_resolved_mounts(linked)) == 1
    # and with the resolved path (either form finds the record)
    real = Path(os.path.realpath(linked.pod_dir(writer, "pv-1")))
    done = linked.call("unmount", str(real))
    assert done.ok, done.reply
    image = node_tree["loopfiles"] / "namespaces" / "default" / "vols" / "s.img"
    assert _resolved_mounts(linked) == [] and loops_of(image) == []
    assert mounts_under(node_tree["state"]) == []
    assert not list((node_tree["state"] / "pods").iterdir())
    assert not list((node_tree["state"] / "volumes").iterdir())


def test_pod_record_of_an_older_flexhub_keyed_by_the_symlinked_path(
    linked: Kubelet, node_tree: dict[str, Path]
) -> None:
    """A record written under the unresolved path (before the upgrade) is still found."""
    from flexhub.config import NodeConfig
    from flexhub.node.journal import Journal

    uid = linked.new_pod_uid()
    assert mount(linked, uid, {"backend": "loopfile", "file": "o.img", "size": "64Mi"}).ok
    given = linked.pod_dir(uid, "pv-1")
    journal = Journal(NodeConfig(state_dir=node_tree["state"]).state_dir)
    real = Path(os.path.realpath(given))
    record = journal.get_pod(real)
    assert record is not None
    journal.put_pod(record.replace(target=str(given)))  # what the old code wrote
    journal.delete_pod(real)
    assert linked.unmount(uid, "pv-1").ok  # type: ignore[union-attr]
    assert _resolved_mounts(linked) == [] and mounts_under(node_tree["state"]) == []
    assert loops_of(node_tree["loopfiles"] / "namespaces" / "default" / "o.img") == []
    assert not list((node_tree["state"] / "pods").iterdir())


def _df(target: Path) -> int:
    out = subprocess.run(
        ["df", "-B1", "--output=size", str(target)], capture_output=True, text=True, check=True
    ).stdout
    return int(out.split()[1])


def test_expandfs_when_the_file_is_already_large_enough(
    kube: Kubelet,
    node_tree: dict[str, Path],
) -> None:
    uid = kube.new_pod_uid()
    user = {"backend": "loopfile", "file": "big.img", "size": "400Mi"}
    assert mount(kube, uid, user, fs_type="xfs").ok
    target = kube.pod_dir(uid, "pv-1")
    options = Kubelet.base_options(user, pv="pv-1", fs_type="xfs")
    # the PV says 400M, the file is 400Mi: a PVC of 410M is still below the file's size
    reply: DriverReply = kube.expandfs(uid, "pv-1", options, 410 * 10**6, 400 * 10**6)
    assert reply.ok, reply.reply
    # an expandfs that grew the file and died before the filesystem: the retry grows it
    before = _df(target)
    os.truncate(node_tree["loopfiles"] / "namespaces" / "default" / "big.img", 800 * MiB)
    reply = kube.expandfs(uid, "pv-1", options, 700 * 10**6, 410 * 10**6)
    assert reply.ok, reply.reply
    assert _df(target) > before + 300 * MiB, (before, _df(target))
    assert (
        os.stat(node_tree["loopfiles"] / "namespaces" / "default" / "big.img").st_size == 800 * MiB
    )  # never shrunk
    shrink = kube.expandfs(uid, "pv-1", options, 300 * 10**6, 700 * 10**6)
    assert shrink.status == "Failure" and "shrink" in shrink.message
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]


def test_symlinked_kubelet_root_unmount_really_unmounts(
    linked: Kubelet, node_tree: dict[str, Path]
) -> None:
    uid = linked.new_pod_uid()
    assert mount(linked, uid, {"backend": "loopfile", "file": "u.img", "size": "64Mi"}).ok
    assert len(_resolved_mounts(linked)) == 1
    assert linked.unmount(uid, "pv-1").ok  # type: ignore[union-attr]
    # before: "Success" while the bind, the staging mount and the loop device stayed
    assert _resolved_mounts(linked) == [] and mounts_under(node_tree["state"]) == []
    assert loops_of(node_tree["loopfiles"] / "namespaces" / "default" / "u.img") == []


def test_symlinked_kubelet_root_expandfs_grows_the_volume(
    linked: Kubelet, node_tree: dict[str, Path]
) -> None:
    """expandfs names the pod directory through the symlink, as kubelet does: the pod record
    (kept under the resolved path) is found and the xfs filesystem really grows."""
    uid = linked.new_pod_uid()
    user = {"backend": "loopfile", "file": "grow.img", "size": "400Mi"}
    assert mount(linked, uid, user, fs_type="xfs").ok
    target = linked.pod_dir(uid, "pv-1")
    before = _df(target)
    options = Kubelet.base_options(user, pv="pv-1", fs_type="xfs")
    reply = linked.expandfs(uid, "pv-1", options, 800 * MiB, 400 * MiB)
    assert reply.ok, reply.reply
    assert _df(target) > before + 300 * MiB, (before, _df(target))
    image = node_tree["loopfiles"] / "namespaces" / "default" / "grow.img"
    assert image.stat().st_size == 800 * MiB
    assert linked.unmount(uid, "pv-1").ok  # type: ignore[union-attr]
