"""Unit logic of the CSI front end: status codes, in-flight calls, ids, records, endpoints."""

from __future__ import annotations

import stat
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from flexhub.csi.controller import volume_uid
from flexhub.csi.records import VolumeRecord, VolumeRecords, uid_of_volume
from flexhub.csi.server import socket_path
from flexhub.csi.snapshots import copy_options
from flexhub.csi.status import CsiError, InFlight, code_of
from flexhub.errors import (
    BackendError,
    CallTimeout,
    CommandError,
    CommandTimeout,
    InvalidOptions,
    LockTimeout,
    NoRoom,
    NotSupported,
    ReleaseDeferred,
    StateError,
    UntrustedPath,
    UsageError,
    VolumeError,
)

S = grpc.StatusCode


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidOptions("x"), S.INVALID_ARGUMENT),
        (UsageError("x"), S.INVALID_ARGUMENT),
        (NotSupported("x"), S.INVALID_ARGUMENT),
        (LockTimeout("x"), S.ABORTED),
        (NoRoom("x"), S.RESOURCE_EXHAUSTED),
        (VolumeError("x"), S.FAILED_PRECONDITION),
        (ReleaseDeferred("x"), S.FAILED_PRECONDITION),
        (UntrustedPath("x"), S.FAILED_PRECONDITION),
        (CommandTimeout("x"), S.DEADLINE_EXCEEDED),
        (CallTimeout("x"), S.DEADLINE_EXCEEDED),
        (CommandError("x"), S.INTERNAL),
        (StateError("x"), S.INTERNAL),
        (BackendError("x"), S.INTERNAL),
        (CsiError(S.NOT_FOUND, "x"), S.NOT_FOUND),
    ],
)
def test_each_flexhub_error_has_its_csi_status_code(error: BaseException, code: S) -> None:
    assert code_of(error) == code


def test_a_second_call_on_a_volume_in_flight_is_aborted_and_the_volume_freed_after() -> None:
    flight = InFlight()
    inside, release = threading.Event(), threading.Event()

    def first() -> None:
        with flight.hold("vol-a"):
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(10)
    with pytest.raises(CsiError) as caught, flight.hold("vol-a"):
        pass
    assert caught.value.code == S.ABORTED
    assert "vol-a" in caught.value.message
    with flight.hold("vol-b"):  # another volume is not held up
        pass
    release.set()
    thread.join(10)
    with flight.hold("vol-a"):  # free again once the first call ended
        pass


def test_volume_uids_are_stable_per_name_and_shaped_as_kubernetes_uids() -> None:
    uid = volume_uid("pvc-1234")
    assert uid == volume_uid("pvc-1234")
    assert uid != volume_uid("pvc-1235")
    assert len(uid) == 36 and uid.count("-") == 4
    assert uid_of_volume(f"loopfile:{uid}") == uid
    assert uid_of_volume("someone-elses-volume") == ""
    assert uid_of_volume(f":{uid}") == ""


def test_volume_records_round_trip_privately_and_refuse_a_foreign_key(tmp_path: Path) -> None:
    records = VolumeRecords(tmp_path / "state")
    uid = volume_uid("pvc-x")
    assert records.get(uid) is None
    record = VolumeRecord(
        name="pvc-x",
        volume_id=f"loopfile:{uid}",
        backend="loopfile",
        parameters={"backend": "loopfile"},
        options={"backend": "loopfile", "file": f"provisioned/pvc-{uid}.img", "size": "1"},
        reclaim={"claimUid": uid, "namespace": "default", "onDelete": "delete"},
        size=4096,
        fs_type="",
        node="node-1",
        namespace="default",
    )
    records.put(uid, record)
    assert records.get(uid) == record
    path = records.directory / f"{uid}.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(records.directory.stat().st_mode) == 0o700
    records.delete(uid)
    records.delete(uid)  # gone already: fine
    assert records.get(uid) is None
    with pytest.raises(StateError):
        records.get("../../etc/passwd")


def test_only_unix_endpoints_with_absolute_paths_are_served() -> None:
    assert socket_path("unix:///csi/csi.sock") == Path("/csi/csi.sock")
    assert socket_path("unix:/csi/csi.sock") == Path("/csi/csi.sock")
    for bad in ("tcp://0.0.0.0:10000", "unix://relative.sock", "/csi/csi.sock", ""):
        with pytest.raises(UsageError):
            socket_path(bad)


def test_a_stat_that_never_answers_does_not_take_a_worker(monkeypatch: Any) -> None:
    """NodeGetVolumeStats stats the volume: on a hard NFS mount whose server is gone that
    blocks for good, and kubelet polls every volume. Each stat is bounded, and a path whose
    stat is still stuck is answered at once, so the plugin's workers stay free."""
    import os
    import time

    from flexhub.csi import node

    release = threading.Event()
    real = os.stat

    def stuck(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) == "/stuck/volume":
            release.wait(30)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(node, "STAT_BOUND", 0.5)
    monkeypatch.setattr(os, "stat", stuck)
    try:
        started = time.monotonic()
        with pytest.raises(CsiError) as first:
            node._bounded_stat("/stuck/volume")
        assert first.value.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 5
        started = time.monotonic()
        with pytest.raises(CsiError, match="did not answer a stat yet"):
            node._bounded_stat("/stuck/volume")  # no second thread on the same path
        assert time.monotonic() - started < 0.5
        _mode, st = node._bounded_stat("/")
        assert st is not None and st.f_blocks > 0
    finally:
        release.set()


def test_an_id_of_a_uids_length_but_not_its_shape_is_no_volume_of_ours() -> None:
    """``loopfile:`` and 36 characters that are no uid: not found (DeleteVolume: done), never
    an INTERNAL error from the records' own path check."""
    assert uid_of_volume("loopfile:../../../../etc/passwd/xxxxxxxxxxxxx") == ""
    assert uid_of_volume("loopfile:" + "Z" * 36) == ""
    assert uid_of_volume("loopfile:" + volume_uid("claim-1")) == volume_uid("claim-1")


def test_a_stale_mount_is_told_from_a_missing_path_by_the_one_bounded_stat(
    monkeypatch: Any,
) -> None:
    import errno
    import os

    from flexhub.csi import node

    real = os.stat

    def stale(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) == "/stale/volume":
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stale)
    with pytest.raises(CsiError, match="stale or broken mount") as found:
        node._bounded_stat("/stale/volume")
    assert found.value.code == grpc.StatusCode.INTERNAL
    with pytest.raises(CsiError) as missing:
        node._bounded_stat("/nonexistent/flexhub-volume")
    assert missing.value.code == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("group", "expected"),
    [("", None), ("0", 0), ("4321", 4321), ("4294967294", 4294967294)]
    + [(bad, "bad") for bad in ("staff", "-1", "+5", " 5", "4294967295", "12345678901", "١٢")],
)
def test_a_mount_group_is_a_decimal_group_id_or_invalid(group: str, expected: Any) -> None:
    from flexhub.csi.proto import csi_pb2 as pb
    from flexhub.csi.volumes import mount_group

    cap = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(volume_mount_group=group))
    if expected == "bad":
        with pytest.raises(CsiError, match="is not a decimal group id") as caught:
            mount_group(cap)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    else:
        assert mount_group(cap) == expected
    assert mount_group(pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume())) is None


def test_an_xfs_copy_mounts_with_nouuid_once_and_keeps_its_options() -> None:
    """The options of a restore or clone: ``nouuid`` added for xfs (whichever of the record's
    or the capabilities' filesystem says so), once, after the class's own mount options."""
    base = {"backend": "loopfile", "file": "provisioned/pvc-1.img"}
    assert copy_options(base, {"", "ext4"}) == base
    assert copy_options(base, {"xfs"}) == {**base, "mountOptions": "nouuid"}
    given = {**base, "mountOptions": "noatime"}
    assert copy_options(given, {"", "xfs"})["mountOptions"] == "noatime,nouuid"
    twice = copy_options(copy_options(given, {"xfs"}), {"xfs"})
    assert twice["mountOptions"] == "noatime,nouuid"
