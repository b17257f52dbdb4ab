"""A published loopfile volume grows online through ControllerExpandVolume and
NodeExpandVolume, on real loop devices and xfs (ext4 grows online only with
CAP_SYS_RESOURCE, which the CI host lacks), with its data kept; the request needs no
staging path. A single-writer volume is refused a second target."""

from __future__ import annotations

import contextlib
import os

import grpc
import pytest

from flexhub.csi.proto import csi_pb2 as pb
from tests.conftest import needs_root
from tests.csi.sanity import LoopfilePlugin

pytestmark = [needs_root, pytest.mark.root]

CAPABILITY = pb.VolumeCapability(
    mount=pb.VolumeCapability.MountVolume(),
    access_mode=pb.VolumeCapability.AccessMode(
        mode=pb.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER
    ),
)


def test_a_published_volume_grows_online_and_keeps_its_data(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    trusted_dir = loopfile_plugin.top
    controller, node = loopfile_plugin.controller, loopfile_plugin.node
    stage, target = trusted_dir / "stage", trusted_dir / "pod" / "mount"
    stage.mkdir()
    (trusted_dir / "pod").mkdir()
    staged = False
    try:
        volume = controller.CreateVolume(
            pb.CreateVolumeRequest(
                name="grow-me",
                capacity_range=pb.CapacityRange(required_bytes=320 << 20),
                volume_capabilities=[CAPABILITY],
                parameters={"backend": "loopfile", "fsType": "xfs"},
            )
        ).volume
        assert volume.volume_context["flexhub.csi/fsType"] == "xfs"
        node.NodeStageVolume(
            pb.NodeStageVolumeRequest(
                volume_id=volume.volume_id,
                staging_target_path=str(stage),
                volume_capability=CAPABILITY,
                volume_context=volume.volume_context,
            )
        )
        staged = True
        node.NodePublishVolume(
            pb.NodePublishVolumeRequest(
                volume_id=volume.volume_id,
                staging_target_path=str(stage),
                target_path=str(target),
                volume_capability=CAPABILITY,
            )
        )
        (target / "data").write_bytes(b"x" * 4096)
        # ReadWriteOncePod: a second target of a single-writer volume is refused
        single = pb.VolumeCapability()
        single.CopyFrom(CAPABILITY)
        single.access_mode.mode = pb.VolumeCapability.AccessMode.Mode.SINGLE_NODE_SINGLE_WRITER
        with pytest.raises(grpc.RpcError) as second:
            node.NodePublishVolume(
                pb.NodePublishVolumeRequest(
                    volume_id=volume.volume_id,
                    staging_target_path=str(stage),
                    target_path=str(trusted_dir / "pod" / "second"),
                    volume_capability=single,
                )
            )
        assert second.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert str(target) in (second.value.details() or "")
        assert not (trusted_dir / "pod" / "second").exists()
        before = os.statvfs(target)
        new_size = 640 << 20
        reply = controller.ControllerExpandVolume(
            pb.ControllerExpandVolumeRequest(
                volume_id=volume.volume_id,
                capacity_range=pb.CapacityRange(required_bytes=new_size),
            )
        )
        assert reply.node_expansion_required
        grown = node.NodeExpandVolume(
            pb.NodeExpandVolumeRequest(
                volume_id=volume.volume_id,
                volume_path=str(target),
                capacity_range=pb.CapacityRange(required_bytes=new_size),
            )
        )
        assert grown.capacity_bytes == new_size
        after = os.statvfs(target)
        assert after.f_blocks * after.f_frsize > before.f_blocks * before.f_frsize + (256 << 20)
        assert (target / "data").read_bytes() == b"x" * 4096
        stats = node.NodeGetVolumeStats(
            pb.NodeGetVolumeStatsRequest(volume_id=volume.volume_id, volume_path=str(target))
        )
        assert stats.usage[0].total == after.f_blocks * after.f_frsize
        node.NodeUnpublishVolume(
            pb.NodeUnpublishVolumeRequest(volume_id=volume.volume_id, target_path=str(target))
        )
        node.NodeUnstageVolume(
            pb.NodeUnstageVolumeRequest(volume_id=volume.volume_id, staging_target_path=str(stage))
        )
        staged = False
        controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id))
    finally:
        if staged:
            for call, request in (
                (node.NodeUnpublishVolume,
                 pb.NodeUnpublishVolumeRequest(volume_id=volume.volume_id,
                                               target_path=str(target))),
                (node.NodeUnstageVolume,
                 pb.NodeUnstageVolumeRequest(volume_id=volume.volume_id,
                                             staging_target_path=str(stage))),
            ):  # fmt: skip
                with contextlib.suppress(grpc.RpcError):
                    call(request)
