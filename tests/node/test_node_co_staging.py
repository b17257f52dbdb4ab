"""A block volume staged for a CO (CSI ``NodeStageVolume``) can be unstaged by the kubelet.

Before the kubelet calls ``NodeUnstageVolume`` it looks for other mounts of the staged
filesystem (mount-utils ``GetMountRefs``: every other mount point with the same device and
root) and refuses while one exists whose path does not contain the staging path's part from
``/plugins/kubernetes.io/`` on (``HasMountRefs``). flexhub's own per-node staging mount is
such a mount, so under CSI its mount point repeats the CO's staging path below the volume's
staging directory. :func:`kubelet_refuses_unstage` is the kubelet's check, line for line;
real loop devices and mounts.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import Rig

from flexhub.node.mounts import MountTable, bind_mount, cleanup_mount_point
from flexhub.node.volumes import expand_volume, mount_volume, staging_dir, unmount_volume

pytestmark = pytest.mark.root

DRIVER = "flexhub.csi.k8s.io"


def kubelet_refuses_unstage(staging: Path) -> list[str]:
    """The mounts for which kubelet v1.37 refuses ``UnmountDevice`` of ``staging``:
    ``SearchMountPoints`` (same major:minor and root, not the path itself) filtered by
    ``HasMountRefs`` (a reference that contains the path from ``/plugins/kubernetes.io/`` on is
    the kubelet's own)."""
    table = MountTable()
    here = table.at(os.path.realpath(staging))
    assert here is not None, f"{staging} is not staged"
    refs = [
        entry.mount_point
        for entry in table.entries()
        if entry.major_minor == here.major_minor
        and entry.root == here.root
        and entry.mount_point != here.mount_point
    ]
    path = str(staging)
    prefix = "/plugins/kubernetes.io/"  # mount-utils kubernetesPluginPathPrefix
    find = path[path.index(prefix) :] if prefix in path else path
    return [ref for ref in refs if find not in ref]


def co_staging(rig: Rig, handle: str = "0" * 64) -> Path:
    path = rig.base / "kubelet" / "plugins" / "kubernetes.io" / "csi" / DRIVER / handle
    path = path / "globalmount"
    path.mkdir(parents=True)
    return path


def _unmount(rig: Rig, target: Path) -> None:
    unmount_volume(rig.node, target, lambda name: rig.backend)


def _device_mounts(rig: Rig, volume_id: str) -> list[str]:
    """Every mount point of the volume's device (its staging mounts and binds)."""
    record = rig.node.journal.get_volume(volume_id)
    assert record is not None
    number = os.stat(record.device).st_rdev
    wanted = f"{os.major(number)}:{os.minor(number)}"
    return [e.mount_point for e in MountTable().entries() if e.major_minor == wanted]


def test_the_kubelet_finds_no_foreign_reference_once_the_pods_are_gone(rig: Rig) -> None:
    """Staged for the CO and published to a pod: the pod's bind is a reference (the kubelet
    rightly waits for its unpublish); once it is gone, none is, and the unstage leaves no
    mount, loop device, record or staging directory (the repeated path included)."""
    volume = rig.volume(rig.file())
    stage = co_staging(rig)
    mount_volume(rig.node, rig.backend, stage, volume, stage=True)
    own = MountTable().at(stage)
    assert own is not None and own.fs_type == "ext4"
    pod = rig.pod("a")
    bind_mount(rig.node.runner, stage, pod, False, MountTable(), 30)
    assert kubelet_refuses_unstage(stage) == [str(pod)]
    cleanup_mount_point(rig.node.runner, pod, 30, MountTable())
    assert kubelet_refuses_unstage(stage) == []
    private = staging_dir(rig.node, rig.backend.volume_id(volume))
    assert (private / str(stage).lstrip("/")).is_dir()  # the repeated path
    _unmount(rig, stage)
    rig.assert_clean()


def test_the_co_s_unstage_is_idempotent_and_a_restage_is_one_mount(rig: Rig) -> None:
    volume = rig.volume(rig.file())
    stage = co_staging(rig)
    mount_volume(rig.node, rig.backend, stage, volume, stage=True)
    mount_volume(rig.node, rig.backend, stage, volume, stage=True)  # a retried NodeStage
    volume_id = rig.backend.volume_id(volume)
    assert len(_device_mounts(rig, volume_id)) == 2  # flexhub's staging and the CO's
    _unmount(rig, stage)
    _unmount(rig, stage)
    rig.assert_clean()


def test_a_volume_a_flexvolume_pod_has_staged_is_shared_never_mounted_twice(rig: Rig) -> None:
    """The same volume staged by the FlexVolume driver for a pod (or by an older flexhub)
    and then for the CO: one staging mount of the device, bound twice; each goes with its
    last user."""
    volume = rig.volume(rig.file())
    volume_id = rig.backend.volume_id(volume)
    pod = rig.pod("flex")
    mount_volume(rig.node, rig.backend, pod, volume)
    stage = co_staging(rig)
    mount_volume(rig.node, rig.backend, stage, volume, stage=True)
    flat = staging_dir(rig.node, volume_id)
    assert sorted(_device_mounts(rig, volume_id)) == sorted([str(flat), str(pod), str(stage)])
    _unmount(rig, stage)
    assert MountTable().at(flat) is not None  # the FlexVolume pod still uses it
    _unmount(rig, pod)
    rig.assert_clean()


def test_a_co_staged_xfs_volume_grows_through_its_staging_path(rig: Rig) -> None:
    file = rig.file()
    volume = rig.volume(file, fs_type="xfs")
    with open(file, "r+b") as handle:
        handle.truncate(320 << 20)
    stage = co_staging(rig)
    mount_volume(rig.node, rig.backend, stage, volume, stage=True)
    before = os.statvfs(stage)
    expand_volume(rig.node, rig.backend, stage, volume, 640 << 20)
    after = os.statvfs(stage)
    assert after.f_blocks * after.f_frsize > before.f_blocks * before.f_frsize + (200 << 20)
    _unmount(rig, stage)
    rig.assert_clean()


def test_a_staging_path_that_climbs_stays_under_the_state_directory(rig: Rig) -> None:
    """A CO staging path is normalised before it is repeated: ``..`` cannot lead flexhub's
    staging mount out of its own directory."""
    volume = rig.volume(rig.file())
    stage = co_staging(rig)
    climbing = Path(f"{stage}/../../{stage.parent.name}/globalmount")
    mount_volume(rig.node, rig.backend, climbing, volume, stage=True)
    root = str(rig.state / "staging") + "/"
    staged = [
        e.mount_point
        for e in MountTable().entries()
        if e.mount_point.startswith(root)
    ]  # fmt: skip
    assert len(staged) == 1 and ".." not in staged[0] and staged[0].endswith(str(stage))
    _unmount(rig, stage)
    rig.assert_clean()
