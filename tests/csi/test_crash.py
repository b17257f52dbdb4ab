"""A CSI plugin SIGKILLed at every checkpoint of a stage or an unstage converges on the
retried call, as the FlexVolume driver does: the same journal, on real loop devices and
mounts, under a root-only directory. Then the volume's data survives publish and unpublish,
and nothing is left: no mount, no loop device, no file, no record."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import grpc
import pytest

from flexhub.csi.proto import csi_pb2 as pb
from flexhub.csi.proto import csi_pb2_grpc as rpc
from flexhub.node.checkpoints import CHECKPOINTS, CRASH_ENV, UNMOUNT_CHECKPOINTS
from tests.conftest import needs_root
from tests.csi.sanity import loops_backed_under, node_config, start_plugin, stop_plugin

pytestmark = [needs_root, pytest.mark.root]

CAPABILITY = pb.VolumeCapability(
    mount=pb.VolumeCapability.MountVolume(fs_type="ext4"),
    access_mode=pb.VolumeCapability.AccessMode(
        mode=pb.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER
    ),
)


class Calls:
    def __init__(self, endpoint: Path) -> None:
        self.channel = grpc.insecure_channel(f"unix://{endpoint}")
        self.controller = rpc.ControllerStub(self.channel)
        self.node = rpc.NodeStub(self.channel)

    def close(self) -> None:
        self.channel.close()


def mounted_under(path: Path) -> list[str]:
    return [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4].startswith(f"{path}/")
    ]


BLOCK = pb.VolumeCapability(
    block=pb.VolumeCapability.BlockVolume(),
    access_mode=pb.VolumeCapability.AccessMode(
        mode=pb.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER
    ),
)
#: A raw block stage neither formats (format-intent, formatted) nor mounts (staged, bound).
RAW_CHECKPOINTS = tuple(
    c for c in CHECKPOINTS if c not in ("staged", "bound", "format-intent", "formatted")
)


def _keep(target: Path, raw: bool) -> None:
    if raw:
        fd = os.open(target, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.pwrite(fd, b"kept", 1 << 20)
            os.fsync(fd)
        finally:
            os.close(fd)
    else:
        (target / "data").write_text("kept")


def _kept(target: Path, raw: bool) -> bool:
    if raw:
        fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, 4, 1 << 20) == b"kept"
        finally:
            os.close(fd)
    return (target / "data").read_text() == "kept"


@pytest.mark.parametrize(
    ("access", "phase", "at"),
    [("mount", "stage", c) for c in CHECKPOINTS]
    + [("mount", "unstage", c) for c in UNMOUNT_CHECKPOINTS]
    + [("block", "stage", c) for c in RAW_CHECKPOINTS]
    + [("block", "unstage", c) for c in UNMOUNT_CHECKPOINTS],
)
def test_a_plugin_killed_at_a_checkpoint_converges_on_the_retried_call(
    trusted_dir: Path, access: str, phase: str, at: str
) -> None:
    raw = access == "block"
    capability = BLOCK if raw else CAPABILITY
    config = node_config(trusted_dir)
    endpoint, log = trusted_dir / "csi.sock", trusted_dir / "plugin.log"
    stage, target = trusted_dir / "stage", trusted_dir / "pod" / "mount"
    stage.mkdir()
    (trusted_dir / "pod").mkdir()

    def stage_request(volume: Any) -> Any:
        return pb.NodeStageVolumeRequest(
            volume_id=volume.volume_id,
            staging_target_path=str(stage),
            volume_capability=capability,
            volume_context=volume.volume_context,
        )

    unstage_request = None
    proc = start_plugin(config, endpoint, log)
    calls = Calls(endpoint)
    try:
        volume = calls.controller.CreateVolume(
            pb.CreateVolumeRequest(
                name=f"crash-{access}-{phase}-{at}",
                capacity_range=pb.CapacityRange(required_bytes=32 << 20),
                volume_capabilities=[capability],
                parameters={"backend": "loopfile"},
            )
        ).volume
        unstage_request = pb.NodeUnstageVolumeRequest(
            volume_id=volume.volume_id, staging_target_path=str(stage)
        )
        if phase == "unstage":
            calls.node.NodeStageVolume(stage_request(volume))
        stop_plugin(proc)
        calls.close()

        # the call the plugin dies in
        proc = start_plugin(config, endpoint, log, **{CRASH_ENV: at})
        calls = Calls(endpoint)
        with pytest.raises(grpc.RpcError) as died:
            if phase == "stage":
                calls.node.NodeStageVolume(stage_request(volume))
            else:
                calls.node.NodeUnstageVolume(unstage_request)
        assert died.value.code() == grpc.StatusCode.UNAVAILABLE
        assert proc.wait(timeout=30) == -9  # SIGKILL: the checkpoint was reached
        calls.close()

        # the retry, by a new plugin
        proc = start_plugin(config, endpoint, log)
        calls = Calls(endpoint)
        if phase == "stage":
            calls.node.NodeStageVolume(stage_request(volume))
            with pytest.raises(grpc.RpcError) as in_use:
                calls.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id))
            assert in_use.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            publish = pb.NodePublishVolumeRequest(
                volume_id=volume.volume_id,
                staging_target_path=str(stage),
                target_path=str(target),
                volume_capability=capability,
            )
            calls.node.NodePublishVolume(publish)
            calls.node.NodePublishVolume(publish)  # idempotent
            _keep(target, raw)
            calls.node.NodeUnpublishVolume(
                pb.NodeUnpublishVolumeRequest(volume_id=volume.volume_id, target_path=str(target))
            )
            assert not target.exists()
            calls.node.NodePublishVolume(publish)
            assert _kept(target, raw)
            calls.node.NodeUnpublishVolume(
                pb.NodeUnpublishVolumeRequest(volume_id=volume.volume_id, target_path=str(target))
            )
        calls.node.NodeUnstageVolume(unstage_request)
        calls.node.NodeUnstageVolume(unstage_request)  # idempotent
        calls.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id))
    finally:
        calls.close()
        if unstage_request is not None and proc.poll() is None:
            # whatever failed above, leave no mount or loop device behind
            try:
                calls = Calls(endpoint)
                calls.node.NodeUnstageVolume(unstage_request)
            except grpc.RpcError:
                pass
        stop_plugin(proc)
    assert mounted_under(trusted_dir) == []
    assert loops_backed_under(trusted_dir) == []
    assert not any((trusted_dir / "loopfiles").rglob("*.img"))
    assert not list((trusted_dir / "state" / "csi" / "volumes").glob("*.json"))
