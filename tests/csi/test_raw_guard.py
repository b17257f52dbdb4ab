"""Attacks on the raw-consumer guard: a filesystem stage is refused while a raw pod record of
the volume is journalled. Each test asserts the safe outcome (a hostile review's findings,
proven here first)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest

from flexhub.csi.proto import csi_pb2 as pb
from flexhub.csi.records import StagedContexts
from flexhub.errors import VolumeError
from flexhub.node.checkpoints import CRASH_ENV
from flexhub.node.journal import Journal
from tests.conftest import needs_root
from tests.csi.sanity import (
    LoopfilePlugin,
    loops_backed_under,
    node_config,
    start_plugin,
    stop_plugin,
)
from tests.csi.test_block import read
from tests.csi.test_crash import BLOCK, Calls

pytestmark = [needs_root, pytest.mark.root]

MiB = 1 << 20
Mode = pb.VolumeCapability.AccessMode.Mode


def block() -> pb.VolumeCapability:
    return pb.VolumeCapability(
        block=pb.VolumeCapability.BlockVolume(),
        access_mode=pb.VolumeCapability.AccessMode(mode=Mode.SINGLE_NODE_WRITER),
    )


MOUNT = pb.VolumeCapability(
    mount=pb.VolumeCapability.MountVolume(fs_type="ext4"),
    access_mode=pb.VolumeCapability.AccessMode(mode=Mode.SINGLE_NODE_WRITER),
)


class Rig:
    def __init__(self, plugin: LoopfilePlugin, name: str) -> None:
        self.top = plugin.top
        self.controller, self.node = plugin.controller, plugin.node
        self.volume = self.controller.CreateVolume(
            pb.CreateVolumeRequest(
                name=name,
                capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
                volume_capabilities=[block()],
                parameters={"backend": "loopfile"},
            )
        ).volume
        self.stages: list[Path] = []
        self.targets: list[Path] = []

    def stage(self, path: Path, capability: Any) -> None:
        path.mkdir(exist_ok=True)
        if path not in self.stages:
            self.stages.append(path)
        self.node.NodeStageVolume(
            pb.NodeStageVolumeRequest(
                volume_id=self.volume.volume_id,
                staging_target_path=str(path),
                volume_capability=capability,
                volume_context=self.volume.volume_context,
            )
        )

    def publish(self, stage: Path, target: Path, capability: Any) -> None:
        target.parent.mkdir(exist_ok=True)
        self.targets.append(target)
        self.node.NodePublishVolume(
            pb.NodePublishVolumeRequest(
                volume_id=self.volume.volume_id,
                staging_target_path=str(stage),
                target_path=str(target),
                volume_capability=capability,
            )
        )

    def unstage(self, path: Path) -> None:
        self.node.NodeUnstageVolume(
            pb.NodeUnstageVolumeRequest(
                volume_id=self.volume.volume_id, staging_target_path=str(path)
            )
        )

    def cleanup(self) -> None:
        for target in self.targets:
            with contextlib.suppress(grpc.RpcError):
                self.node.NodeUnpublishVolume(
                    pb.NodeUnpublishVolumeRequest(
                        volume_id=self.volume.volume_id, target_path=str(target)
                    )
                )
        for _ in range(2):
            for path in reversed(self.stages):
                with contextlib.suppress(grpc.RpcError):
                    self.unstage(path)
        with contextlib.suppress(grpc.RpcError):
            self.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=self.volume.volume_id))


def refused(call: Any) -> grpc.RpcError | None:
    try:
        call()
    except grpc.RpcError as exc:
        return exc
    return None


def test_a_filesystem_stage_on_the_raw_stage_path_itself_is_refused(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    """Same staging_target_path: raw first, then a mount capability (a CO bug or a root caller
    of the socket)."""
    rig = Rig(loopfile_plugin, "same-path")
    stage, dev = rig.top / "stage", rig.top / "pod" / "dev"
    try:
        rig.stage(stage, block())
        rig.publish(stage, dev, block())
        assert read(dev, 4 * MiB) == bytes(4 * MiB)
        error = refused(lambda: rig.stage(stage, MOUNT))
        formatted = read(dev, 4 * MiB) != bytes(4 * MiB)
        mounted = os.path.ismount(stage)
        assert error is not None and not formatted and not mounted, (
            f"filesystem stage on the raw stage path: error={error and error.details()!r}, "
            f"device formatted={formatted}, stage mounted={mounted}, raw consumer {dev} still "
            f"bound to the device"
        )
    finally:
        rig.cleanup()


def test_an_old_raw_record_is_upgraded_by_the_raw_restage(loopfile_plugin: LoopfilePlugin) -> None:
    """Upgrade: a raw pod record journalled by the previous release has no details. kubelet
    re-stages the raw volume (idempotent call, same path) after the upgrade; then a filesystem
    stage of the same volume on another path must be refused."""
    rig = Rig(loopfile_plugin, "upgrade")
    raw, fs, dev = rig.top / "stage-raw", rig.top / "stage-fs", rig.top / "pod" / "dev"
    try:
        rig.stage(raw, block())
        rig.publish(raw, dev, block())
        journal = Journal(rig.top / "state")
        (record,) = [r for r in journal.pods() if r.target == str(raw)]
        assert record.details == {"access": "raw"}
        journal.put_pod(record.replace(details={}))  # what flexhub before 5f1b953 wrote
        rig.stage(raw, block())  # kubelet's idempotent re-stage after the upgrade
        (record,) = [r for r in journal.pods() if r.target == str(raw)]
        details_after_restage = dict(record.details)
        error = refused(lambda: rig.stage(fs, MOUNT))
        formatted = read(dev, 4 * MiB) != bytes(4 * MiB)
        assert error is not None and not formatted, (
            f"record details after the raw re-stage: {details_after_restage}; filesystem stage "
            f"error={error and error.details()!r}; raw device formatted={formatted}"
        )
    finally:
        rig.cleanup()


def test_a_second_raw_unstage_leaves_the_first_raw_record(loopfile_plugin: LoopfilePlugin) -> None:
    """Two raw stages of one volume (two Block PVs naming the same storage). Unstaging the
    second must keep the first's raw record (and its device): else the guard is gone."""
    rig = Rig(loopfile_plugin, "two-raw")
    r1, r2, fs = rig.top / "stage-r1", rig.top / "stage-r2", rig.top / "stage-fs"
    try:
        rig.stage(r1, block())
        rig.stage(r2, block())
        journal = Journal(rig.top / "state")
        (vid,) = {r.volume_id for r in journal.pods()}
        assert len(journal.pods_of(vid)) == 2
        rig.unstage(r2)
        left = [r.target for r in journal.pods_of(vid)]
        volume_record = journal.get_volume(vid)
        error = refused(lambda: rig.stage(fs, MOUNT))
        assert str(r1) in left and error is not None, (
            f"after unstaging {r2}: pod records left {left}, volume record "
            f"{volume_record and volume_record.device!r}; filesystem stage of the volume "
            f"error={error and error.details()!r} (r1 still staged raw as far as kubelet knows)"
        )
    finally:
        rig.cleanup()


def test_a_failed_second_raw_stage_leaves_a_published_raw_consumer_alone(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    """R1 staged raw and published, its consumer holding the device open. A second raw stage
    of the same storage on R2 (a second Block PV naming it) fails in the backend's attach (a
    transient error: simulated, the same node code the plugin runs, on its config and journal).
    Its rollback (_undo_block) must not take R1's raw record, nor detach the device under the
    running consumer."""
    from flexhub.config import load_config
    from flexhub.csi.volumes import flexhub_volume
    from flexhub.errors import VolumeError
    from flexhub.node.rawblock import attach_raw

    rig = Rig(loopfile_plugin, "undo-prunes")
    r1, r2, fs = rig.top / "stage-r1", rig.top / "stage-r2", rig.top / "stage-fs"
    dev = rig.top / "pod" / "dev"
    fd = -1
    try:
        rig.stage(r1, block())
        rig.publish(r1, dev, block())
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)  # the consumer (a VM) has it open
        loops = loops_backed_under(rig.top)
        journal = Journal(rig.top / "state")
        (vid,) = {r.volume_id for r in journal.pods()}
        config = load_config(rig.top / "flexhub.toml")
        volume, backend, node = flexhub_volume(rig.volume.volume_context, block(), {}, config)

        def transient(_: Any) -> Any:
            raise VolumeError("transient attach failure")

        backend.attach = transient
        r2.mkdir()
        with pytest.raises(VolumeError):
            attach_raw(node, backend, r2, volume)
        left = [r.target for r in journal.pods_of(vid)]
        volume_record = journal.get_volume(vid)
        loops_after = loops_backed_under(rig.top)
        error = refused(lambda: rig.stage(fs, MOUNT))
        ext4_magic = os.pread(fd, 2, 1080) == b"\x53\xef"  # what the consumer reads now
        assert str(r1) in left and volume_record is not None and error is not None, (
            f"after R2's failed raw stage: pod records left {left}; volume record "
            f"{volume_record and volume_record.device!r}; loop devices {loops} -> {loops_after}; "
            f"filesystem stage error={error and error.details()!r}; fs stage mounted="
            f"{os.path.ismount(fs)}; the running consumer's open device now holds ext4: "
            f"{ext4_magic}; loop devices now {loops_backed_under(rig.top)}"
        )
    finally:
        if fd >= 0:
            os.close(fd)
        rig.cleanup()


def test_a_raw_unstage_on_a_read_only_journal_does_not_block_the_volume_forever(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    """The raw unstage succeeds while the journal's pods directory is read-only (the doc:
    'journal not updated', kept for a later call). kubelet never calls again for R. Once the
    disk is writable, a filesystem stage of the volume (say the same storage under a new
    Filesystem PV) must not be refused forever by R's leftover raw record."""
    rig = Rig(loopfile_plugin, "ro-journal")
    raw, fs = rig.top / "stage-raw", rig.top / "stage-fs"
    pods = rig.top / "state" / "pods"
    bound = False
    try:
        rig.stage(raw, block())
        subprocess.run(["mount", "--bind", str(pods), str(pods)], check=True)
        bound = True
        subprocess.run(["mount", "-o", "remount,ro,bind", str(pods)], check=True)
        rig.unstage(raw)  # answered OK: kubelet forgets R
        subprocess.run(["umount", str(pods)], check=True)
        bound = False
        rig.stages.remove(raw)
        journal = Journal(rig.top / "state")
        left = [(r.target, r.details) for r in journal.pods()]
        errors = [refused(lambda: rig.stage(fs, MOUNT)) for _ in range(3)]
        assert errors[-1] is None, (
            f"records left after the unstage: {left}; third filesystem stage refused: "
            f"{errors[-1] and (errors[-1].code(), errors[-1].details())}"
        )
    finally:
        if bound:
            subprocess.run(["umount", str(pods)], check=False)
        rig.stages.append(raw)
        rig.cleanup()


def _node(rig: Rig) -> tuple[Any, Any, Any]:
    from flexhub.config import load_config
    from flexhub.csi.volumes import flexhub_volume

    config = load_config(rig.top / "flexhub.toml")
    _volume, backend, node = flexhub_volume(rig.volume.volume_context, block(), {}, config)
    return config, backend, node


def test_deferred_release_retry_does_not_detach_a_live_raw_consumer(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    """R1 staged raw; its unstage finds the device busy (a holder in another namespace):
    deferred, volume record kept. R2 (same storage) is then staged raw and published, its
    consumer running. The deferred release's retry (after any later unmount on the node)
    must not detach the device under R2 (it looked only whether the never mounted staging
    directory was mounted)."""
    from flexhub.driver.loader import backend_factory
    from flexhub.node.release import retry_deferred_releases

    rig = Rig(loopfile_plugin, "deferred-raw")
    r1, r2, fs = rig.top / "stage-r1", rig.top / "stage-r2", rig.top / "stage-fs"
    dev = rig.top / "pod" / "dev"
    fd = -1
    try:
        rig.stage(r1, block())
        journal = Journal(rig.top / "state")
        (vid,) = {r.volume_id for r in journal.pods()}
        device = journal.get_volume(vid).device
        hold = os.open(device, os.O_RDONLY | os.O_EXCL | os.O_CLOEXEC)
        try:
            rig.unstage(r1)
        finally:
            os.close(hold)
        assert vid in journal.deferred(), "precondition: the release of R1 was deferred"
        rig.stage(r2, block())
        rig.publish(r2, dev, block())
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)  # R2's consumer runs
        config, _, node = _node(rig)
        node.config.release_retry_interval = 0.0
        retry_deferred_releases(node, backend_factory(config))
        record = journal.get_volume(vid)
        raw_left = [r.target for r in journal.pods_of(vid)]
        error = refused(lambda: rig.stage(fs, MOUNT))
        formatted = os.pread(fd, 2, 1080) == b"\x53\xef"
        assert record is not None and error is not None and not formatted, (
            f"after the deferred retry with R2 staged raw and published: volume record "
            f"{record and record.device!r}; raw records {raw_left}; filesystem stage of the "
            f"same storage error={error and error.details()!r}; R2's open device now holds "
            f"ext4: {formatted}"
        )
    finally:
        if fd >= 0:
            os.close(fd)
        rig.cleanup()


def test_an_old_raw_record_is_protected_without_a_restage(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    """Upgrade without a kubelet restart: the plugin is replaced, kubelet never calls
    NodeStageVolume again for the raw volume already staged, so its record (no details, as
    the previous release wrote) is rewritten by the plugin's start. A filesystem stage of
    the same storage on another path is then refused (the device is not formatted)."""
    rig = Rig(loopfile_plugin, "upgrade-norestage")
    raw, fs, dev = rig.top / "stage-raw", rig.top / "stage-fs", rig.top / "pod" / "dev"
    try:
        rig.stage(raw, block())
        rig.publish(raw, dev, block())
        journal = Journal(rig.top / "state")
        (record,) = [r for r in journal.pods() if r.target == str(raw)]
        journal.put_pod(record.replace(details={}))  # what the previous release wrote
        from flexhub.csi.node import NodeService

        # and its staged record, without the access type
        StagedContexts(rig.top / "state").put(raw, rig.volume.volume_id, rig.volume.volume_context)

        config, _, _ = _node(rig)
        NodeService(config, "node-1").upgrade_records()  # the upgraded plugin starts
        (record,) = [r for r in journal.pods() if r.target == str(raw)]
        assert record.details == {"access": "raw"}
        error = refused(lambda: rig.stage(fs, MOUNT))
        formatted = read(dev, 4 * MiB) != bytes(4 * MiB)
        assert error is not None and not formatted, (
            f"old raw record (no details), no re-stage: filesystem stage error="
            f"{error and error.details()!r}; raw consumer's device formatted={formatted}"
        )
    finally:
        rig.cleanup()


def test_an_unreadable_volume_record_does_not_drop_the_raw_guard(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    """R staged raw and published. Its volume record becomes unreadable (a read error, a
    record of a newer schema after a rollback, a torn disk): get_volume() is None, which
    is no proof that nothing is attached. A filesystem stage of the same storage must still be
    refused."""
    rig = Rig(loopfile_plugin, "unreadable-volume")
    raw, fs, dev = rig.top / "stage-raw", rig.top / "stage-fs", rig.top / "pod" / "dev"
    data = ""
    try:
        rig.stage(raw, block())
        rig.publish(raw, dev, block())
        journal = Journal(rig.top / "state")
        (vid,) = {r.volume_id for r in journal.pods()}
        path = journal._volume_path(vid)
        data = path.read_text()
        path.write_text(data.replace('"version": 1', '"version": 2'))  # a newer release's
        assert journal.get_volume(vid) is None
        error = refused(lambda: rig.stage(fs, MOUNT))
        raw_left = [r.target for r in journal.pods_of(vid)]
        formatted = read(dev, 4 * MiB) != bytes(4 * MiB)
        assert error is not None and not formatted, (
            f"volume record unreadable: filesystem stage error={error and error.details()!r}; "
            f"raw records left {raw_left}; raw consumer's device formatted={formatted}"
        )
    finally:
        if data:  # readable again: the unstage releases what it names
            path.write_text(data)
        rig.cleanup()


def test_a_raw_record_kubelet_forgot_does_not_pin_later_attachments(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    """R1 staged raw; the node reboots (its loop device is gone) and kubelet never unstages
    R1 (the pod was deleted meanwhile; a NodeUnstage lost): R1's raw record and its volume
    record stay. The same storage is later staged raw on R2 and unstaged: its (new) device
    must be released: R1's record, whose directory is gone, is stale."""
    rig = Rig(loopfile_plugin, "forgotten-raw")
    r1, r2 = rig.top / "stage-r1", rig.top / "stage-r2"
    try:
        rig.stage(r1, block())
        journal = Journal(rig.top / "state")
        (vid,) = {r.volume_id for r in journal.pods()}
        device = journal.get_volume(vid).device
        subprocess.run(["losetup", "--detach", device], check=True)  # the reboot
        r1.rmdir()  # kubelet's directory of R1 is gone with the pod
        rig.stage(r2, block())
        rig.unstage(r2)
        left = loops_backed_under(rig.top)
        records = [r.target for r in journal.pods_of(vid)]
        assert left == [], (
            f"R2 staged raw and unstaged after R1 was forgotten: loop devices still attached "
            f"{left}; pod records {records}; volume record "
            f"{journal.get_volume(vid) and journal.get_volume(vid).device!r}"
        )
    finally:
        r1.mkdir(exist_ok=True)
        rig.cleanup()


def test_a_raw_restage_after_a_reboot_attaches_the_storage_again(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    """R staged raw; the node reboots (its loop device is unbound, the device node stays in
    /dev); kubelet stages R again (same path, its pod still scheduled). attach_raw's
    idempotent branch checks only that the journalled device node is a block device: the
    pod is handed an unbound loop device, not its storage."""
    rig = Rig(loopfile_plugin, "raw-reboot")
    r1 = rig.top / "stage-r1"
    try:
        rig.stage(r1, block())
        journal = Journal(rig.top / "state")
        (vid,) = {r.volume_id for r in journal.pods()}
        device = journal.get_volume(vid).device
        subprocess.run(["losetup", "--detach", device], check=True)  # the reboot
        rig.stage(r1, block())  # kubelet re-stages after the reboot
        now = journal.get_volume(vid).device
        backing = Path(f"/sys/block/{Path(now).name}/loop/backing_file")
        assert backing.exists(), (
            f"re-stage after the reboot answered OK with {now}, which maps nothing "
            f"(loops backed under the test: {loops_backed_under(rig.top)})"
        )
    finally:
        rig.cleanup()


def test_another_volumes_stage_on_the_raw_path_keeps_the_raw_guard(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    """A staged raw on S (published, consumer running). A root caller of the socket (or two
    PVs of one volumeHandle) stages another volume B with a filesystem on the same S: its
    pod record replaces A's raw record, and then a filesystem stage of A's storage formats
    the device under A's consumer."""
    a, b = Rig(loopfile_plugin, "vol-a"), Rig(loopfile_plugin, "vol-b")
    s, fs, dev = a.top / "stage-a", a.top / "stage-fs", a.top / "pod" / "dev"
    try:
        a.stage(s, block())
        a.publish(s, dev, block())
        b.stages.append(s)
        error_b = refused(lambda: b.stage(s, MOUNT))
        error = refused(lambda: a.stage(fs, MOUNT))
        formatted = read(dev, 4 * MiB) != bytes(4 * MiB)
        assert not formatted and (error_b is not None or error is not None), (
            f"B's filesystem stage on A's raw path error={error_b and error_b.details()!r}; "
            f"A's filesystem stage error={error and error.details()!r}; A's raw device "
            f"formatted={formatted}"
        )
    finally:
        b.cleanup()
        a.cleanup()


def _sweep(top: Path) -> None:
    """Unmount and detach what a failing test leaves under ``top`` (only this test's own)."""
    for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
        point = line.split()[4]
        if point.startswith(f"{top}/"):
            subprocess.run(["umount", point], check=False)
    for name in loops_backed_under(top):
        subprocess.run(["losetup", "--detach", f"/dev/{name}"], check=False)


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], check=False)


def _reboot(paths: list[Path], device: str) -> None:
    for path in paths:
        _umount(path)
    subprocess.run(["losetup", "--detach", device], check=False)


def test_a_csi_filesystem_stage_sharing_a_flexvolume_staging_is_not_marked_raw(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    from flexhub.config import load_config
    from flexhub.csi.node import NodeService
    from flexhub.csi.volumes import flexhub_volume
    from flexhub.driver.loader import backend_factory
    from flexhub.node.podrecords import staging_dir
    from flexhub.node.volumes import mount_volume, unmount_volume

    rig = Rig(loopfile_plugin, "flex-shared")
    stage = rig.top / "stage-fs"
    pod = rig.top / "flexpod" / "vol"
    pod.parent.mkdir()
    pod.mkdir()
    config = load_config(rig.top / "flexhub.toml")
    volume, backend, node = flexhub_volume(rig.volume.volume_context, MOUNT, {}, config)
    try:
        mount_volume(node, backend, pod, volume)  # the FlexVolume pod, first
        rig.stage(stage, MOUNT)  # the CSI stage shares the bare staging mount
        # as an earlier release recorded it: no access type (else the start never looks)
        StagedContexts(rig.top / "state").put(
            stage, rig.volume.volume_id, rig.volume.volume_context
        )
        journal = Journal(rig.top / "state")
        vid = backend.volume_id(volume)
        bare = staging_dir(node, vid)
        (csi_record,) = [r for r in journal.pods() if r.target == str(stage)]
        assert csi_record.staging == str(bare) and csi_record.details == {}
        device = journal.get_volume(vid).device

        _reboot([pod, stage, bare], device)  # the node reboots
        NodeService(config, "node-1").upgrade_records()  # the plugin starts
        (after,) = [r for r in journal.pods() if r.target == str(stage)]
        restage = refused(lambda: rig.stage(stage, MOUNT))  # kubelet stages again
        flex_error = None
        try:
            mount_volume(node, backend, pod, volume)  # the FlexVolume pod's remount
        except Exception as exc:
            flex_error = exc
        assert after.details == {} and restage is None and flex_error is None, (
            f"after a reboot the plugin's start rewrote the CSI filesystem stage's record to "
            f"{after.details}; kubelet's re-stage: "
            f"{restage and (restage.code(), restage.details())}; FlexVolume remount: "
            f"{flex_error!r}"
        )
    finally:
        with contextlib.suppress(Exception):
            unmount_volume(node, pod, backend_factory(config))
        with contextlib.suppress(grpc.RpcError):
            rig.unstage(stage)
        with contextlib.suppress(Exception):
            unmount_volume(node, pod, backend_factory(config))
        rig.cleanup()


def test_a_010_csi_filesystem_stage_is_not_marked_raw_after_a_reboot(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    """0.1.0 staged CSI filesystem volumes on the bare staging directory (the CO path was
    repeated below it only since 17f7385, unreleased), pod record without details. After the
    upgrade the node reboots: the plugin's start must not take that record for a raw one."""
    from flexhub.csi.node import NodeService
    from flexhub.node.podrecords import staging_dir

    rig = Rig(loopfile_plugin, "old-fs")
    stage = rig.top / "stage-fs"
    try:
        rig.stage(stage, MOUNT)
        journal = Journal(rig.top / "state")
        (record,) = [r for r in journal.pods() if r.target == str(stage)]
        vid = record.volume_id
        config, _, node = _node(rig)
        bare = staging_dir(node, vid)
        repeated = Path(record.staging)
        device = journal.get_volume(vid).device
        _reboot([stage, repeated], device)
        # what 0.1.0 journalled: the flat staging directory
        journal.put_pod(record.replace(staging=str(bare)))
        volume = journal.get_volume(vid)
        journal.put_volume(volume.replace(staging=str(bare)))
        StagedContexts(rig.top / "state").put(
            stage, rig.volume.volume_id, rig.volume.volume_context
        )
        NodeService(config, "node-1").upgrade_records()  # the upgraded plugin starts
        (after,) = [r for r in journal.pods() if r.target == str(stage)]
        restage = refused(lambda: rig.stage(stage, MOUNT))  # kubelet stages again
        assert after.details == {} and restage is None, (
            f"0.1.0's CSI filesystem stage record after the reboot and the plugin's start: "
            f"{after.details}; kubelet's re-stage: "
            f"{restage and (restage.code(), restage.details())}"
        )
    finally:
        rig.cleanup()


def test_a_raw_stage_on_another_volumes_filesystem_stage_path_is_refused(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    a, b = Rig(loopfile_plugin, "fs-a"), Rig(loopfile_plugin, "raw-b")
    s = a.top / "stage-shared"
    try:
        a.stage(s, MOUNT)
        assert os.path.ismount(s)
        b.stages.append(s)
        error = refused(lambda: b.stage(s, block()))
        journal = Journal(a.top / "state")
        records = [(r.target, r.volume_id[-20:], r.details) for r in journal.pods()]
        assert error is not None, (
            f"B's raw stage on A's mounted filesystem stage path answered OK; pod records "
            f"now {records}; loops {loops_backed_under(a.top)}"
        )
    finally:
        a.cleanup()
        b.cleanup()
        _sweep(a.top)


@pytest.mark.parametrize(
    "at",
    [
        "pod-record",
        "volume-intent",
        "attach-progress-file",
        "attach-progress-loop",
        "attached",
        "volume-record",
        "done",
    ],
)
@pytest.mark.parametrize("then", ["unstage", "retry"])
def test_a_reattach_killed_at_a_checkpoint_leaks_nothing(
    trusted_dir: Path, at: str, then: str
) -> None:
    config = node_config(trusted_dir)
    endpoint, log = trusted_dir / "csi.sock", trusted_dir / "plugin.log"
    stage = trusted_dir / "stage"
    stage.mkdir()
    proc = start_plugin(config, endpoint, log)
    calls = Calls(endpoint)
    unstage = None
    try:
        volume = calls.controller.CreateVolume(
            pb.CreateVolumeRequest(
                name=f"reattach-{at}-{then}",
                capacity_range=pb.CapacityRange(required_bytes=32 << 20),
                volume_capabilities=[BLOCK],
                parameters={"backend": "loopfile"},
            )
        ).volume
        request = pb.NodeStageVolumeRequest(
            volume_id=volume.volume_id,
            staging_target_path=str(stage),
            volume_capability=BLOCK,
            volume_context=volume.volume_context,
        )
        unstage = pb.NodeUnstageVolumeRequest(
            volume_id=volume.volume_id, staging_target_path=str(stage)
        )
        calls.node.NodeStageVolume(request)
        journal = Journal(trusted_dir / "state")
        (vid,) = {r.volume_id for r in journal.pods()}
        old = journal.get_volume(vid).device
        stop_plugin(proc)
        calls.close()
        subprocess.run(["losetup", "--detach", old], check=True)  # the reboot

        proc = start_plugin(config, endpoint, log, **{CRASH_ENV: at})
        calls = Calls(endpoint)
        with pytest.raises(grpc.RpcError):
            calls.node.NodeStageVolume(request)
        killed = proc.wait(timeout=30) == -9
        calls.close()
        proc = start_plugin(config, endpoint, log)
        calls = Calls(endpoint)
        if then == "retry":
            calls.node.NodeStageVolume(request)
            now = journal.get_volume(vid)
            mapped = loops_backed_under(trusted_dir)
            assert now is not None and Path(now.device).name in mapped, (
                f"killed at {at} (reached: {killed}), retried: journalled "
                f"{now and now.device}, loops mapping the file {mapped}"
            )
        calls.node.NodeUnstageVolume(unstage)
        left = loops_backed_under(trusted_dir)
        records = (journal.get_volume(vid), [r.target for r in journal.pods()])
        assert left == [], (
            f"re-attach killed at {at} (reached: {killed}), then {then} + unstage: loop devices "
            f"left {left}; records {records}"
        )
        calls.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id))
    finally:
        calls.close()
        if unstage is not None and proc.poll() is None:
            with contextlib.suppress(grpc.RpcError):
                calls = Calls(endpoint)
                calls.node.NodeUnstageVolume(unstage)
                calls.close()
        stop_plugin(proc)
        for name in loops_backed_under(trusted_dir):
            subprocess.run(["losetup", "--detach", f"/dev/{name}"], check=False)


def test_a_backend_that_cannot_tell_hands_out_another_volumes_device_after_a_reboot(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    """A staged raw; reboot (its loop device unbound); B staged raw first after the boot gets
    the same device name; kubelet stages A again. With a backend whose still_attached says
    None (the BlockBackend default; iSCSI for a record naming no target/LUN), attach_raw's
    idempotent branch trusts the journalled name and hands A's consumer B's storage; the
    filesystem stage path attaches again (idempotent) whenever nothing is staged."""
    from flexhub.node.rawblock import attach_raw

    a, b = Rig(loopfile_plugin, "cannot-tell-a"), Rig(loopfile_plugin, "cannot-tell-b")
    sa, sb = a.top / "stage-a", a.top / "stage-b"
    try:
        a.stage(sa, block())
        journal = Journal(a.top / "state")
        (vid_a,) = {r.volume_id for r in journal.pods()}
        old = journal.get_volume(vid_a)
        file_a = old.details["file"]
        subprocess.run(["losetup", "--detach", old.device], check=True)  # the reboot
        b.stage(sb, block())
        vid_b = next(r.volume_id for r in journal.pods() if r.target == str(sb))
        device_b = journal.get_volume(vid_b).device
        if device_b != old.device:
            pytest.skip(f"B got {device_b}, not A's old {old.device} (another loop user)")
        _, backend, node = _node(a)
        backend.still_attached = lambda attachment: None  # cannot tell
        from flexhub.csi.volumes import flexhub_volume

        volume, _, _ = flexhub_volume(a.volume.volume_context, block(), {}, node.config)
        device = attach_raw(node, backend, sa, volume)  # kubelet's re-stage of A
        backing = Path(f"/sys/block/{Path(device).name}/loop/backing_file").read_text().strip()
        assert backing == file_a, (
            f"A's raw re-stage after the reboot answered {device}, which maps {backing} "
            f"(volume B's file), not A's {file_a}"
        )
    finally:
        b.stages.append(sb)
        b.cleanup()
        a.cleanup()


def _failing_reattach(rig: Rig) -> tuple[Any, Any, Any]:
    """The node code the plugin runs, with a backend that cannot tell whether the journalled
    device is still the attachment (BlockBackend's default still_attached: None) and whose
    attach fails transiently after its first progress report (a loopfile: after it reported
    the file; an iSCSI target: after it reported the target, the login failing)."""
    from flexhub.config import load_config
    from flexhub.csi.volumes import flexhub_volume

    config = load_config(rig.top / "flexhub.toml")
    volume, backend, node = flexhub_volume(rig.volume.volume_context, block(), {}, config)
    backend.still_attached = lambda attachment: None

    def transient(*_: Any, **__: Any) -> Any:
        raise VolumeError("transient failure (after the attach's first progress report)")

    backend._ensure_file = transient
    return volume, backend, node


def test_a_failed_reattach_keeps_the_journalled_device(loopfile_plugin: LoopfilePlugin) -> None:
    """R staged raw, published, its consumer running. kubelet stages R again (same path); the
    re-attach fails. 'A failed re-attach never releases a device attached before the call':
    the journal must still name the device (the consumer's), else the raw consumer is no
    longer known to the node (raw_device None: NodeExpandVolume takes the filesystem path,
    the staged context is dropped, the release skips its busy check)."""
    from flexhub.node.rawblock import attach_raw, raw_device

    rig = Rig(loopfile_plugin, "kept-journal")
    r, dev = rig.top / "stage-r", rig.top / "pod" / "dev"
    fd = -1
    try:
        rig.stage(r, block())
        rig.publish(r, dev, block())
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
        journal = Journal(rig.top / "state")
        (vid,) = {x.volume_id for x in journal.pods()}
        before = journal.get_volume(vid)
        volume, backend, node = _failing_reattach(rig)
        with pytest.raises(VolumeError):
            attach_raw(node, backend, r, volume)  # kubelet's re-stage
        after = journal.get_volume(vid)
        assert raw_device(node, r) == before.device, (
            f"after a failed re-attach of the kept device {before.device}: volume record "
            f"device={after and after.device!r} pending={after and after.pending} "
            f"partial={after and after.partial}; raw_device(R)={raw_device(node, r)}"
        )
    finally:
        if fd >= 0:
            os.close(fd)
        rig.cleanup()


def test_two_failed_reattaches_release_a_live_raw_consumers_device(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    """Same, kubelet retrying (it retries a failed NodeStage). The first failure leaves the
    volume record pending (the attach's progress report overwrote it), so the second is no
    longer 'kept': its rollback deletes R's own raw pod record and releases the device under
    the running consumer (the busy check skipped: an intent has no device). The raw guard is
    gone: a filesystem stage of the same storage formats the consumer's device."""
    from flexhub.node.rawblock import attach_raw

    rig = Rig(loopfile_plugin, "kept-twice")
    r, fs, dev = rig.top / "stage-r", rig.top / "stage-fs", rig.top / "pod" / "dev"
    fd = -1
    try:
        rig.stage(r, block())
        rig.publish(r, dev, block())
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)  # the consumer (a VM)
        journal = Journal(rig.top / "state")
        (vid,) = {x.volume_id for x in journal.pods()}
        volume, backend, node = _failing_reattach(rig)
        for _ in range(2):
            with pytest.raises(VolumeError):
                attach_raw(node, backend, r, volume)
        records = [x.target for x in journal.pods_of(vid)]
        error = refused(lambda: rig.stage(fs, MOUNT))
        ext4 = os.pread(fd, 2, 1080) == b"\x53\xef"
        assert str(r) in records and error is not None and not ext4, (
            f"after two failed re-stages of R: pod records of the volume {records}; volume "
            f"record {journal.get_volume(vid)}; filesystem stage of the same storage: "
            f"{'refused' if error else 'OK'}; the running consumer's device now holds ext4: "
            f"{ext4}"
        )
    finally:
        if fd >= 0:
            os.close(fd)
        rig.stages.append(fs)
        rig.cleanup()


def test_a_refused_raw_stage_leaves_the_filesystem_stages_context(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    """A staged with a filesystem on S. B's raw stage on S is refused (39e4801: 'a raw stage
    on a mounted path is refused'), but NodeStageVolume wrote B's staged context over A's
    first (access 'block', B's volume id) and keeps it since S is still mounted: A's
    NodeExpandVolume (kubelet's resize of A) then answers NOT_FOUND, and A's stage is now
    recorded as a raw stage of B."""
    a, b = Rig(loopfile_plugin, "ctx-a"), Rig(loopfile_plugin, "ctx-b")
    s = a.top / "stage-shared"
    try:
        a.stage(s, MOUNT)
        b.stages.append(s)
        error = refused(lambda: b.stage(s, block()))
        assert error is not None
        entries = [
            (str(p), v[-16:], acc) for p, v, acc in StagedContexts(a.top / "state").entries()
        ]
        expand = refused(
            lambda: a.node.NodeExpandVolume(
                pb.NodeExpandVolumeRequest(
                    volume_id=a.volume.volume_id,
                    volume_path=str(s),
                    staging_target_path=str(s),
                    capacity_range=pb.CapacityRange(required_bytes=96 * MiB),
                    volume_capability=MOUNT,
                )
            )
        )
        assert expand is None or expand.code() != grpc.StatusCode.NOT_FOUND, (
            f"after B's refused raw stage on A's staging path: staged contexts {entries}; "
            f"A's NodeExpandVolume: {expand.code()} {expand.details()}"
        )
    finally:
        a.cleanup()
        b.cleanup()
        _sweep(a.top)


def test_a_failed_reattach_after_a_reboot_leaves_no_new_device_behind(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    """R staged raw; the node reboots (its loop device unbound); kubelet stages R again, and
    the attach makes a new loop device, then the call fails. The old device is proven gone,
    so nothing of the call's is kept: the new device is released with it (putting back the
    record of the old, stale one would leave the new one attached, and the release then
    leaves alone a device that is not the attachment's)."""
    from flexhub.node.rawblock import attach_raw

    rig = Rig(loopfile_plugin, "reboot-fails")
    r = rig.top / "stage-r"
    try:
        rig.stage(r, block())
        journal = Journal(rig.top / "state")
        (vid,) = {x.volume_id for x in journal.pods()}
        subprocess.run(["losetup", "--detach", journal.get_volume(vid).device], check=True)
        assert loops_backed_under(rig.top) == []
        _, backend, node = _node(rig)
        from flexhub.csi.volumes import flexhub_volume

        volume, _, _ = flexhub_volume(rig.volume.volume_context, block(), {}, node.config)
        real = backend.attach

        def attaches_then_fails(v: Any) -> Any:
            real(v)
            assert loops_backed_under(rig.top), "the attach made no device"
            raise VolumeError("failed after the attach made its device")

        backend.attach = attaches_then_fails
        with pytest.raises(VolumeError):
            attach_raw(node, backend, r, volume)  # kubelet's re-stage after the reboot
        left = loops_backed_under(rig.top)
        assert left == [], (
            f"after the failed re-stage: loop devices {left}; volume record "
            f"{journal.get_volume(vid)}; pod records {[x.target for x in journal.pods()]}"
        )
        rig.stage(r, block())  # kubelet's retry converges
        assert len(loops_backed_under(rig.top)) == 1
    finally:
        rig.cleanup()
