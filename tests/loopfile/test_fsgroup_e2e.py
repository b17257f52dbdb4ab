"""fsGroup for loopfile, end to end through the installed driver on real loop devices.

The driver reports ``fsGroup: false`` and applies the pod's fsGroup itself: the volume's root
directory only gets the group, ``g+rwx`` and setgid; nothing below it is touched; a read-only
mount changes nothing; kubelet's legacy key ``kubernetes.io/fsGroup`` works too.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from flexhub.admin.harness import Kubelet
from tests.conftest import needs_root
from tests.loopfile.test_driver_e2e import VOL, mount

pytestmark = [needs_root, pytest.mark.root]

GID = 4321


def seed(k: Kubelet) -> None:
    """Make the volume with a root-owned tree in it, then unmount."""
    uid = k.new_pod_uid()
    assert mount(k, uid, VOL).ok
    root = k.pod_dir(uid, "pv-1")
    (root / "sub" / "deep").mkdir(parents=True)
    (root / "sub" / "file").write_text("x")
    os.chmod(root, 0o755)
    assert k.unmount(uid, "pv-1").ok  # type: ignore[union-attr]


def owners(root: Path) -> dict[str, tuple[int, int]]:
    """gid and permission bits of everything below ``root`` (not root itself)."""
    return {
        str(p.relative_to(root)): (p.stat().st_gid, stat.S_IMODE(p.stat().st_mode))
        for p in sorted(root.rglob("*"))
        if p.name != "lost+found" and "lost+found" not in p.parts
    }


def test_fs_group_sets_the_root_only(kube: Kubelet) -> None:
    seed(kube)
    uid = kube.new_pod_uid()
    assert mount(kube, uid, VOL, fs_group=GID).ok
    root = kube.pod_dir(uid, "pv-1")
    info = root.stat()
    assert info.st_gid == GID
    assert stat.S_IMODE(info.st_mode) == 0o2775  # g+rwx and setgid added, the rest kept
    assert owners(root) == {"sub": (0, 0o755), "sub/deep": (0, 0o755), "sub/file": (0, 0o644)}
    (root / "new").write_text("made by the pod")  # setgid: new files inherit the group
    assert (root / "new").stat().st_gid == GID
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]


def test_read_only_mount_changes_nothing(kube: Kubelet) -> None:
    seed(kube)
    uid = kube.new_pod_uid()
    assert mount(kube, uid, VOL, fs_group=GID, read_only=True).ok
    info = kube.pod_dir(uid, "pv-1").stat()
    assert (info.st_gid, stat.S_IMODE(info.st_mode)) == (0, 0o755)
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]


def test_legacy_fs_group_key(kube: Kubelet) -> None:
    uid = kube.new_pod_uid()
    assert mount(kube, uid, {**VOL, "kubernetes.io/fsGroup": "777"}).ok
    info = kube.pod_dir(uid, "pv-1").stat()
    assert info.st_gid == 777 and info.st_mode & stat.S_ISGID
    assert kube.unmount(uid, "pv-1").ok  # type: ignore[union-attr]
