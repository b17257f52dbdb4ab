"""What the loopfile root promises is counted per node, not per file (issue 19, finding 5), and
a refused mount creates nothing (finding 13).

The loopfile root is a real 360 MiB xfs filesystem (an image on a loop device, mounted in
tmp); the volumes are real loop devices on files in it, driven through the installed driver.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from flexhub_loopfile import LoopfileBackend, _room

from flexhub.admin.harness import DriverReply, Kubelet
from flexhub.backend import Volume, VolumeError
from tests.conftest import needs_root
from tests.loopfile.conftest import loops_of, mounts_under

pytestmark = [needs_root, pytest.mark.root]

MiB = 1024 * 1024
NOBODY = 65534


def listing(root: Path) -> list[tuple[str, int, int]]:
    """Every entry under ``root``: relative path, mode, size (what a refusal must not change)."""
    found = []
    for top, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            st = os.lstat(Path(top, name))
            size = 0 if os.path.isdir(Path(top, name)) else st.st_size
            found.append((str(Path(top, name).relative_to(root)), st.st_mode, size))
    return sorted(found)


@pytest.fixture
def small_root(node_tree: dict[str, Path], tmp_path: Path) -> Iterator[Path]:
    """The loopfile root on its own 360 MiB xfs filesystem (about 276 MiB free, as small as
    the root of the report)."""
    image = tmp_path / "root.img"
    with open(image, "wb") as f:
        f.truncate(360 * MiB)
    subprocess.run(["mkfs.xfs", "-q", str(image)], check=True, capture_output=True)
    root = node_tree["loopfiles"]
    root.mkdir(mode=0o700)
    subprocess.run(["mount", "-o", "loop", str(image), str(root)], check=True)
    yield root
    # the volumes' loop devices let go of their files asynchronously: wait for it a little
    for _ in range(50):
        if subprocess.run(["umount", str(root)], check=False, capture_output=True).returncode:
            time.sleep(0.1)
        else:
            break
    else:
        subprocess.run(["umount", "-l", str(root)], check=False)
    for loop in loops_of(image):
        subprocess.run(["losetup", "-d", loop], check=False)


@pytest.fixture
def rkube(small_root: Path, kubelet: Kubelet, node_tree: dict[str, Path]) -> Iterator[Kubelet]:
    """The kubelet of a node whose loopfile root is ``small_root``; cleans up before it goes."""
    yield kubelet
    for target in mounts_under(node_tree["kubelet"]):
        kubelet.call("unmount", target)
    for target in mounts_under(node_tree["state"]):
        subprocess.run(["umount", "-l", target], check=False)
    for loop in loops_of(small_root):
        subprocess.run(["losetup", "-d", loop], check=False)


def configure(node_tree: dict[str, Path], extra: str) -> None:
    config = node_tree["config"]
    config.write_text(config.read_text() + extra + "\n")


def mount(k: Kubelet, namespace: str, size: str, **kw: object) -> tuple[str, DriverReply]:
    uid = k.new_pod_uid()
    user = {"backend": "loopfile", "file": "data.img", "size": size, **kw}
    options = Kubelet.mount_options(user, pv="pv-1", pod_uid=uid, namespace=namespace)  # type: ignore[arg-type]
    reply = k.mount(uid, "pv-1", options)
    assert reply is not None
    return uid, reply


def area(root: Path, namespace: str) -> Path:
    return root / "namespaces" / namespace


def test_three_namespaces_cannot_promise_more_than_the_root_holds(
    rkube: Kubelet, small_root: Path
) -> None:
    """250, 200 and 200 MiB on a ~276 MiB root with overcommit 1: only the first is taken;
    the refusals name the sizes in MiB and leave the tree exactly as it was."""
    uid, first = mount(rkube, "team-a", "250Mi")
    assert first.ok, first.reply
    before = listing(small_root)
    for namespace in ("team-b", "team-c"):
        _, reply = mount(rkube, namespace, "200Mi")
        assert reply.status == "Failure", reply.reply
        assert "\n" not in reply.message and "MiB" in reply.message, reply.message
        assert "200.0 MiB" in reply.message and "overcommit 1" in reply.message, reply.message
        assert not area(small_root, namespace).exists()
        assert listing(small_root) == before
    # what was promised holds: team-a fills its volume and every write reaches the disk
    target = rkube.pod_dir(uid, "pv-1")
    block = os.urandom(MiB)
    fd = os.open(target / "fill", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for _ in range(200):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert rkube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]


def test_overcommit_is_a_factor_on_the_whole_root(
    rkube: Kubelet, small_root: Path, node_tree: dict[str, Path]
) -> None:
    """overcommit 2: 250 + 200 MiB fit in twice ~276 MiB, a third 200 MiB does not."""
    configure(node_tree, "overcommit = 2")
    for namespace in ("team-a", "team-b"):
        _, reply = mount(rkube, namespace, {"team-a": "250Mi"}.get(namespace, "200Mi"))
        assert reply.ok, reply.reply
    before = listing(small_root)
    _, third = mount(rkube, "team-c", "200Mi")
    assert third.status == "Failure" and "overcommit 2" in third.message, third.reply
    assert listing(small_root) == before


def test_expandfs_growth_counts_against_the_root(
    rkube: Kubelet, small_root: Path, node_tree: dict[str, Path]
) -> None:
    """Growing one file (expandfs) past what the root can still promise is refused, and the
    file keeps its size."""
    uid, first = mount(rkube, "team-a", "128Mi")
    assert first.ok, first.reply
    _, second = mount(rkube, "team-b", "100Mi")
    assert second.ok, second.reply
    image = area(small_root, "team-a") / "data.img"
    user = {"backend": "loopfile", "file": "data.img", "size": "128Mi"}
    reply = rkube.expandfs(uid, "pv-1", Kubelet.base_options(user, pv="pv-1"), 250 * MiB, 128 * MiB)
    assert reply.status == "Failure" and "250.0 MiB" in reply.message, reply.reply
    assert "\n" not in reply.message
    assert image.stat().st_size == 128 * MiB


def test_preallocated_file_cannot_take_what_sparse_files_were_promised(
    rkube: Kubelet, small_root: Path
) -> None:
    """A sparse 250 MiB file holds little, but a preallocated 100 MiB one beside it would
    take blocks the sparse one was promised: refused."""
    _, first = mount(rkube, "team-a", "250Mi")
    assert first.ok, first.reply
    before = listing(small_root)
    _, reply = mount(rkube, "team-b", "100Mi", preallocate="true")
    assert reply.status == "Failure" and "MiB" in reply.message, reply.reply
    assert listing(small_root) == before


def test_files_planted_by_another_user_or_outside_are_not_counted(
    rkube: Kubelet, small_root: Path, tmp_path: Path
) -> None:
    """Only root's regular files count: another user's huge sparse file, a symlink to a
    huge file elsewhere and a FIFO (never opened) neither block a mount nor hang the scan.
    The control: the same huge file owned by root does count."""
    evil = area(small_root, "evil")
    evil.mkdir(parents=True)
    os.chown(evil, NOBODY, NOBODY)
    huge = evil / "huge.img"
    with open(huge, "wb") as f:
        f.truncate(1 << 40)
    os.chown(huge, NOBODY, NOBODY)
    outside = tmp_path / "outside.img"
    with open(outside, "wb") as f:
        f.truncate(1 << 40)
    (evil / "link.img").symlink_to(outside)
    os.mkfifo(evil / "fifo")
    deep = evil
    for _ in range(200):  # deeper than any PV's file can be
        deep = deep / "d"
    deep.mkdir(parents=True)
    with open(deep / "deep.img", "wb") as f:
        f.truncate(1 << 40)
    uid, reply = mount(rkube, "team-a", "100Mi")
    assert reply.ok, reply.reply
    assert rkube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]
    os.chown(huge, 0, 0)
    _, refused = mount(rkube, "team-b", "100Mi")
    assert refused.status == "Failure" and "1.00 TiB" in refused.message, refused.reply


def test_leftover_of_a_killed_creation_does_not_block_its_retry(
    rkube: Kubelet, small_root: Path
) -> None:
    """A creation killed midway leaves its temporary file (here 250 MiB, as big as the file):
    the retry removes it and is not refused for the room the leftover seemed to promise."""
    leftover = area(small_root, "team-a") / ".data.img.0123abcd.flexhub-new"
    leftover.parent.mkdir(parents=True)
    with open(leftover, "wb") as f:
        f.truncate(250 * MiB)
    uid, reply = mount(rkube, "team-a", "250Mi")
    assert reply.ok, reply.reply
    assert not leftover.exists()
    assert rkube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]


def test_refused_mount_on_a_missing_root_creates_nothing(
    kubelet: Kubelet, node_tree: dict[str, Path]
) -> None:
    """A sparse size beyond what the root may promise: no root, no namespace area appears."""
    root = node_tree["loopfiles"]
    assert not root.exists()
    uid = kubelet.new_pod_uid()
    user = {"backend": "loopfile", "file": "a/b/c.img", "size": "1Ei"}
    reply = kubelet.mount(uid, "pv-1", Kubelet.mount_options(user, pv="pv-1", pod_uid=uid))
    assert reply is not None and reply.status == "Failure", reply and reply.reply
    assert "EiB" in reply.message or "TiB" in reply.message, reply.message
    assert not root.exists()


def test_two_namespaces_racing_for_the_last_room_get_it_once(
    rkube: Kubelet, small_root: Path
) -> None:
    """Two 200 MiB mounts at once on a ~276 MiB root: the account is checked and the file
    made under one lock, so exactly one of them is accepted."""
    replies: dict[str, DriverReply] = {}

    def run(namespace: str) -> None:
        replies[namespace] = mount(rkube, namespace, "200Mi")[1]

    threads = [threading.Thread(target=run, args=(ns,)) for ns in ("team-a", "team-b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(r.status for r in replies.values()) == ["Failure", "Success"], replies
    made = [ns for ns in ("team-a", "team-b") if (area(small_root, ns) / "data.img").exists()]
    assert len(made) == 1 and replies[made[0]].ok


def test_a_root_too_large_to_scan_is_refused(
    backend: LoopfileBackend, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More entries than the scan's bound: a clear refusal, and no file made."""
    monkeypatch.setattr(_room, "MAX_ENTRIES", 100)
    crowd = root / "crowd"
    crowd.mkdir(parents=True)
    for i in range(150):
        (crowd / f"f{i}").touch()
    with pytest.raises(VolumeError, match="more than 100 entries"):
        backend.attach(Volume(options={"backend": "loopfile", "file": "a.img", "size": "16Mi"}))
    assert not (root / "a.img").exists()


def test_human_units() -> None:
    assert _room.human(200 * MiB) == "200.0 MiB"
    assert _room.human(3 * MiB // 2) == "1.5 MiB"
    assert _room.human(3 << 29) == "1.50 GiB"
    assert _room.human(1 << 40) == "1.00 TiB"
    assert _room.human(1 << 60) == "1.00 EiB"
