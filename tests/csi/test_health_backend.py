"""NodeGetVolumeHealth asks a block backend what its attachment lacks
(:meth:`flexhub.backend.BlockBackend.health`: iSCSI's paths, which a stat of the mounted
filesystem does not see) with the attachment the node journalled, within the call's bound, and
answers whatever the backend does (an exception, a hang). In process, on a real loopfile stage;
iSCSI's own answer from the kernel is tests/vm/test_csi_iscsi_fence_vm.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flexhub_loopfile import LoopfileBackend

from flexhub.backend import Attachment, VolumeTrouble
from flexhub.config import load_config
from flexhub.csi import node as csi_node
from flexhub.csi.controller import ControllerService
from flexhub.csi.node import NodeService
from flexhub.csi.proto import csi_pb2 as pb
from tests.conftest import needs_root
from tests.csi.sanity import node_config
from tests.csi.test_create_retries import MOUNT, Context, create

pytestmark = [needs_root]

DEGRADED = pb.VolumeHealthErrorType.DEGRADED
INACCESSIBLE = pb.VolumeHealthErrorType.INACCESSIBLE


@pytest.fixture
def staged(trusted_dir: Path) -> Iterator[tuple[NodeService, str, Path]]:
    config = load_config(node_config(trusted_dir))
    controller, node = ControllerService(config, "node-1"), NodeService(config, "node-1")
    volume = create(controller, "health")
    stage = trusted_dir / "stage"
    stage.mkdir()
    request = pb.NodeStageVolumeRequest(
        volume_id=volume.volume_id,
        staging_target_path=str(stage),
        volume_capability=MOUNT,
        volume_context=volume.volume_context,
    )
    node.NodeStageVolume(request, Context())
    try:
        yield node, volume.volume_id, stage
    finally:
        unstage = pb.NodeUnstageVolumeRequest(
            volume_id=volume.volume_id, staging_target_path=str(stage)
        )
        node.NodeUnstageVolume(unstage, Context())
        controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id), Context())


def entries(node: NodeService, volume_id: str) -> list[tuple[int, str, str]]:
    request = pb.NodeGetVolumeHealthRequest(volume_id=volume_id)
    reply = node.NodeGetVolumeHealth(request, Context()).volume_health
    return [(e.status, e.reason, e.message) for e in reply.health_statuses]


def test_the_backend_s_troubles_join_the_stat_s(
    staged: tuple[NodeService, str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    node, volume_id, _ = staged
    assert entries(node, volume_id) == []  # loopfile knows nothing more: the default
    seen: list[Attachment] = []

    def health(self: Any, attachment: Attachment) -> list[VolumeTrouble]:
        seen.append(attachment)
        return [
            VolumeTrouble("degraded", "PathDown", "one path down"),
            VolumeTrouble("degraded", "PathDown", "another"),
            VolumeTrouble("inaccessible", "PathsDown", "none left"),
        ]

    monkeypatch.setattr(LoopfileBackend, "health", health)
    assert entries(node, volume_id) == [
        (DEGRADED, "PathDown", "one path down; another"),
        (INACCESSIBLE, "PathsDown", "none left"),
    ]
    # the journalled attachment: the staged loop device and the details attach returned
    (record,) = [r for r in node._node().journal.volumes() if r.device]
    assert seen == [Attachment(record.device, record.details)]
    assert record.device.startswith("/dev/loop") and record.details


def test_a_failing_or_hanging_backend_check_is_nothing_known(
    staged: tuple[NodeService, str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    node, volume_id, _ = staged

    def broken(self: Any, attachment: Attachment) -> list[VolumeTrouble]:
        raise RuntimeError("sysfs moved")

    monkeypatch.setattr(LoopfileBackend, "health", broken)
    assert entries(node, volume_id) == []
    release = threading.Event()

    def hangs(self: Any, attachment: Attachment) -> list[VolumeTrouble]:
        release.wait(30)
        return [VolumeTrouble("inaccessible", "PathsDown", "too late")]

    monkeypatch.setattr(LoopfileBackend, "health", hangs)
    monkeypatch.setattr(csi_node, "STAT_BOUND", 0.5)
    try:
        started = time.monotonic()
        assert entries(node, volume_id) == []
        assert time.monotonic() - started < 3
    finally:
        release.set()


def test_a_trouble_of_another_status_is_refused_where_it_is_made() -> None:
    with pytest.raises(ValueError, match="degraded or inaccessible"):
        VolumeTrouble("broken", "X", "y")
