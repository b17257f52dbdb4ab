"""CreateSnapshot intents (state_dir/csi/snapshot-intents) and CreateVolume's
content source, attacked as a racing controller call, a failing target, and an upgrade."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from flexhub.csi.controller import ControllerService
from flexhub.csi.proto import csi_pb2 as pb
from tests.conftest import needs_root
from tests.csi.test_create_retries import (  # noqa: F401 (the fixture)
    Context,
    Killed,
    code,
    controller,
    create,
    killed_after_the_backend,
    of_snapshot,
    snap,
    snapshot_files,
)

pytestmark = [needs_root]


def test_an_aborted_create_snapshot_leaves_no_intent_behind(
    controller: ControllerService,  # noqa: F811
    trusted_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CreateSnapshot writes its intent before it takes the volume's in-flight hold. When a
    DeleteVolume of the source is already past _settle_snapshots (reclaiming: zeroing a big
    volume), the CreateSnapshot is ABORTED with its intent on disk, and the volume record is
    then deleted: the intent is never settled nor removed. It leaks (every later DeleteVolume
    reads it again), and the snapshot name is poisoned (NOT_FOUND for its own source forever,
    ALREADY_EXISTS for any other)."""
    a = create(controller, "a")
    cls = type(controller._backend("loopfile"))
    real = cls.reclaim
    answers: list[grpc.StatusCode] = []

    def reclaim(self: Any, *args: Any, **kwargs: Any) -> Any:
        # the snapshotter's CreateSnapshot arrives while this DeleteVolume reclaims
        answers.append(code(lambda: snap(controller, "s", a.volume_id)))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, "reclaim", reclaim)
    controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=a.volume_id), Context())
    monkeypatch.undo()
    assert answers == [grpc.StatusCode.ABORTED]
    assert code(lambda: snap(controller, "s", a.volume_id)) == grpc.StatusCode.NOT_FOUND
    assert snapshot_files(trusted_dir) == []  # nothing was made...
    assert controller.intents.uids() == []  # ...so nothing may stay promised


def test_deleting_the_source_makes_nothing_and_names_what_a_killed_call_may_have_left(
    controller: ControllerService,  # noqa: F811
    trusted_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A CreateSnapshot killed after the backend made the snapshot, then DeleteVolume of its
    source (Kubernetes keeps a claim whose snapshot is being made; a CO that does not): the
    deletion makes no snapshot (a settle that copied the volume here could resurrect data a
    tenant deleted, and its failures orphaned anyway); it forgets the intent and names the
    copy the killed call may have left in a warning, for the operator (docs/csi.md)."""
    import logging

    a = create(controller, "a")
    killed_after_the_backend(controller, monkeypatch)
    with pytest.raises(Killed):
        snap(controller, "s", a.volume_id)
    made = snapshot_files(trusted_dir)
    assert len(made) == 1  # made, not recorded
    monkeypatch.undo()
    cls = type(controller._backend("loopfile"))

    def never(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("DeleteVolume made a snapshot")

    monkeypatch.setattr(cls, "snapshot", never)
    with caplog.at_level(logging.WARNING, logger="flexhub.csi"):
        controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=a.volume_id), Context())
    uid = Path(made[0]).name.removeprefix("snap-").removesuffix(".img")
    assert any(f"snap-{uid}" in r.getMessage() for r in caplog.records), caplog.text
    assert list(controller.intents.uids()) == []
    assert code(lambda: snap(controller, "s", a.volume_id)) == grpc.StatusCode.NOT_FOUND


def test_a_retry_of_a_restore_recorded_by_the_previous_version_still_names_its_source(
    controller: ControllerService,  # noqa: F811
    trusted_dir: Path,
) -> None:
    """Upgrade: a volume restored from a snapshot by the previous version has a record with
    no ``source``. The previous version's reply to a retry echoed the request's content
    source; now _volume() sets it only from record.source, so the retry's reply has none.
    external-provisioner treats a reply without content_source to a CreateVolume that had a
    data source as 'volume content source missing': it deletes the volume and fails the
    provisioning."""
    a = create(controller, "a")
    s = snap(controller, "s", a.volume_id)
    restored = create(controller, "from-s", of_snapshot(s.snapshot_id))
    assert restored.content_source == of_snapshot(s.snapshot_id)
    # rewrite its record as the previous version wrote it (no "source" key)
    path = next(p for p in trusted_dir.rglob("csi/volumes/*.json") if "from-s" in p.read_text())
    data = json.loads(path.read_text())
    del data["source"]
    path.write_text(json.dumps(data))
    try:
        again = create(controller, "from-s", of_snapshot(s.snapshot_id))
        assert again.volume_id == restored.volume_id
        assert again.content_source == of_snapshot(s.snapshot_id)
    finally:
        controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=s.snapshot_id), Context())
        for volume in (restored, a):
            controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id), Context())


def test_a_refused_retry_does_not_forget_what_the_killed_call_made(
    controller: ControllerService,  # noqa: F811
    trusted_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CreateSnapshot deletes the intent on InvalidOptions or NoRoom ('refused: the backend
    made nothing'). That holds for a first call, not for the retry of a killed one: the
    snapshot the killed call made is there, and a retry refused before it reaches the storage
    (iSCSI: InvalidOptions 'the class's Secret has no ssh-privatekey', a VolumeSnapshotClass
    Secret being rotated) drops the only trace of it. INVALID_ARGUMENT is final for the
    snapshotter; the source's DeleteVolume then settles nothing: the made snapshot is an
    orphan on the storage."""
    from flexhub.errors import InvalidOptions

    a = create(controller, "a")
    killed_after_the_backend(controller, monkeypatch)
    with pytest.raises(Killed):
        snap(controller, "s", a.volume_id)
    assert len(snapshot_files(trusted_dir)) == 1  # made, not recorded
    cls = type(controller._backend("loopfile"))

    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise InvalidOptions("the class's Secret has no ssh-privatekey")

    monkeypatch.setattr(cls, "snapshot", refused)
    assert code(lambda: snap(controller, "s", a.volume_id)) == grpc.StatusCode.INVALID_ARGUMENT
    monkeypatch.undo()
    # the intent kept: a retry of another volume is still ALREADY_EXISTS ...
    b = create(controller, "b")
    assert code(lambda: snap(controller, "s", b.volume_id)) == grpc.StatusCode.ALREADY_EXISTS
    # ... and the made snapshot is still answered by the retry, so DeleteSnapshot removes it
    found = snap(controller, "s", a.volume_id)
    controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=found.snapshot_id), Context())
    assert snapshot_files(trusted_dir) == []


def test_a_deleted_snapshot_is_not_made_again_by_its_source_s_deletion(
    controller: ControllerService,  # noqa: F811
    trusted_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CreateSnapshot killed after it recorded the snapshot but before it removed the intent
    (or whose intent removal failed: EROFS, EIO) leaves both. Its retry is answered from the
    record and leaves the intent; DeleteSnapshot removes the record and the storage's copy
    and leaves the intent. The PVC's DeleteVolume then settles that stale intent: it makes a
    brand-new full copy of the volume being deleted and records it. Nobody will ever
    DeleteSnapshot it: the tenant's data outlives both the snapshot and the PVC it deleted,
    and it holds room forever."""
    a = create(controller, "a")
    real_delete = controller.intents.delete

    def killed(uid: str) -> None:
        monkeypatch.setattr(controller.intents, "delete", real_delete)
        raise Killed

    monkeypatch.setattr(controller.intents, "delete", killed)
    with pytest.raises(Killed):
        snap(controller, "s", a.volume_id)
    found = snap(controller, "s", a.volume_id)  # the retry: answered from the record
    controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=found.snapshot_id), Context())
    assert snapshot_files(trusted_dir) == []
    controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=a.volume_id), Context())
    listed = controller.ListSnapshots(pb.ListSnapshotsRequest(), Context()).entries
    assert [e.snapshot.snapshot_id for e in listed] == []
    assert snapshot_files(trusted_dir) == []


def test_a_retry_of_a_recorded_snapshot_answers_on_a_read_only_state_disk(
    controller: ControllerService,  # noqa: F811
    trusted_dir: Path,
) -> None:
    """A recorded snapshot's CreateSnapshot retry only reads: with the controller's state
    directory read-only (a full or failing disk remounted ro), it answers the snapshot as
    before. Removing an intent no call left must not write: unlink(2) of a missing file on a
    read-only filesystem fails with EROFS, not ENOENT, and the retry was INTERNAL. A new
    snapshot, which must record itself, is refused in one line and nothing is made."""
    import subprocess

    a = create(controller, "a")
    first = snap(controller, "s", a.volume_id)
    made = snapshot_files(trusted_dir)
    assert len(made) == 1
    csi = controller.intents.directory.parent
    controller.intents.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(csi), str(csi)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(csi)], check=True)
        again = snap(controller, "s", a.volume_id)
        assert again.snapshot_id == first.snapshot_id and again.size_bytes == first.size_bytes
        assert code(lambda: snap(controller, "t", a.volume_id)) == grpc.StatusCode.INTERNAL
    finally:
        subprocess.run(["umount", str(csi)], check=True)
    assert controller.intents.uids() == [] and snapshot_files(trusted_dir) == made
