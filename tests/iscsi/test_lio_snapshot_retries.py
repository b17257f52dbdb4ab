"""iSCSI CreateSnapshot whose answer is lost, through the CSI controller in-process with the
recording ``ssh`` of ``test_provision``: the retry asks the target host for the same
``snap-<uid>`` (which the remote program answers as ``exists``: ``test_lio_snapshots``), never
another; a source volume deleted before the retry has the snapshot recorded first; another
source under the name is ``ALREADY_EXISTS``; a refused snapshot leaves nothing to settle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from flexhub.config import NodeConfig
from flexhub.csi.proto import csi_pb2 as pb
from tests.iscsi.test_lio_capacity import Aborted, Context
from tests.iscsi.test_provision import PARAMS, Ssh, last_request, request_of, secrets

MiB = 1 << 20
MOUNT = pb.VolumeCapability(
    mount=pb.VolumeCapability.MountVolume(),
    access_mode=pb.VolumeCapability.AccessMode(
        mode=pb.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER
    ),
)
LOST = {"rc": 255, "answer": {}, "stderr": "Connection to 10.0.0.5 closed by remote host."}


def _action(sent: str) -> str:
    """The action of the request line that ends what was sent."""
    action: str = last_request(sent)["action"]
    return action


class Target(Ssh):
    """The recording ssh, answering each action as the target host would."""

    def __init__(self) -> None:
        super().__init__()
        self.lost_next = False
        self.refuse_next = False

    def __call__(self, argv: Any, **kwargs: Any) -> Any:
        action = _action(kwargs.get("input") or "")
        self.answer = {
            "provision": {"ok": {"size": 64 * MiB, "created": True}},
            "snapshot": {"ok": {"size": 64 * MiB, "how": "exists" if self.made else "reflink"}},
            "delete": {"ok": {"deleted": ["target"]}},
            "delete_snapshot": {"ok": {"deleted": ["snap"]}},
            "restore": {"ok": {"size": 64 * MiB, "created": True, "how": "reflink"}},
        }[action]
        self.rc, self.stderr = 0, ""
        if action == "snapshot" and self.refuse_next:  # as the room rule refuses: nothing made
            self.refuse_next = False
            self.rc, self.answer = 3, {"error": "not enough room", "room": True}
        elif action == "snapshot":
            self.made = True
        if self.lost_next:  # the target host did it; its answer never came back
            self.lost_next = False
            self.rc, self.stderr, self.answer = LOST["rc"], str(LOST["stderr"]), {}
        return super().__call__(argv, **kwargs)

    made = False

    def actions(self) -> list[str]:
        found = []
        for program in self.inputs:
            assert program is not None
            found.append(_action(program))
        return found


def controller(tmp_path: Path, runner: Ssh) -> Any:
    from flexhub.csi.controller import ControllerService

    service = ControllerService(
        NodeConfig(state_dir=tmp_path / "state", backends={"iscsi": {}}), "n"
    )
    original = service._backend

    def with_runner(name: str) -> Any:
        found = original(name)
        found.node.runner = runner
        return found

    service._backend = with_runner  # type: ignore[method-assign]
    return service


PLAIN = {k: v.reveal() for k, v in secrets().items()}


def volume(service: Any, name: str) -> Any:
    return service.CreateVolume(
        pb.CreateVolumeRequest(name=name, capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
                               volume_capabilities=[MOUNT], parameters={"backend": "iscsi", **PARAMS},
                               secrets=PLAIN), Context(),
    ).volume  # fmt: skip


def snap(service: Any, name: str, volume_id: str) -> Any:
    request = pb.CreateSnapshotRequest(name=name, source_volume_id=volume_id, secrets=PLAIN)
    return service.CreateSnapshot(request, Context()).snapshot


def delete(service: Any, volume_id: str) -> None:
    service.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume_id, secrets=PLAIN), Context())


def test_a_lost_answer_is_found_again_by_the_retry(tmp_path: Path) -> None:
    target = Target()
    service = controller(tmp_path, target)
    a = volume(service, "a")
    target.lost_next = True
    with pytest.raises(Aborted):
        snap(service, "s", a.volume_id)
    asked = request_of(target)["spec"]["snapshot"]
    found = snap(service, "s", a.volume_id)
    assert request_of(target)["spec"]["snapshot"] == asked  # the same snap-<uid>
    assert snap(service, "s", a.volume_id) == found  # answered from the record
    assert target.actions() == ["provision", "snapshot", "snapshot"]
    assert not list((tmp_path / "state" / "csi" / "snapshot-intents").glob("*.json"))


def test_a_refused_snapshot_leaves_nothing_to_settle(tmp_path: Path) -> None:
    target = Target()
    service = controller(tmp_path, target)
    a = volume(service, "a")

    target.refuse_next = True
    with pytest.raises(Aborted) as caught:
        snap(service, "s", a.volume_id)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    delete(service, a.volume_id)
    assert target.actions() == ["provision", "snapshot", "delete"]  # no snapshot made then


def test_create_volume_with_another_content_source_is_already_exists(tmp_path: Path) -> None:
    """F9 for iSCSI (the controller's check, whatever the backend): a restore's name asked
    again as a clone, or with no source, is ALREADY_EXISTS and reaches no target host."""
    target = Target()
    service = controller(tmp_path, target)
    a = volume(service, "a")
    s = snap(service, "s", a.volume_id)
    by_snapshot = pb.VolumeContentSource(
        snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=s.snapshot_id)
    )
    by_volume = pb.VolumeContentSource(
        volume=pb.VolumeContentSource.VolumeSource(volume_id=a.volume_id)
    )

    def create(source: Any) -> Any:
        request = pb.CreateVolumeRequest(
            name="r", capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
            volume_capabilities=[MOUNT], parameters={"backend": "iscsi", **PARAMS}, secrets=PLAIN,
        )  # fmt: skip
        if source is not None:
            request.volume_content_source.CopyFrom(source)
        return service.CreateVolume(request, Context()).volume

    made = create(by_snapshot)
    calls = len(target.calls)
    assert create(by_snapshot).volume_id == made.volume_id
    for other in (by_volume, None):
        with pytest.raises(Aborted) as caught:
            create(other)
        assert caught.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert len(target.calls) == calls
