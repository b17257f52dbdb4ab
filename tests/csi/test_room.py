"""The loopfile node room under CSI, on a real root: a volume beyond it is staged as
``RESOURCE_EXHAUSTED`` (one line, nothing made, no loop device)."""

from __future__ import annotations

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


def test_staging_a_volume_beyond_the_node_room_is_resource_exhausted(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    trusted_dir = loopfile_plugin.top
    controller, node = loopfile_plugin.controller, loopfile_plugin.node
    stage = trusted_dir / "stage"
    stage.mkdir()
    volume = controller.CreateVolume(
        pb.CreateVolumeRequest(
            name="too-big",
            capacity_range=pb.CapacityRange(required_bytes=1 << 60),
            volume_capabilities=[CAPABILITY],
            # a class that allows it (the default maxSize, 1Ti, refuses it at create):
            # only the node, at stage, knows its room
            parameters={"backend": "loopfile", "maxSize": "1Ei"},
        )
    ).volume
    with pytest.raises(grpc.RpcError) as refused:
        node.NodeStageVolume(
            pb.NodeStageVolumeRequest(
                volume_id=volume.volume_id,
                staging_target_path=str(stage),
                volume_capability=CAPABILITY,
                volume_context=volume.volume_context,
            )
        )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    message = refused.value.details() or ""
    assert "not enough room" in message and "\n" not in message, message
    assert not any((trusted_dir / "loopfiles").rglob("*.img"))
    controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id))
