"""Raw block loopfile volumes under CSI on real loop devices: staged without a filesystem
(never formatted), published as a device node bound on a file, written through it and read
back after unpublish and a new publish; stats and growth of the device; nothing left after."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

import grpc
import pytest

from flexhub.csi.proto import csi_pb2 as pb
from tests.conftest import needs_root
from tests.csi.sanity import LoopfilePlugin, loops_backed_under

pytestmark = [needs_root, pytest.mark.root]

MiB = 1 << 20
Mode = pb.VolumeCapability.AccessMode.Mode


def block(mode: int = Mode.SINGLE_NODE_WRITER) -> pb.VolumeCapability:
    return pb.VolumeCapability(
        block=pb.VolumeCapability.BlockVolume(),
        access_mode=pb.VolumeCapability.AccessMode(mode=mode),
    )


def read(path: Path, size: int, offset: int = 0) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def test_a_raw_block_volume_keeps_what_was_written_through_it(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    trusted_dir = loopfile_plugin.top
    controller, node = loopfile_plugin.controller, loopfile_plugin.node
    stage = trusted_dir / "stage"
    stage.mkdir()
    (trusted_dir / "pod").mkdir()
    first, second = trusted_dir / "pod" / "dev-a", trusted_dir / "pod" / "dev-b"
    volume_id = ""

    def publish(target: Path, capability: pb.VolumeCapability | None = None) -> None:
        node.NodePublishVolume(
            pb.NodePublishVolumeRequest(
                volume_id=volume_id,
                staging_target_path=str(stage),
                target_path=str(target),
                volume_capability=capability or block(),
            )
        )

    def unpublish(target: Path) -> None:
        node.NodeUnpublishVolume(
            pb.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target))
        )

    try:
        volume = controller.CreateVolume(
            pb.CreateVolumeRequest(
                name="raw-one",
                capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
                volume_capabilities=[block()],
                parameters={"backend": "loopfile"},
            )
        ).volume
        volume_id = volume.volume_id
        stage_request = pb.NodeStageVolumeRequest(
            volume_id=volume_id,
            staging_target_path=str(stage),
            volume_capability=block(),
            volume_context=volume.volume_context,
        )
        node.NodeStageVolume(stage_request)
        node.NodeStageVolume(stage_request)  # idempotent
        assert not os.path.ismount(stage) and os.listdir(stage) == []
        publish(first)
        publish(first)  # idempotent
        assert stat.S_ISBLK(os.stat(first).st_mode)
        assert read(first, MiB) == bytes(MiB)  # never formatted: still all zeros
        data = os.urandom(MiB)
        fd = os.open(first, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.pwrite(fd, data, 3 * MiB)
            os.fsync(fd)
        finally:
            os.close(fd)
        # a single-writer volume is not published on a second target
        with pytest.raises(grpc.RpcError) as refused:
            publish(second, block(Mode.SINGLE_NODE_SINGLE_WRITER))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert not second.exists()
        # nor read-only while the device is attached read-write (a bind cannot stop writes)
        with pytest.raises(grpc.RpcError) as writable:
            node.NodePublishVolume(
                pb.NodePublishVolumeRequest(
                    volume_id=volume_id,
                    staging_target_path=str(stage),
                    target_path=str(second),
                    volume_capability=block(),
                    readonly=True,
                )
            )
        assert writable.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stats = node.NodeGetVolumeStats(
            pb.NodeGetVolumeStatsRequest(volume_id=volume_id, volume_path=str(first))
        )
        assert [(u.unit, u.total) for u in stats.usage] == [(pb.VolumeUsage.BYTES, 64 * MiB)]
        unpublish(first)
        unpublish(first)  # idempotent
        assert not first.exists()
        publish(second)
        assert read(second, MiB, 3 * MiB) == data
        # the device grows (ControllerExpand, then NodeExpand on the published target)
        grown = 96 * MiB
        assert controller.ControllerExpandVolume(
            pb.ControllerExpandVolumeRequest(
                volume_id=volume_id, capacity_range=pb.CapacityRange(required_bytes=grown)
            )
        ).node_expansion_required
        reply = node.NodeExpandVolume(
            pb.NodeExpandVolumeRequest(
                volume_id=volume_id,
                volume_path=str(second),
                capacity_range=pb.CapacityRange(required_bytes=grown),
                volume_capability=block(),
            )
        )
        assert reply.capacity_bytes == grown
        fd = os.open(second, os.O_RDONLY | os.O_CLOEXEC)
        try:
            assert os.lseek(fd, 0, os.SEEK_END) == grown
        finally:
            os.close(fd)
        assert read(second, MiB, 3 * MiB) == data
        unstage = pb.NodeUnstageVolumeRequest(volume_id=volume_id, staging_target_path=str(stage))
        with pytest.raises(grpc.RpcError) as published:  # the device stays while bound
            node.NodeUnstageVolume(unstage)
        assert published.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert str(second) in (published.value.details() or "")
        assert read(second, MiB, 3 * MiB) == data
        unpublish(second)
        node.NodeUnstageVolume(unstage)
        node.NodeUnstageVolume(unstage)  # idempotent
        assert loops_backed_under(trusted_dir) == []
        controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume_id))
    finally:
        for target in (first, second):
            with contextlib.suppress(grpc.RpcError):
                unpublish(target)
        with contextlib.suppress(grpc.RpcError):
            node.NodeUnstageVolume(
                pb.NodeUnstageVolumeRequest(volume_id=volume_id, staging_target_path=str(stage))
            )
    assert not any((trusted_dir / "loopfiles").rglob("*.img"))


def test_a_block_volume_is_refused_for_a_filesystem_backend() -> None:
    from flexhub_nfs import NfsBackend

    from flexhub.csi.volumes import check_capability

    assert "has no device" in check_capability(block(), NfsBackend)
    assert check_capability(block()) == ""


def test_a_volume_attached_raw_is_never_formatted_or_mounted_by_a_filesystem_stage(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    """A filesystem stage of a volume attached raw (another staging path: a second claim
    naming the same volume, a CO's mistake) would format a device its raw consumer has not
    written yet (blank), or mount a filesystem the consumer writes beneath it (a VM's disk).
    It is refused in one line before anything is formatted or mounted; the refusal attached
    nothing more, and the raw consumer's device is still all zeros."""
    trusted_dir = loopfile_plugin.top
    controller, node = loopfile_plugin.controller, loopfile_plugin.node
    raw_stage, fs_stage = trusted_dir / "stage-raw", trusted_dir / "stage-fs"
    raw_stage.mkdir()
    fs_stage.mkdir()
    volume = controller.CreateVolume(
        pb.CreateVolumeRequest(
            name="raw-then-fs",
            capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
            volume_capabilities=[block()],
            parameters={"backend": "loopfile"},
        )
    ).volume
    mount = pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(fs_type="ext4"),
        access_mode=pb.VolumeCapability.AccessMode(mode=Mode.SINGLE_NODE_WRITER),
    )

    def stage(path: Path, capability: pb.VolumeCapability) -> None:
        node.NodeStageVolume(
            pb.NodeStageVolumeRequest(
                volume_id=volume.volume_id,
                staging_target_path=str(path),
                volume_capability=capability,
                volume_context=volume.volume_context,
            )
        )

    target = trusted_dir / "pod" / "dev"
    target.parent.mkdir()
    try:
        stage(raw_stage, block())
        node.NodePublishVolume(
            pb.NodePublishVolumeRequest(
                volume_id=volume.volume_id,
                staging_target_path=str(raw_stage),
                target_path=str(target),
                volume_capability=block(),
            )
        )
        loops = loops_backed_under(trusted_dir)
        with pytest.raises(grpc.RpcError) as refused:
            stage(fs_stage, mount)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "attached raw" in (refused.value.details() or "")
        assert "\n" not in (refused.value.details() or "")
        assert not os.path.ismount(fs_stage)
        assert loops_backed_under(trusted_dir) == loops
        assert read(target, 4 * MiB) == bytes(4 * MiB)  # never formatted
    finally:
        with contextlib.suppress(grpc.RpcError):
            node.NodeUnpublishVolume(
                pb.NodeUnpublishVolumeRequest(volume_id=volume.volume_id, target_path=str(target))
            )
        for path in (fs_stage, raw_stage):
            with contextlib.suppress(grpc.RpcError):
                node.NodeUnstageVolume(
                    pb.NodeUnstageVolumeRequest(
                        volume_id=volume.volume_id, staging_target_path=str(path)
                    )
                )
        with contextlib.suppress(grpc.RpcError):
            controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id))
    assert loops_backed_under(trusted_dir) == []
