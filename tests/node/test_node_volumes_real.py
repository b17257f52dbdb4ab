"""mount_volume / unmount_volume / expand_volume with real loop devices and real mounts."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
from conftest import Rig

from flexhub.errors import FlexhubError, InvalidOptions, VolumeError
from flexhub.node.fs import filesystem_size
from flexhub.node.journal import SCHEMA_VERSION
from flexhub.node.mounts import MountTable, cleanup_mount_point, is_corrupted
from flexhub.node.volumes import (
    CHECKPOINTS,
    UNMOUNT_CHECKPOINTS,
    expand_volume,
    mount_volume,
    staging_dir,
    unmount_volume,
)
from flexhub.volume import Secret, Secrets, Volume

pytestmark = pytest.mark.root


def _mount(rig: Rig, target: Path, volume: Volume) -> None:
    mount_volume(rig.node, rig.backend, target, volume)


def _unmount(rig: Rig, target: Path) -> None:
    unmount_volume(rig.node, target, lambda name: rig.backend)


def _blkid_type(path: Path) -> str:
    return subprocess.run(
        ["blkid", "-p", "-s", "TYPE", "-o", "value", str(path)],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()


def _preformat(path: Path, fs_type: str, files: dict[str, str]) -> None:
    """Put a filesystem with files on ``path`` without flexhub."""
    mkfs = {"ext4": ["mkfs.ext4", "-F", "-q"], "xfs": ["mkfs.xfs", "-f", "-q"]}[fs_type]
    subprocess.run([*mkfs, str(path)], check=True, capture_output=True)
    where = path.parent / f"pre-{path.name}"
    where.mkdir()
    subprocess.run(["mount", "-o", "loop", str(path), str(where)], check=True)
    try:
        for name, text in files.items():
            (where / name).write_text(text)
    finally:
        subprocess.run(["umount", str(where)], check=True)
        where.rmdir()


def test_mount_write_unmount_leaves_nothing(rig: Rig) -> None:
    file = rig.file()
    target = rig.pod("a")
    secret = "hunter2-very-secret"
    volume = Volume(
        options={"backend": "blockfile", "file": str(file)},
        secrets=Secrets({"password": Secret(secret)}),
    )
    _mount(rig, target, volume)
    entry = MountTable().at(target)
    assert entry is not None and entry.fs_type == "ext4"  # the default fsType
    staging = staging_dir(rig.node, rig.backend.volume_id(volume))
    assert MountTable().at(staging) is not None
    (target / "hello").write_text("hi")
    # Records: mode 0600 in 0700 dirs, versioned, and no secret anywhere in the state dir.
    for rel in rig.records():
        path = rig.state / rel
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        data = json.loads(path.read_text())
        assert data["version"] == SCHEMA_VERSION
        assert secret not in path.read_text()
    assert stat.S_IMODE((rig.state / "pods").stat().st_mode) == 0o700
    assert len(rig.loops()) == 1
    _unmount(rig, target)
    rig.assert_clean()
    assert target.is_dir()  # kubelet removes the pod directory, not flexhub


def test_mount_and_unmount_are_idempotent(rig: Rig) -> None:
    file = rig.file()
    target = rig.pod("a")
    volume = rig.volume(file)
    _mount(rig, target, volume)
    first = MountTable().at(target)
    _mount(rig, target, volume)  # already correctly mounted: success, nothing stacked
    assert MountTable().at(target) == first
    assert len([m for m in rig.mounts() if m == str(target)]) == 1
    _unmount(rig, target)
    _unmount(rig, target)  # not mounted, no record: success
    _unmount(rig, rig.base / "never" / "existed")  # no such directory: success
    rig.assert_clean()


def test_two_pods_share_one_staging_mount(rig: Rig) -> None:
    file = rig.file()
    a, b = rig.pod("a"), rig.pod("b")
    volume = rig.volume(file)
    _mount(rig, a, volume)
    _mount(rig, b, volume)
    assert len(rig.loops()) == 1
    staging = staging_dir(rig.node, rig.backend.volume_id(volume))
    table = MountTable()
    assert len([e for e in table.entries() if e.mount_point == str(staging)]) == 1
    (a / "shared").write_text("from a")
    assert (b / "shared").read_text() == "from a"
    _unmount(rig, a)
    assert not table.is_mount_point(a)
    assert table.is_mount_point(staging) and table.is_mount_point(b)
    assert (b / "shared").read_text() == "from a"
    assert len(rig.loops()) == 1
    _unmount(rig, b)
    rig.assert_clean()


def test_two_processes_mount_the_same_blank_volume_at_once(rig: Rig) -> None:
    file = rig.file()
    for round_ in range(2):
        targets = [rig.pod(f"p{round_}{i}") for i in range(2)]
        start_at = time.time() + 1.0  # both processes call mount_volume at this instant
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        procs = [
            subprocess.Popen(
                [
                    _python(),
                    str(Path(__file__).with_name("driver.py")),
                    json.dumps(
                        {
                            "op": "mount",
                            "state": str(rig.state),
                            "target": str(t),
                            "file": str(file),
                            "start_at": start_at,
                        }
                    ),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for t in targets
        ]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        assert len(rig.loops()) == 1
        staging = staging_dir(rig.node, rig.backend.volume_id(rig.volume(file)))
        assert len([m for m in rig.mounts() if m == str(staging)]) == 1
        (targets[0] / f"r{round_}").write_text("x")
        assert (targets[1] / f"r{round_}").read_text() == "x"
        start_at = time.time() + 1.0
        procs = [
            subprocess.Popen(
                [
                    _python(),
                    str(Path(__file__).with_name("driver.py")),
                    json.dumps(
                        {
                            "op": "unmount",
                            "state": str(rig.state),
                            "target": str(t),
                            "start_at": start_at,
                        }
                    ),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for t in targets
        ]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        rig.assert_clean()
    assert _blkid_type(file) == "ext4"  # formatted once, kept across rounds


def _python() -> str:
    import sys

    return sys.executable


@pytest.mark.parametrize("retry", [True, False], ids=["retry-then-unmount", "unmount"])
@pytest.mark.parametrize("point", CHECKPOINTS)
def test_sigkill_at_each_mount_step_converges(rig: Rig, point: str, retry: bool) -> None:
    file = rig.file()
    target = rig.pod("a")
    crashed = rig.drive("mount", target, file, env={"FLEXHUB_TEST_CRASH_AT": point})
    assert crashed.returncode == -9, crashed
    if retry:
        again = rig.drive("mount", target, file)
        assert again.returncode == 0, again
        assert MountTable().is_mount_point(target)
        (target / "data").write_text("ok")
    done = rig.drive("unmount", target)
    assert done.returncode == 0, done
    rig.assert_clean()


@pytest.mark.parametrize("point", UNMOUNT_CHECKPOINTS)
def test_sigkill_at_each_unmount_step_converges(rig: Rig, point: str) -> None:
    file = rig.file()
    target = rig.pod("a")
    assert rig.drive("mount", target, file).returncode == 0
    crashed = rig.drive("unmount", target, env={"FLEXHUB_TEST_CRASH_AT": point})
    assert crashed.returncode == -9, crashed
    done = rig.drive("unmount", target)
    assert done.returncode == 0, done
    rig.assert_clean()


def test_filesystem_with_files_is_never_reformatted(rig: Rig) -> None:
    file = rig.file("data.img", 320 << 20)
    _preformat(file, "ext4", {"precious.txt": "keep me"})
    target = rig.pod("a")
    with pytest.raises(VolumeError) as info:
        _mount(rig, target, rig.volume(file, "xfs"))
    assert "ext4" in str(info.value) and "xfs" in str(info.value)
    rig.assert_clean()  # the failed call undid its attach
    assert _blkid_type(file) == "ext4"
    _mount(rig, target, rig.volume(file, "ext4"))
    assert (target / "precious.txt").read_text() == "keep me"
    _unmount(rig, target)
    rig.assert_clean()


def test_blank_device_is_not_formatted_for_a_read_only_mount(rig: Rig) -> None:
    file = rig.file()
    with pytest.raises(VolumeError, match="read-only"):
        _mount(rig, rig.pod("a"), rig.volume(file, read_only=True))
    assert _blkid_type(file) == ""
    rig.assert_clean()


def test_read_only_bind_is_verified_and_refuses_writes(rig: Rig) -> None:
    file = rig.file()
    _preformat(file, "ext4", {"f": "x"})
    ro_pod, rw_pod = rig.pod("ro"), rig.pod("rw")
    _mount(rig, ro_pod, rig.volume(file, read_only=True))
    table = MountTable()
    staging = staging_dir(rig.node, rig.backend.volume_id(rig.volume(file)))
    assert table.at(ro_pod).read_only and table.at(staging).read_only
    with pytest.raises(OSError) as info:
        (ro_pod / "new").write_text("no")
    assert info.value.errno == errno.EROFS
    # A read-write pod while the read-only one is there: refused (the filesystem must be
    # checked before it is written); once the reader is gone, and it comes back read-only.
    with pytest.raises(VolumeError, match="read-only"):
        _mount(rig, rw_pod, rig.volume(file))
    _unmount(rig, ro_pod)
    _mount(rig, rw_pod, rig.volume(file))
    _mount(rig, ro_pod, rig.volume(file, read_only=True))
    assert not table.at(staging).read_only and not table.at(rw_pod).read_only
    assert table.at(ro_pod).read_only
    (rw_pod / "new").write_text("yes")
    with pytest.raises(OSError) as info:
        (ro_pod / "other").write_text("no")
    assert info.value.errno == errno.EROFS
    _unmount(rig, ro_pod)
    _unmount(rig, rw_pod)
    rig.assert_clean()


@pytest.mark.parametrize("fs_type", ["ext4", "xfs"])
def test_shared_device_read_only_staging_skips_recovery_and_never_turns_rw(
    rig: Rig, fs_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device other nodes may write (iSCSI): the read-only staging mount does not replay
    the journal, and a read-write pod waits until the read-only pods are gone."""
    monkeypatch.setattr(type(rig.backend), "shared_device", True)
    file = rig.file(size=320 << 20)
    _preformat(file, fs_type, {"f": "x"})
    ro_pod, rw_pod = rig.pod("ro"), rig.pod("rw")
    _mount(rig, ro_pod, rig.volume(file, fs_type=fs_type, read_only=True))
    table = MountTable()
    staging = staging_dir(rig.node, rig.backend.volume_id(rig.volume(file)))
    staged = table.at(staging)
    assert staged is not None and staged.read_only
    assert "norecovery" in staged.super_options, staged
    with pytest.raises(VolumeError, match=r"mounted read-only by .* on this node"):
        _mount(rig, rw_pod, rig.volume(file, fs_type=fs_type))
    assert table.at(rw_pod) is None
    staged = table.at(staging)
    assert staged is not None and staged.read_only
    assert (ro_pod / "f").read_text() == "x"
    _unmount(rig, ro_pod)
    rig.assert_clean()
    # with the read-only pods gone, a read-write mount is a fresh, recovering mount
    _mount(rig, rw_pod, rig.volume(file, fs_type=fs_type))
    staged = table.at(staging)
    assert staged is not None and not staged.read_only
    assert "norecovery" not in staged.super_options
    (rw_pod / "new").write_text("yes")
    _unmount(rig, rw_pod)
    rig.assert_clean()


def test_fs_group_sets_the_root_directory_group(rig: Rig) -> None:
    file = rig.file()
    target = rig.pod("a")
    _mount(rig, target, rig.volume(file, fs_group=4321))
    info = target.stat()
    assert info.st_gid == 4321
    assert info.st_mode & stat.S_ISGID and (info.st_mode & 0o070) == 0o070
    assert (target / "lost+found").stat().st_gid == 0  # root directory only, not recursive
    _unmount(rig, target)
    rig.assert_clean()


def test_mount_options_are_applied_and_checked(rig: Rig) -> None:
    file = rig.file()
    target = rig.pod("a")
    with pytest.raises(InvalidOptions, match="remount"):
        _mount(rig, target, rig.volume(file, mount_options="noatime,remount"))
    rig.assert_clean()
    _mount(rig, target, rig.volume(file, mount_options="noatime,nodev"))
    staging = staging_dir(rig.node, rig.backend.volume_id(rig.volume(file)))
    entry = MountTable().at(staging)
    assert "noatime" in entry.options and "nodev" in entry.options
    _unmount(rig, target)
    rig.assert_clean()


def test_corrupt_pod_record_does_not_break_unmount(rig: Rig) -> None:
    file = rig.file()
    target, other = rig.pod("a"), rig.pod("b")
    _mount(rig, target, rig.volume(file))
    _mount(rig, other, rig.volume(file))
    (pod_record,) = [
        p
        for p in (rig.state / "pods").iterdir()
        if json.loads(p.read_text())["target"] == str(target)
    ]
    pod_record.write_text('{"version": 1, "kind": "pod", "target": "/half-wri')
    _unmount(rig, target)  # falls back to mountinfo: a bind of the shared staging mount
    assert not MountTable().is_mount_point(target)
    assert MountTable().is_mount_point(other)  # the other pod keeps its volume
    assert not pod_record.exists()
    # A record from a future release (unknown version) is treated the same way.
    (other_record,) = list((rig.state / "pods").iterdir())
    data = json.loads(other_record.read_text())
    data["version"] = 99
    other_record.write_text(json.dumps(data))
    _unmount(rig, other)
    rig.assert_clean()


def test_corrupt_volume_record_too_still_unmounts(rig: Rig) -> None:
    file = rig.file()
    target = rig.pod("a")
    _mount(rig, target, rig.volume(file))
    for sub in ("pods", "volumes"):
        for path in (rig.state / sub).iterdir():
            path.write_bytes(b"\x00garbage")
    _unmount(rig, target)
    assert rig.mounts() == [] and rig.records() == []
    # Without any record the backend cannot be asked to detach: documented, logged.
    assert len(rig.loops()) == 1


def test_unmount_after_a_reboot_like_loss_of_mounts(rig: Rig) -> None:
    file = rig.file()
    a, b = rig.pod("a"), rig.pod("b")
    volume = rig.volume(file)
    _mount(rig, a, volume)
    _mount(rig, b, volume)
    staging = staging_dir(rig.node, rig.backend.volume_id(volume))
    # Behind flexhub's back: binds and staging unmounted, loop detached (as after a reboot).
    for point in (a, b, staging):
        subprocess.run(["umount", str(point)], check=True)
    for device in rig.loops():
        subprocess.run(["losetup", "-d", device], check=True)
    # kubelet remounts a after the "reboot", then tears down b and a.
    _mount(rig, a, volume)
    assert (a / "lost+found").is_dir() and len(rig.loops()) == 1
    _unmount(rig, b)
    assert MountTable().is_mount_point(a)
    _unmount(rig, a)
    rig.assert_clean()


def test_stale_mount_point_is_detected_and_cleaned(rig: Rig, stale_fuse) -> None:
    hanging = rig.base / "hanging"
    hanging.mkdir()
    fuse = stale_fuse(hanging)
    started = time.monotonic()
    assert is_corrupted(hanging, timeout=0.5)  # stat hangs: nobody answers FUSE_INIT
    assert time.monotonic() - started < 2
    fuse.abort()
    with pytest.raises(OSError) as info:
        os.stat(hanging)
    assert info.value.errno == errno.ENOTCONN
    assert is_corrupted(hanging)
    cleanup_mount_point(rig.node.runner, hanging, 5, MountTable())
    assert not MountTable().is_mount_point(hanging) and hanging.is_dir()


def test_unmount_of_a_pod_whose_mount_went_stale(rig: Rig, stale_fuse) -> None:
    file = rig.file()
    target = rig.pod("a")
    _mount(rig, target, rig.volume(file))
    stale_fuse(target).abort()  # a dead mount stacked on the pod directory
    assert is_corrupted(target)
    _unmount(rig, target)
    rig.assert_clean()


def test_mount_over_a_stale_pod_directory(rig: Rig, stale_fuse) -> None:
    file = rig.file()
    target = rig.pod("a")
    assert rig.drive("mount", target, file).returncode == 0
    stale_fuse(target).abort()
    _mount(rig, target, rig.volume(file))  # a retried mount cleans the stale layer first
    (target / "ok").write_text("ok")
    _unmount(rig, target)
    rig.assert_clean()


def test_expand_xfs_online(rig: Rig) -> None:
    file = rig.file("x.img", 320 << 20)
    target = rig.pod("a")
    volume = rig.volume(file, "xfs")
    _mount(rig, target, volume)
    staging = staging_dir(rig.node, rig.backend.volume_id(volume))
    device = rig.loops()[0]
    before = filesystem_size(rig.node.runner, device, str(staging), "xfs")
    expand_volume(rig.node, rig.backend, target, volume, 480 << 20)
    after = filesystem_size(rig.node.runner, device, str(staging), "xfs")
    assert after > before and after > 400 << 20
    assert os.statvfs(target).f_blocks * os.statvfs(target).f_frsize > 400 << 20
    expand_volume(rig.node, rig.backend, target, volume, 480 << 20)  # retry: already grown
    _unmount(rig, target)
    rig.assert_clean()


def test_expand_ext4_never_claims_success_without_growing(rig: Rig) -> None:
    file = rig.file()
    target = rig.pod("a")
    volume = rig.volume(file)
    _mount(rig, target, volume)
    staging = staging_dir(rig.node, rig.backend.volume_id(volume))
    device = rig.loops()[0]
    before = filesystem_size(rig.node.runner, device, str(staging), "ext4")
    try:
        expand_volume(rig.node, rig.backend, target, volume, 128 << 20)
    except FlexhubError as exc:
        # This host lacks CAP_SYS_RESIZE for online ext4 growth: an honest Failure.
        assert "resize2fs" in str(exc)
        assert filesystem_size(rig.node.runner, device, str(staging), "ext4") == before
    else:
        assert filesystem_size(rig.node.runner, device, str(staging), "ext4") > before
    _unmount(rig, target)
    rig.assert_clean()


def test_expand_of_a_volume_not_mounted_here_fails(rig: Rig) -> None:
    file = rig.file()
    with pytest.raises(VolumeError, match="not mounted on this node"):
        expand_volume(rig.node, rig.backend, rig.pod("a"), rig.volume(file), 128 << 20)


def test_remount_repairs_a_lost_volume_record_so_unmount_detaches(rig: Rig) -> None:
    file = rig.file()
    target = rig.pod("a")
    volume = rig.volume(file)
    _mount(rig, target, volume)
    (record,) = list((rig.state / "volumes").iterdir())
    record.write_text("{truncated")
    _mount(rig, target, volume)  # already mounted: success, and the record is rewritten
    assert json.loads(record.read_text())["device"] == rig.loops()[0]
    _unmount(rig, target)
    rig.assert_clean()


def test_node_facade_mount_masks_secrets(rig: Rig) -> None:
    target = rig.base / "tmpfs"
    target.mkdir()
    with pytest.raises(FlexhubError) as info:
        rig.node.mount("none", target, "nosuchfs", ["password=hunter2"], secrets=["hunter2"])
    assert "hunter2" not in str(info.value) and "nosuchfs" in str(info.value)
    rig.node.mount("tmpfs", target, "tmpfs", ["size=1m"])
    assert MountTable().at(target).fs_type == "tmpfs"
    rig.node.unmount(target)
    assert not MountTable().is_mount_point(target)
