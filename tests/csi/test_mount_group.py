"""VOLUME_MOUNT_GROUP: the capability's ``volume_mount_group`` (the pod's fsGroup, delegated to
the driver) is applied as the FlexVolume driver applies fsGroup
(tests/loopfile/test_fsgroup_e2e.py): on real loop devices, a read-write loopfile volume's
filesystem root gets the group, ``g+rwx`` and setgid at stage and at each read-write publish
(the last group wins), nothing below the root changes, a read-only publish changes nothing,
and a group that is no decimal id is INVALID_ARGUMENT before anything is mounted."""

from __future__ import annotations

import contextlib
import stat
from pathlib import Path
from typing import Any

import grpc
import pytest

from flexhub.csi.proto import csi_pb2 as pb
from tests.conftest import needs_root
from tests.csi.sanity import LoopfilePlugin, loops_backed_under

pytestmark = [needs_root, pytest.mark.root]

Mode = pb.VolumeCapability.AccessMode.Mode


def capability(group: str = "", mode: int = Mode.SINGLE_NODE_MULTI_WRITER) -> Any:
    return pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(volume_mount_group=group),
        access_mode=pb.VolumeCapability.AccessMode(mode=mode),
    )


def gid_mode(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_gid, stat.S_IMODE(info.st_mode)


def test_a_loopfile_volume_root_gets_the_mount_group_as_flexvolume_applies_fsgroup(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    trusted_dir = loopfile_plugin.top
    controller, node = loopfile_plugin.controller, loopfile_plugin.node
    stage, pods = trusted_dir / "stage", trusted_dir / "pods"
    stage.mkdir()
    pods.mkdir()
    volume: Any = None
    targets: list[Path] = []

    def publish(name: str, group: str, readonly: bool = False) -> Path:
        target = pods / name
        targets.append(target)
        node.NodePublishVolume(
            pb.NodePublishVolumeRequest(
                volume_id=volume.volume_id,
                staging_target_path=str(stage),
                target_path=str(target),
                volume_capability=capability(group),
                readonly=readonly,
            )
        )
        return target

    def refused(call: Any, request: Any) -> str:
        with pytest.raises(grpc.RpcError) as caught:
            call(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return caught.value.details() or ""

    try:
        caps = node.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest()).capabilities
        assert pb.NodeServiceCapability.RPC.Type.VOLUME_MOUNT_GROUP in {c.rpc.type for c in caps}
        volume = controller.CreateVolume(
            pb.CreateVolumeRequest(
                name="grouped",
                capacity_range=pb.CapacityRange(required_bytes=320 << 20),
                volume_capabilities=[capability()],
                parameters={"backend": "loopfile", "fsType": "xfs"},
            )
        ).volume
        stage_request = pb.NodeStageVolumeRequest(
            volume_id=volume.volume_id,
            staging_target_path=str(stage),
            volume_capability=capability("staff"),
            volume_context=volume.volume_context,
        )
        assert refused(node.NodeStageVolume, stage_request) == (
            "volume_mount_group 'staff' is not a decimal group id"
        )
        assert loops_backed_under(trusted_dir) == [] and not any(stage.iterdir())

        stage_request.volume_capability.CopyFrom(capability("4321"))
        node.NodeStageVolume(stage_request)
        assert gid_mode(stage) == (4321, 0o2775)  # xfs's root 0755: g+rwx and setgid added
        first = publish("a", "4321")
        assert gid_mode(first) == (4321, 0o2775)
        (first / "sub").mkdir(mode=0o755)
        (first / "file").write_text("x")
        assert gid_mode(first / "file")[0] == 4321  # setgid: the pod's files get its group

        # a second pod with another fsGroup: the root's group is the last pod's, as with
        # FlexVolume; nothing below the root is touched
        second = publish("b", "5555")
        assert gid_mode(second) == (5555, 0o2775)
        assert gid_mode(first / "sub") == (4321, 0o2755)
        assert gid_mode(first / "file") == (4321, 0o644)
        # read-only: nothing changes
        publish("c", "7777", readonly=True)
        assert gid_mode(stage) == (5555, 0o2775)
        assert refused(
            node.NodePublishVolume,
            pb.NodePublishVolumeRequest(
                volume_id=volume.volume_id,
                staging_target_path=str(stage),
                target_path=str(pods / "d"),
                volume_capability=capability("-1"),
            ),
        ).startswith("volume_mount_group '-1'")
        assert not (pods / "d").exists()
    finally:
        if volume is not None:
            for target in targets:
                with contextlib.suppress(grpc.RpcError):
                    node.NodeUnpublishVolume(
                        pb.NodeUnpublishVolumeRequest(
                            volume_id=volume.volume_id, target_path=str(target)
                        )
                    )
            with contextlib.suppress(grpc.RpcError):
                node.NodeUnstageVolume(
                    pb.NodeUnstageVolumeRequest(
                        volume_id=volume.volume_id, staging_target_path=str(stage)
                    )
                )
            with contextlib.suppress(grpc.RpcError):
                controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id))
