"""Attacks on the CO staging layout (flexhub's own staging mount repeating the CO's staging
path below ``<state_dir>/staging/<hash>/``): the volume staged elsewhere already (FlexVolume
first, an older flexhub, a second staging path), a lost volume record, raw and file system
of one volume, odd and very long staging paths. Real loop devices and mounts; the kubelet's
check is mount-utils' own (``GetMountRefs`` then ``HasMountRefs`` from
``/plugins/kubernetes.io/`` on).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import Rig
from test_node_co_staging import DRIVER

from flexhub.admin.state import node_state, render_state
from flexhub.errors import FlexhubError, VolumeError
from flexhub.node.mounts import MountTable, bind_mount, cleanup_mount_point
from flexhub.node.volumes import mount_volume, staging_dir, unmount_volume

pytestmark = pytest.mark.root

_PREFIX = "/plugins/kubernetes.io/"  # mount-utils' kubernetesPluginPathPrefix


def kubelet_refs(staging: Path) -> list[str]:
    """The references for which kubelet v1.37 refuses ``UnmountDevice`` of ``staging``:
    ``SearchMountPoints`` (the mount ``staging`` is in, then every other mount with its
    major:minor and root) filtered by ``HasMountRefs``."""
    real = os.path.realpath(staging)
    entries = list(MountTable().entries())
    here = None
    for entry in reversed(entries):  # later mounts overlap earlier ones
        if real == entry.mount_point or real.startswith(entry.mount_point.rstrip("/") + "/"):
            here = entry
            break
    assert here is not None
    rest = real[len(here.mount_point) :] if here.mount_point != "/" else real
    root = os.path.normpath(here.root + "/" + rest.lstrip("/")) if rest else here.root
    refs = [
        e.mount_point
        for e in entries
        if e is not here and e.root == root and e.major_minor == here.major_minor
    ]
    path = str(staging)
    find = path[path.index(_PREFIX) :] if _PREFIX in path else path
    return [ref for ref in refs if find not in ref]


def co_staging(rig: Rig, handle: str) -> Path:
    path = rig.base / "kubelet/plugins/kubernetes.io/csi" / DRIVER / handle / "globalmount"
    path.mkdir(parents=True)
    return path


def _unmount(rig: Rig, target: Path) -> None:
    unmount_volume(rig.node, target, lambda name: rig.backend)


def _number(device: str) -> str:
    rdev = os.stat(device).st_rdev
    return f"{os.major(rdev)}:{os.minor(rdev)}"


def _staging_mounts(rig: Rig, device: str) -> list[str]:
    """The mounts of ``device`` below the state directory's staging root."""
    root = os.path.realpath(rig.state / "staging") + "/"
    wanted = _number(device)
    return [
        e.mount_point
        for e in MountTable().entries()
        if e.major_minor == wanted and e.mount_point.startswith(root)
    ]


def test_a_co_stage_after_the_volume_record_is_lost_never_mounts_into_the_volume(
    rig: Rig,
) -> None:
    """A FlexVolume pod staged the volume (flat), then its volume record became unreadable
    (the journal falls back to the mount table): a CO stage must not create its staging
    directories inside the mounted volume (its data) nor mount the device a second time."""
    volume = rig.volume(rig.file())
    volume_id = rig.backend.volume_id(volume)
    pod = rig.pod("flex")
    mount_volume(rig.node, rig.backend, pod, volume)
    record = rig.node.journal.get_volume(volume_id)
    assert record is not None
    for path in (rig.state / "volumes").iterdir():
        path.write_bytes(b"\x00garbage")
    stage = co_staging(rig, "2" * 64)
    mount_volume(rig.node, rig.backend, stage, volume, stage=True)
    assert sorted(os.listdir(pod)) == ["lost+found"], "staging directories in the user's data"
    assert _staging_mounts(rig, record.device) == [str(staging_dir(rig.node, volume_id))]
    _unmount(rig, stage)
    assert MountTable().is_mount_point(pod)
    _unmount(rig, pod)
    rig.assert_clean()


def test_a_flexvolume_mount_after_the_volume_record_is_lost_never_mounts_twice(
    rig: Rig,
) -> None:
    """The CO staged the volume (nested), its volume record became unreadable, then a
    FlexVolume pod mounts it: one staging mount of the device, not a second one on the flat
    path above the nested one (which would hide it)."""
    volume = rig.volume(rig.file())
    volume_id = rig.backend.volume_id(volume)
    stage = co_staging(rig, "3" * 64)
    mount_volume(rig.node, rig.backend, stage, volume, stage=True)
    record = rig.node.journal.get_volume(volume_id)
    assert record is not None
    for path in (rig.state / "volumes").iterdir():
        path.write_bytes(b"\x00garbage")
    pod = rig.pod("flex")
    mount_volume(rig.node, rig.backend, pod, volume)
    assert len(_staging_mounts(rig, record.device)) == 1
    _unmount(rig, pod)
    assert MountTable().is_mount_point(stage)
    _unmount(rig, stage)
    rig.assert_clean()


@pytest.mark.parametrize("name", ["with space", "tab\there", "new\nline", "back\\slash", "é✓"])
def test_odd_characters_in_the_co_staging_path(rig: Rig, name: str) -> None:
    volume = rig.volume(rig.file())
    stage = rig.base / "kubelet" / name / "plugins/kubernetes.io/csi" / DRIVER / "h/globalmount"
    stage.mkdir(parents=True)
    mount_volume(rig.node, rig.backend, stage, volume, stage=True)
    assert kubelet_refs(stage) == []
    pod = rig.pod("a")
    bind_mount(rig.node.runner, stage, pod, False, MountTable(), 30)
    assert kubelet_refs(stage) == [str(pod)]
    cleanup_mount_point(rig.node.runner, pod, 30, MountTable())
    _unmount(rig, stage)
    rig.assert_clean()


def test_a_co_staging_path_too_long_to_repeat_is_a_clear_error_and_changes_nothing(
    rig: Rig,
) -> None:
    """A staging path the CO can use (under PATH_MAX) but too long to repeat below the
    state directory: a one-line error, nothing staged, attached or recorded."""
    volume = rig.volume(rig.file())
    room = 4080 - len(str(rig.base))
    parts = ["d" * 200] * (room // 201)
    parts.append("e" * (room - 201 * len(parts) - 1))
    stage = rig.base.joinpath(*parts)
    os.makedirs(stage)
    assert 4000 < len(str(stage)) < 4095
    with pytest.raises(FlexhubError) as info:
        mount_volume(rig.node, rig.backend, stage, volume, stage=True)
    assert "\n" not in str(info.value)
    rig.assert_clean()


def test_the_changelog_s_upgrade_procedure_for_a_volume_staged_flat(rig: Rig) -> None:
    """A CSI volume staged and published by the earlier flexhub (its staging mount flat),
    restaged by the kubelet after the upgrade (shared where it is), its pod gone: `flexhub
    state` names the mount to unmount, and after that `umount` the kubelet unstages and
    flexhub releases everything (CHANGELOG, Unreleased)."""
    volume = rig.volume(rig.file())
    flat = staging_dir(rig.node, rig.backend.volume_id(volume))
    stage = co_staging(rig, "6" * 64)
    mount_volume(rig.node, rig.backend, stage, volume)  # the earlier flexhub: flat
    pod = rig.pod("a")
    bind_mount(rig.node.runner, stage, pod, False, MountTable(), 30)
    mount_volume(rig.node, rig.backend, stage, volume, stage=True)  # after the upgrade
    assert _staging_mounts(
        rig, rig.node.journal.get_volume(rig.backend.volume_id(volume)).device
    ) == [str(flat)]
    cleanup_mount_point(rig.node.runner, pod, 30, MountTable())
    assert kubelet_refs(stage) == [str(flat)]
    shown = "\n".join(render_state(node_state(rig.config)))
    assert str(flat) in shown, f"`flexhub state` does not name {flat}:\n{shown}"
    subprocess.run(["umount", str(flat)], check=True)
    assert kubelet_refs(stage) == []
    _unmount(rig, stage)
    rig.assert_clean()


def test_a_propagated_copy_of_the_staging_mount_keeps_the_kubelet_s_path(rig: Rig) -> None:
    """The state directory on a shared mount with a peer elsewhere (mount propagation): the
    copy of flexhub's staging mount that appears at the peer repeats the CO's path too, so
    the kubelet's check still passes, and the unstage takes the copy with it."""
    rig.state.mkdir()
    peer = rig.base / "peer"
    peer.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "state", str(rig.state)], check=True)
    subprocess.run(["mount", "--make-shared", str(rig.state)], check=True)
    subprocess.run(["mount", "--bind", str(rig.state), str(peer)], check=True)
    volume = rig.volume(rig.file())
    stage = co_staging(rig, "7" * 64)
    mount_volume(rig.node, rig.backend, stage, volume, stage=True)
    device = rig.node.journal.get_volume(rig.backend.volume_id(volume)).device
    copies = [
        e.mount_point
        for e in MountTable().entries()
        if e.major_minor == _number(device) and e.mount_point.startswith(f"{peer}/")
    ]
    assert len(copies) == 1 and copies[0].endswith(str(stage))  # propagated, path repeated
    assert kubelet_refs(stage) == []
    _unmount(rig, stage)
    assert [p for p in rig.mounts() if p not in (str(rig.state), str(peer))] == []
    assert rig.loops() == [] and rig.records() == [] and rig.staging_dirs() == []


def test_a_volume_a_flexvolume_pod_staged_first_unstages_after_the_documented_umount(
    rig: Rig,
) -> None:
    """FlexVolume pod first, then the CO shares its flat staging mount; once the pod is gone
    the flat mount stays (the CO's staging uses it) and the kubelet waits for it: the
    documented `umount` of the mount `flexhub state` names lets the kubelet unstage and
    flexhub release everything (docs/csi.md)."""
    volume = rig.volume(rig.file())
    flat = staging_dir(rig.node, rig.backend.volume_id(volume))
    pod = rig.pod("flex")
    mount_volume(rig.node, rig.backend, pod, volume)
    stage = co_staging(rig, "8" * 64)
    mount_volume(rig.node, rig.backend, stage, volume, stage=True)
    _unmount(rig, pod)
    assert kubelet_refs(stage) == [str(flat)]
    assert f"    staging {flat}" in render_state(node_state(rig.config))
    subprocess.run(["umount", str(flat)], check=True)
    assert kubelet_refs(stage) == []
    _unmount(rig, stage)
    rig.assert_clean()


def test_a_co_unstage_with_a_read_only_then_full_state_dir(rig: Rig) -> None:
    """The CO's unstage with the state dir read-only unmounts and releases (the records and
    the repeated directories stay); writable again, the retried unstage forgets the records
    and removes the repeated directories. A stage into a full state dir fails cleanly."""
    rig.state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "state", str(rig.state)], check=True)
    volume = rig.volume(rig.file())
    stage = co_staging(rig, "9" * 64)
    mount_volume(rig.node, rig.backend, stage, volume, stage=True)
    subprocess.run(["mount", "-o", "remount,ro", str(rig.state)], check=True)
    note = unmount_volume(rig.node, stage, lambda name: rig.backend)
    assert "journal not updated" in note
    assert [m for m in rig.mounts() if m != str(rig.state)] == [] and rig.loops() == []
    subprocess.run(["mount", "-o", "remount,rw", str(rig.state)], check=True)
    assert unmount_volume(rig.node, stage, lambda name: rig.backend) == ""
    assert rig.records() == [] and rig.staging_dirs() == []
    with open(rig.state / "filler", "wb") as handle, pytest.raises(OSError):
        while True:
            handle.write(b"\0" * 65536)
            handle.flush()
    with pytest.raises(FlexhubError):
        mount_volume(rig.node, rig.backend, stage, volume, stage=True)
    assert [m for m in rig.mounts() if m != str(rig.state)] == [] and rig.loops() == []
    assert rig.staging_dirs() == []


def test_a_flexvolume_mount_racing_a_co_stage_mounts_the_device_once(rig: Rig) -> None:
    """A FlexVolume pod's mount and the CO's stage of one volume at once (the volume lock
    orders them): one staging mount of the device, both bound, both unmounted cleanly."""
    import threading

    volume = rig.volume(rig.file())
    pod, stage = rig.pod("flex"), co_staging(rig, "c" * 64)
    errors: list[BaseException] = []

    def run(target: Path, as_stage: bool) -> None:
        try:
            mount_volume(rig.node, rig.backend, target, volume, stage=as_stage)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(pod, False)),
        threading.Thread(target=run, args=(stage, True)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    device = rig.node.journal.get_volume(rig.backend.volume_id(volume)).device
    assert len(_staging_mounts(rig, device)) == 1
    assert MountTable().is_mount_point(pod) and MountTable().is_mount_point(stage)
    _unmount(rig, stage)
    _unmount(rig, pod)
    rig.assert_clean()


def test_a_co_unstage_with_every_record_unreadable_finds_the_nested_staging(rig: Rig) -> None:
    """Pod and volume records unreadable: the unstage finds flexhub's staging mount (nested)
    in the mount table, unmounts it, forgets the unreadable volume record by its hash
    (``staging_key``) and removes the repeated directories; only the device stays attached
    (no record tells the backend what to detach: documented)."""
    volume = rig.volume(rig.file())
    stage = co_staging(rig, "d" * 64)
    mount_volume(rig.node, rig.backend, stage, volume, stage=True)
    for sub in ("pods", "volumes"):
        for path in (rig.state / sub).iterdir():
            path.write_bytes(b"\x00garbage")
    _unmount(rig, stage)
    assert rig.mounts() == [] and rig.records() == [] and rig.staging_dirs() == []
    assert len(rig.loops()) == 1


@pytest.mark.parametrize("where", ["state", "ancestor", "staging root", "flat", "journal"])
def test_a_mount_on_or_inside_the_state_dir_is_refused_and_changes_nothing(
    rig: Rig, where: str
) -> None:
    """A CO staging path (or pod directory) that is flexhub's state directory, holds it, or
    lies inside it: bound there, the volume would hide the journal and locks (or every
    staging mount) under the user's filesystem, and the unstage leaves the device attached.
    Refused with a one-line error before anything is attached or recorded."""
    world = Rig(rig.base / "outer") if where == "ancestor" else rig
    world.base.mkdir(exist_ok=True)
    volume = world.volume(world.file())
    rig.files += world.files if world is not rig else []
    volume_id = world.backend.volume_id(volume)
    world.state.mkdir(parents=True)
    target = {
        "state": world.state,
        "ancestor": world.base,  # the state directory inside the CO's path
        "staging root": world.state / "staging",
        "flat": staging_dir(world.node, volume_id),
        "journal": world.state / "pods",
    }[where]
    target.mkdir(parents=True, exist_ok=True)
    with pytest.raises(FlexhubError, match="state directory") as info:
        mount_volume(world.node, world.backend, target, volume, stage=True)
    assert "\n" not in str(info.value)
    assert not MountTable().is_mount_point(target)
    assert world.loops() == [] and world.records() == []


def test_a_flexvolume_pod_after_the_co_shares_the_nested_staging_and_both_go(rig: Rig) -> None:
    """CO first (nested), then a FlexVolume pod of the same volume: it shares the nested
    staging mount; the kubelet waits for the pod's bind, and once the pod is gone the
    kubelet's check passes and the unstage leaves nothing."""
    volume = rig.volume(rig.file())
    stage = co_staging(rig, "e" * 64)
    mount_volume(rig.node, rig.backend, stage, volume, stage=True)
    pod = rig.pod("flex")
    mount_volume(rig.node, rig.backend, pod, volume)
    device = rig.node.journal.get_volume(rig.backend.volume_id(volume)).device
    assert len(_staging_mounts(rig, device)) == 1
    assert kubelet_refs(stage) == [str(pod)]
    _unmount(rig, pod)
    assert kubelet_refs(stage) == []
    _unmount(rig, stage)
    rig.assert_clean()


def test_a_second_co_staging_path_of_one_volume_is_refused(rig: Rig) -> None:
    """Two staging paths of one volume on the node (two PVs of one loop file): sharing would
    make each staging mount a foreign reference to the kubelet for the other, so neither
    would ever be unstaged; the second is refused in one line and changes nothing."""
    volume = rig.volume(rig.file())
    first, second = co_staging(rig, "a" * 64), co_staging(rig, "b" * 64)
    mount_volume(rig.node, rig.backend, first, volume, stage=True)
    with pytest.raises(VolumeError, match="one staging path per volume") as refused:
        mount_volume(rig.node, rig.backend, second, volume, stage=True)
    assert "\n" not in str(refused.value)
    assert not MountTable().is_mount_point(second)
    assert kubelet_refs(first) == []
    _unmount(rig, first)
    rig.assert_clean()
