"""Retried and repeated CreateVolume and CreateSnapshot calls against the CSI controller,
in-process, with loopfile on the host: the same name with another content source is
``ALREADY_EXISTS`` (CSI: same name, incompatible parameters); a snapshot whose answer was
lost, or whose call was killed before it recorded anything, is found again by the retry,
never made twice nor left behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from flexhub.config import load_config
from flexhub.csi.controller import ControllerService
from flexhub.csi.proto import csi_pb2 as pb
from tests.conftest import needs_root
from tests.csi.sanity import node_config

pytestmark = [needs_root]

MiB = 1 << 20
MOUNT = pb.VolumeCapability(
    mount=pb.VolumeCapability.MountVolume(),
    access_mode=pb.VolumeCapability.AccessMode(
        mode=pb.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER
    ),
)
PARAMETERS = {"backend": "loopfile"}


@pytest.fixture
def controller(trusted_dir: Path) -> Iterator[ControllerService]:
    config = load_config(node_config(trusted_dir))
    yield ControllerService(config, "node-a")


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


class Context:
    """What the handlers use of gRPC's servicer context: ``abort`` raises."""

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise Aborted(code, message)


def create(service: ControllerService, name: str, source: Any = None) -> Any:
    request = pb.CreateVolumeRequest(
        name=name,
        capacity_range=pb.CapacityRange(required_bytes=16 * MiB),
        volume_capabilities=[MOUNT],
        parameters=PARAMETERS,
    )
    if source is not None:
        request.volume_content_source.CopyFrom(source)
    return service.CreateVolume(request, Context()).volume


def of_snapshot(snapshot_id: str) -> Any:
    return pb.VolumeContentSource(
        snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=snapshot_id)
    )


def of_volume(volume_id: str) -> Any:
    return pb.VolumeContentSource(volume=pb.VolumeContentSource.VolumeSource(volume_id=volume_id))


def snap(service: ControllerService, name: str, volume_id: str) -> Any:
    request = pb.CreateSnapshotRequest(name=name, source_volume_id=volume_id)
    return service.CreateSnapshot(request, Context()).snapshot


def code(call: Any) -> grpc.StatusCode:
    with pytest.raises(Aborted) as caught:
        call()
    return caught.value.code


def test_the_same_name_with_another_content_source_is_already_exists(
    controller: ControllerService,
) -> None:
    a, b = create(controller, "a"), create(controller, "b")
    s1 = snap(controller, "s1", a.volume_id)
    s2 = snap(controller, "s2", b.volume_id)
    from_s1 = create(controller, "from-s1", of_snapshot(s1.snapshot_id))
    # a retry with the same source answers the same volume (the source included)
    again = create(controller, "from-s1", of_snapshot(s1.snapshot_id))
    assert again.volume_id == from_s1.volume_id
    assert again.content_source == of_snapshot(s1.snapshot_id)
    exists = grpc.StatusCode.ALREADY_EXISTS
    assert code(lambda: create(controller, "from-s1", of_snapshot(s2.snapshot_id))) == exists
    assert code(lambda: create(controller, "from-s1", of_volume(a.volume_id))) == exists
    assert code(lambda: create(controller, "from-s1")) == exists
    clone = create(controller, "clone-a", of_volume(a.volume_id))
    assert code(lambda: create(controller, "clone-a", of_volume(b.volume_id))) == exists
    assert code(lambda: create(controller, "clone-a", of_snapshot(s1.snapshot_id))) == exists
    assert code(lambda: create(controller, "a", of_volume(b.volume_id))) == exists
    assert code(lambda: create(controller, "a", of_snapshot(s1.snapshot_id))) == exists
    # the retry of a volume made from a snapshot deleted since still answers that volume
    controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=s1.snapshot_id), Context())
    assert create(controller, "from-s1", of_snapshot(s1.snapshot_id)).volume_id == (
        from_s1.volume_id
    )
    for volume in (from_s1, clone, a, b):
        controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id), Context())
    controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=s2.snapshot_id), Context())


def snapshot_files(top: Path) -> list[str]:
    """Every file under the loopfile root's snapshots, leftovers of killed copies included."""
    return sorted(p.name for p in (top / "loopfiles" / "snapshots").rglob("*") if p.is_file())


class Killed(BaseException):
    """A call killed at a point (what SIGKILL leaves: nothing after it runs)."""


def killed_after_the_backend(service: ControllerService, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next CreateSnapshot is killed once the backend made the snapshot, before the
    controller recorded it."""

    def put(uid: str, record: Any) -> None:
        monkeypatch.undo()
        raise Killed

    monkeypatch.setattr(service.snapshots, "put", put)


def test_a_lost_create_snapshot_answer_is_answered_again(
    controller: ControllerService, trusted_dir: Path
) -> None:
    a = create(controller, "a")
    first = snap(controller, "s", a.volume_id)
    again = snap(controller, "s", a.volume_id)
    assert again == first  # the same id, size and creation time
    assert len(snapshot_files(trusted_dir)) == 1
    controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=first.snapshot_id), Context())
    controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=a.volume_id), Context())
    assert snapshot_files(trusted_dir) == []


def test_a_snapshot_made_by_a_killed_call_is_found_by_the_retry(
    controller: ControllerService, trusted_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = create(controller, "a")
    killed_after_the_backend(controller, monkeypatch)
    with pytest.raises(Killed):
        snap(controller, "s", a.volume_id)
    made = snapshot_files(trusted_dir)
    assert len(made) == 1  # made, not recorded
    found = snap(controller, "s", a.volume_id)
    assert snapshot_files(trusted_dir) == made  # the same file, no second one
    listed = controller.ListSnapshots(pb.ListSnapshotsRequest(), Context()).entries
    assert [e.snapshot.snapshot_id for e in listed] == [found.snapshot_id]
    controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=found.snapshot_id), Context())
    controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=a.volume_id), Context())
    assert snapshot_files(trusted_dir) == []


def test_the_retry_of_a_killed_snapshot_with_another_source_is_already_exists(
    controller: ControllerService, trusted_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never another volume's data under the name: the killed call's snapshot is of ``a``."""
    a, b = create(controller, "a"), create(controller, "b")
    killed_after_the_backend(controller, monkeypatch)
    with pytest.raises(Killed):
        snap(controller, "s", a.volume_id)
    assert code(lambda: snap(controller, "s", b.volume_id)) == grpc.StatusCode.ALREADY_EXISTS
    found = snap(controller, "s", a.volume_id)
    controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=found.snapshot_id), Context())
    for volume in (a, b):
        controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id), Context())
    assert snapshot_files(trusted_dir) == []


def test_a_copy_left_by_a_killed_call_is_removed_by_the_retry(
    controller: ControllerService, trusted_dir: Path
) -> None:
    """SIGKILL in the middle of the copy leaves its temporary (``.snap-<uid>.img.<random>
    .flexhub-new``, nothing else runs): the retry removes it, under the room lock."""
    from flexhub.csi.snapshots import snapshot_uid

    a = create(controller, "a")
    where = trusted_dir / "loopfiles" / "snapshots" / "default"
    where.mkdir(parents=True, mode=0o700)
    leftover = where / f".snap-{snapshot_uid('s')}.img.0a1b2c3d.flexhub-new"
    leftover.write_bytes(b"\x5a" * 65536)
    leftover.chmod(0o600)
    found = snap(controller, "s", a.volume_id)
    assert snapshot_files(trusted_dir) == [f"snap-{snapshot_uid('s')}.img"]
    controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=found.snapshot_id), Context())
    controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=a.volume_id), Context())
    assert snapshot_files(trusted_dir) == []
