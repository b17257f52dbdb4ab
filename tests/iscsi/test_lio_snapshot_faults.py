"""iSCSI snapshots, restores and clones when something goes wrong, on the host.

The remote program's parts run for real: fileio directories on a real tmpfs and a real xfs
with ``reflink=1``, and the block backstore's LVs as real loop devices of exactly their LV's
size (``lvcreate`` attaches a new one, ``lvextend`` grows it) behind a recording ``lvm``; the
provisioner's side and the CSI controller with a recording ``ssh``. Each test is the proof of
one fault found in review: the bound of a copy on the CSI path, a restore into a preallocated
volume left sharing its blocks, a failed restore leaving its copy, a block copy's write error
hidden by a ``BufferError``, a killed copy wedging its retries after the source grew, and an
expansion's not yet zeroed range copied into a snapshot or a clone.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flexhub_iscsi import _lio, _lio_files, _lio_lvm, _lio_remote, _lio_snap, _snapshots

from tests.iscsi.test_lio_snapshots import (
    NEW,
    SNAP,
    MiB,
    luns,
    needs_root,
    read,
    with_group,
    xfs,
)
from tests.iscsi.test_provision import BLOCK, UID, Ssh, request_of, secrets

__all__ = ["luns", "xfs"]  # the fixtures, used by name

GiB = 1 << 30
MARK = b"ANOTHER-CLAIMS-DATA-" * 50  # what an earlier claim left on freed extents


# --------------------------------------------------------------------------- loop-device LVs


class Loops:
    """Real loop devices, each over its own image file: made at a size, grown, detached at
    the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.images: dict[str, Path] = {}

    def make(self, size: int, fill: bytes = b"\xee") -> str:
        image = self.tmp_path / f"loop{len(self.images)}.img"
        image.write_bytes((fill * (size // len(fill) + 1))[:size])
        device = subprocess.run(
            ["losetup", "--find", "--show", str(image)],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        self.images[device] = image
        return device

    def grow(self, device: str, size: int, fill: bytes) -> None:
        """The device grown to ``size``, the new range holding ``fill`` (data freed extents
        may hold), as ``lvextend`` leaves an LV before its zeroing."""
        image = self.images[device]
        old = image.stat().st_size
        with open(image, "r+b") as fh:
            fh.seek(old)
            fh.write((fill * ((size - old) // len(fill) + 1))[: size - old])
        subprocess.run(["losetup", "--set-capacity", device], check=True)

    def close(self) -> None:
        for device in self.images:
            subprocess.run(["losetup", "-d", device], check=False)


@pytest.fixture
def loops(tmp_path: Path) -> Iterator[Loops]:
    needs_root()
    made = Loops(tmp_path)
    try:
        yield made
    finally:
        made.close()


class Group:
    """A recording ``lvm`` and ``blkdiscard`` over one volume group (4 MiB extents) whose
    LVs are real loop devices of exactly their size: ``lvcreate`` makes one (holding what
    freed extents may hold), ``lvextend`` grows it."""

    def __init__(self, loops: Loops, size: int = 8 * MiB) -> None:
        self.loops = loops
        first = {
            "size": size,
            "tags": f"flexhub:{UID}",
            "device": loops.make(size, os.urandom(4096)),
        }
        self.lvs: dict[str, dict[str, Any]] = {f"pvc-{UID}": first}
        self.events: list[str] = []

    def lvm(self, step: str, *args: str) -> str:
        self.events.append(" ".join(args[:1]))
        if args[0] == "vgs":
            vg = {"vg_name": "vg_iscsi", "vg_extent_size": str(4 * MiB)}
            return json.dumps({"report": [{"vg": [vg]}]})
        if args[0] == "lvs":
            rows = []
            for lv_name, lv in self.lvs.items():
                rdev = os.stat(lv["device"]).st_rdev
                rows.append({"lv_name": lv_name, "lv_size": str(lv["size"]),
                             "lv_tags": lv["tags"], "lv_attr": "-wi-a-----",
                             "lv_kernel_major": str(os.major(rdev)),
                             "lv_kernel_minor": str(os.minor(rdev))})  # fmt: skip
            return json.dumps({"report": [{"lv": rows}]})
        if args[0] == "lvcreate":
            tags = [args[i + 1] for i, a in enumerate(args) if a == "--addtag"]
            size = int(args[args.index("--extents") + 1]) * 4 * MiB
            self.lvs[args[args.index("--name") + 1]] = {
                "size": size, "tags": ",".join(tags), "device": self.loops.make(size, MARK)}  # fmt: skip
        if args[0] == "lvextend":
            lv = self.lvs[args[-1].split("/")[1]]
            size = int(args[args.index("--extents") + 1]) * 4 * MiB
            self.loops.grow(lv["device"], size, MARK)
            lv["size"] = size
        if args[0] == "lvremove":
            self.lvs.pop(args[-1].split("/")[1])
        if args[0] == "lvchange" and "--deltag" in args:
            lv = self.lvs[args[-1].split("/")[1]]
            drop = args[args.index("--deltag") + 1]
            lv["tags"] = ",".join(t for t in lv["tags"].split(",") if t != drop)
        if args[0] == "lvchange" and "--addtag" in args:
            lv = self.lvs[args[-1].split("/")[1]]
            lv["tags"] += "," + args[args.index("--addtag") + 1]
        return ""

    def zero(self, path: str, offset: int, length: int, shared: bool) -> None:
        self.events.append(f"zero {path} {offset} {length}")
        with open(path, "r+b") as fh:
            fh.seek(offset)
            fh.write(bytes(length))

    def device_of(self, spec: dict[str, Any]) -> str:
        return str(self.lvs[spec["name"]]["device"])


def block_restore(size: int, source: str = SNAP) -> dict[str, Any]:
    new = f"pvc-{NEW}"
    return {"name": new, "backstore": "block", "vg": "vg_iscsi", "size": size,
            "iqn": f"iqn.2003-01.com.example:k8s:{new}",
            "source": {"vg": "vg_iscsi", "name": source}}  # fmt: skip


# --------------------------------------------------------------------------- F1: the bound


def test_csi_snapshot_and_delete_are_bounded_by_the_volumes_real_size(tmp_path: Path) -> None:
    """The controller's volume record keeps the size beside the backend's reclaim record
    (which has none): CreateSnapshot of a 40 GiB block LUN must wait for a 40 GiB copy, and
    DeleteVolume for its zeroing, not the bound of an empty volume."""
    import grpc  # noqa: F401 (the CSI extra)

    from flexhub.config import NodeConfig
    from flexhub.csi.controller import ControllerService
    from flexhub.csi.proto import csi_pb2

    size = 40 * GiB
    runner = Ssh({"ok": {"size": size, "created": True, "how": "copy"}})
    service = ControllerService(NodeConfig(state_dir=tmp_path / "state", backends={"iscsi": {}}),
                                "node-a")  # fmt: skip
    original = service._backend

    def with_runner(name: str) -> Any:
        found = original(name)
        found.node.runner = runner
        return found

    service._backend = with_runner  # type: ignore[method-assign]
    plain = {k: v.reveal() for k, v in secrets().items()}
    mount = csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(),
        access_mode=csi_pb2.VolumeCapability.AccessMode(
            mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
        ),
    )
    volume = service.CreateVolume(
        csi_pb2.CreateVolumeRequest(
            name="big", capacity_range=csi_pb2.CapacityRange(required_bytes=size),
            volume_capabilities=[mount], parameters={"backend": "iscsi", **BLOCK},
            secrets=plain), None,
    ).volume  # fmt: skip
    service.CreateSnapshot(
        csi_pb2.CreateSnapshotRequest(name="snap", source_volume_id=volume.volume_id,
                                      secrets=plain), None,
    )  # fmt: skip
    assert request_of(runner)["action"] == "snapshot"
    assert runner.timeouts[-1] == _snapshots.copy_timeout("block", size)
    assert runner.timeouts[-1] > _snapshots.copy_timeout("block", 0) + 1000
    runner.answer = {"ok": {"deleted": ["logical volume"]}}
    service.DeleteVolume(
        csi_pb2.DeleteVolumeRequest(volume_id=volume.volume_id, secrets=plain), None
    )
    assert request_of(runner)["action"] == "delete"
    assert runner.timeouts[-1] == _lio.CALL_TIMEOUT + _lio.zero_seconds(size)


# --------------------------------------------------------------------------- F3: preallocated


def shared_extents(path: Path) -> bool:
    """Whether any extent of ``path`` is shared (FIEMAP's flag, as ``filefrag`` shows it)."""
    out = subprocess.run(["filefrag", "-v", str(path)], check=True, capture_output=True,
                         text=True).stdout  # fmt: skip
    return "shared" in out


def test_a_restore_into_a_preallocated_lun_owns_its_blocks_on_a_reflink_xfs(xfs: Path) -> None:
    """On a reflink xfs a snapshot is a reflink; a restore into a class with ``sparse:
    false`` must not share the snapshot's blocks (its first write would need new blocks, and
    on a full filesystem fail with ENOSPC): every block its own, allocated; a sparse restore
    still reflinks."""
    name = f"pvc-{UID}"
    data = os.urandom(8 * MiB)
    (xfs / f"{name}.img").write_bytes(data)
    (xfs / f"{name}.img").chmod(0o600)
    spec = {"name": name, "directory": str(xfs), "file": f"{name}.img", "snapshot": SNAP,
            "overcommit": 1.0}  # fmt: skip
    assert _lio_snap.snapshot(spec)["how"] == "reflink"
    new = f"pvc-{NEW}"
    restore = {"name": new, "directory": str(xfs), "file": f"{new}.img", "sparse": False,
               "overcommit": 1.0, "size": 12 * MiB,
               "source": {"directory": str(xfs), "name": SNAP}}  # fmt: skip
    assert _lio_snap.prepare_copy(restore) == (True, "copy")
    path = xfs / f"{new}.img"
    assert path.read_bytes() == data + bytes(4 * MiB)
    assert not shared_extents(path)
    assert path.stat().st_blocks * 512 >= 12 * MiB  # allocated whole
    sparse = {**restore, "name": "pvc-" + NEW[:-1] + "9", "file": "pvc-" + NEW[:-1] + "9.img",
              "sparse": True}  # fmt: skip
    assert _lio_snap.prepare_copy(sparse) == (True, "reflink")
    # the proof in use: the filesystem filled, then every block of the restored LUN rewritten
    filler = xfs / "filler"
    fd = os.open(filler, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        step = 64 * MiB
        while step >= 4096:
            try:
                os.posix_fallocate(fd, os.fstat(fd).st_size, step)
            except OSError:
                step //= 2
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, b"\x5a" * (12 * MiB), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"\x5a" * (12 * MiB)


# --------------------------------------------------------------------------- F4: undo the copy


class FailingLib:
    """rtslib whose storage objects cannot be made (configfs refuses): nothing of the
    claim exists in LIO."""

    class RTSLibNotInCFS(Exception):
        pass

    class RTSLibError(Exception):
        pass

    class tcm:
        class StorageObject:
            @staticmethod
            def so_from_path(path: str) -> Any:
                raise AssertionError(f"no storage object expected: {path}")

    class Root:
        storage_objects: list[Any] = []  # noqa: RUF012

    def RTSRoot(self) -> Any:
        return self.Root()

    def FileIOStorageObject(self, name: str, **made: Any) -> Any:
        if not made:
            raise self.RTSLibNotInCFS(name)
        raise self.RTSLibError(f"cannot make storage object {name}")

    def BlockStorageObject(self, name: str, **made: Any) -> Any:
        if not made:
            raise self.RTSLibNotInCFS(name)
        raise self.RTSLibError(f"cannot make storage object {name}")

    def FabricModule(self, name: str) -> str:
        return name

    def Target(self, fabric: str, iqn: str, mode: str) -> Any:
        raise self.RTSLibNotInCFS(iqn)


def failing_lio(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(_lio_remote, "rts", FailingLib)
    monkeypatch.setattr(_lio_remote, "ensure_pr_dir", lambda: None)
    (tmp_path / "core").mkdir()
    monkeypatch.setattr(_lio_remote, "CORE", str(tmp_path / "core"))


def test_a_restore_that_fails_after_its_copy_removes_the_copy_fileio(
    monkeypatch: pytest.MonkeyPatch, luns: Path, tmp_path: Path
) -> None:
    """The copy is made, then LIO refuses the storage object: the restore's error, and the
    file it copied is gone (a retry would otherwise find a copy and skip it); a file that
    was there before the call is left."""
    failing_lio(monkeypatch, tmp_path)
    name = f"pvc-{UID}"
    (luns / f"{name}.img").write_bytes(os.urandom(2 * MiB))
    _lio_snap.snapshot({"name": name, "directory": str(luns), "file": f"{name}.img",
                        "snapshot": SNAP, "overcommit": 1.0})  # fmt: skip
    new = f"pvc-{NEW}"
    spec = {"name": new, "iqn": f"iqn.2003-01.com.example:k8s:{new}", "directory": str(luns),
            "file": f"{new}.img", "sparse": True, "overcommit": 1.0, "size": 4 * MiB,
            "portals": [], "initiators": [], "chap": None,
            "source": {"directory": str(luns), "name": SNAP}}  # fmt: skip
    with pytest.raises(FailingLib.RTSLibError, match="cannot make storage object"):
        _lio_remote.restore(spec)
    assert sorted(p.name for p in luns.iterdir()) == sorted([f"{name}.img", f"{SNAP}.img"])
    # a retry's copy found made before this call: not this call's to remove
    (luns / f"{new}.img").write_bytes(b"\x01" * (4 * MiB))
    (luns / f"{new}.img").chmod(0o600)
    with pytest.raises(FailingLib.RTSLibError):
        _lio_remote.restore(spec)
    assert (luns / f"{new}.img").read_bytes() == b"\x01" * (4 * MiB)


def test_a_restore_that_fails_after_its_copy_removes_the_copy_block(
    monkeypatch: pytest.MonkeyPatch, loops: Loops, tmp_path: Path
) -> None:
    """The LV copy is made, then LIO refuses the storage object: the LV is zeroed (it holds
    the snapshot's data) and removed; an LV that was whole before the call is left."""
    group = Group(loops)
    with_group(monkeypatch, group)
    failing_lio(monkeypatch, tmp_path)
    _lio_snap.snapshot({"name": f"pvc-{UID}", "backstore": "block", "vg": "vg_iscsi",
                        "snapshot": SNAP})  # fmt: skip
    spec = {**block_restore(8 * MiB), "portals": [], "initiators": [], "chap": None}
    with pytest.raises(FailingLib.RTSLibError, match="cannot make storage object"):
        _lio_remote.restore(spec)
    new = f"pvc-{NEW}"
    assert new not in group.lvs
    device = [e for e in group.events if e.startswith("zero ")][-1].split()[1]
    assert group.events.index(f"zero {device} 0 {8 * MiB}") < group.events.index("lvremove")
    assert read(device) == bytes(8 * MiB)
    _lio_snap.prepare_copy(spec)  # whole, as a call killed after its copy left it
    with pytest.raises(FailingLib.RTSLibError):
        _lio_remote.restore(spec)
    assert new in group.lvs


# --------------------------------------------------------------------------- F5: write errors


def test_a_block_copy_whose_writes_fail_is_one_clear_error(loops: Loops) -> None:
    """The destination ends (ENOSPC) or refuses writes: one line naming the copy and the
    cause, never a BufferError from the buffer released while a view of it lives."""
    source = loops.make(8 * MiB, os.urandom(4096))
    small = loops.make(4 * MiB)
    with pytest.raises(_lio_remote.Refused, match=r"^copy .* onto .*: No space left") as info:
        _lio_files.copy_device(source, small, 8 * MiB)
    assert "\n" not in str(info.value)
    assert not isinstance(info.value.__context__, BufferError)
    stuck = loops.make(8 * MiB)
    subprocess.run(["blockdev", "--setro", stuck], check=True)
    try:  # the flag outlives the loop device's detach: set back for the next user
        with pytest.raises(_lio_remote.Refused, match=r"^copy .* onto "):
            _lio_files.copy_device(source, stuck, 8 * MiB)
    finally:
        subprocess.run(["blockdev", "--setrw", stuck], check=True)


# --------------------------------------------------------------------------- F6: killed copies


def test_a_killed_snapshot_copy_then_an_expansion_does_not_wedge_the_retry(
    monkeypatch: pytest.MonkeyPatch, loops: Loops
) -> None:
    """A call killed midway left the snapshot LV tagged flexhub-copying at the LUN's old
    size; the LUN is then grown. The retry copies again from scratch over what the killed
    call made, at the size needed now, and the snapshot holds the grown LUN's bytes."""
    group = Group(loops)
    with_group(monkeypatch, group)
    source = group.lvs[f"pvc-{UID}"]
    group.lvm("", "lvcreate", "--extents", "2", "--name", SNAP, "--addtag",
              f"flexhub-snapshot:{SNAP[5:]}", "--addtag", _lio_snap.COPYING_TAG)  # fmt: skip
    with open(group.lvs[SNAP]["device"], "r+b") as fh:
        fh.write(b"PARTIAL" * 1000)  # then killed
    loops.grow(source["device"], 12 * MiB, b"\x42")  # an expansion, zeroed and done
    source["size"] = 12 * MiB
    data = read(source["device"], 12 * MiB)
    spec = {"name": f"pvc-{UID}", "backstore": "block", "vg": "vg_iscsi", "snapshot": SNAP}
    assert _lio_snap.snapshot(spec) == {"size": 12 * MiB, "how": "copy"}
    assert read(group.lvs[SNAP]["device"], 12 * MiB) == data
    assert _lio_snap.COPYING_TAG not in group.lvs[SNAP]["tags"]
    assert _lio_snap.snapshot(spec) == {"size": 12 * MiB, "how": "exists"}


def test_a_killed_restore_copy_retried_for_a_larger_claim_converges(
    monkeypatch: pytest.MonkeyPatch, loops: Loops
) -> None:
    """A restore killed midway left the claim's LV tagged flexhub-copying; the retry asks
    for a larger claim (CreateVolume again with a larger capacity): the LV is made whole at
    that size, not left at the killed call's."""
    group = Group(loops)
    with_group(monkeypatch, group)
    spec = {"name": f"pvc-{UID}", "backstore": "block", "vg": "vg_iscsi", "snapshot": SNAP}
    _lio_snap.snapshot(spec)
    data = read(group.lvs[SNAP]["device"])
    new = f"pvc-{NEW}"
    group.lvm("", "lvcreate", "--extents", "2", "--name", new, "--addtag", f"flexhub:{NEW}",
              "--addtag", _lio_snap.COPYING_TAG)  # fmt: skip
    assert _lio_snap.prepare_copy(block_restore(16 * MiB)) == (True, "copy")
    lv = group.lvs[new]
    assert lv["size"] == 16 * MiB and _lio_snap.COPYING_TAG not in lv["tags"]
    assert read(lv["device"]) == data


# --------------------------------------------------------------------------- F7: pending zeroes


def test_an_expansions_unzeroed_range_never_reaches_a_snapshot_or_a_clone(
    monkeypatch: pytest.MonkeyPatch, loops: Loops
) -> None:
    """The LUN was grown from 8 to 12 MiB and its new range is not zeroed yet (the
    expansion's tag names where it begins): those bytes were never the LUN's (an earlier
    claim's, here a marker). A snapshot and a clone read them as zeros; the LUN's own
    pending range is left for its expansion's retry."""
    group = Group(loops)
    with_group(monkeypatch, group)
    source = group.lvs[f"pvc-{UID}"]
    data = read(source["device"])
    loops.grow(source["device"], 12 * MiB, MARK)
    source["size"] = 12 * MiB
    source["tags"] += f",{_lio_lvm.ZERO_TAG}{8 * MiB}"
    spec = {"name": f"pvc-{UID}", "backstore": "block", "vg": "vg_iscsi", "snapshot": SNAP}
    assert _lio_snap.snapshot(spec) == {"size": 12 * MiB, "how": "copy"}
    snap = read(group.lvs[SNAP]["device"], 12 * MiB)
    assert MARK[:20] not in snap and snap == data + bytes(4 * MiB)
    assert _lio_snap.prepare_copy(block_restore(16 * MiB, f"pvc-{UID}")) == (True, "copy")
    clone = read(group.lvs[f"pvc-{NEW}"]["device"], 12 * MiB)
    assert MARK[:20] not in clone and clone == data + bytes(4 * MiB)
    assert read(source["device"], 12 * MiB)[8 * MiB :].startswith(MARK)  # not the copy's to zero


# --------------------------------------------------------------------------- S1: the lock's wait


def test_a_call_that_cannot_take_the_lock_in_time_does_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    """Another call holds the target host's lock (a long copy). The provisioner's ssh gives up
    at its bound, but the remote program goes on (no terminal: no hangup): waiting without
    end, it would run its request whenever the lock came free, long after its caller gave up
    (a provision no claim wants any more, a pile of stale copies). It waits only as long as
    the request says (the call's bound less a margin for the connection and the work), then
    answers a one-line refusal and does nothing."""
    import fcntl
    import threading

    from tests.iscsi.test_provision import PARAMS, backend, claim

    lock = tmp_path / "lock"
    monkeypatch.setattr(_lio_remote, "LOCK", str(lock))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    ran: list[Any] = []
    monkeypatch.setitem(_lio_remote.ACTIONS, "provision", lambda spec: ran.append(spec) or {})
    holder = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    codes: list[Any] = []

    def call() -> None:
        try:
            _lio_remote.main({"action": "provision", "spec": {}, "wait": 0.5})
        except SystemExit as exc:
            codes.append(exc.code)
        else:
            codes.append(0)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(10)
    try:
        assert not thread.is_alive(), "the remote program waits for the lock without end"
    finally:
        os.close(holder)  # the lock free again
        thread.join(10)
    assert codes == [3] and ran == []
    line = capsys.readouterr().out.strip()
    answer = json.loads(line[len(_lio_remote.MARK) :])
    assert "\n" not in answer["error"] and "lock" in answer["error"]
    assert "nothing done" in answer["error"]

    runner = Ssh()  # the provisioner's request says how long
    backend(runner, tmp_path).provision(claim(), PARAMS, secrets())
    assert request_of(runner)["wait"] == pytest.approx(_lio.CALL_TIMEOUT - _lio.LOCK_MARGIN, abs=1)


# --------------------------------------------------------------------------- S2: the path's trust


def test_a_lun_directory_under_a_directory_others_can_write_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The LUN directory is root's and no one else's, but a directory above it is writable
    by others (not sticky): they can rename it away and put their own in its place between
    the checks and the copy's open by path, and the snapshot of a claim's data lands in a
    directory they own. Every directory up to / must be root's, writable by no one else
    (or sticky, as /tmp): refused before anything is copied."""
    needs_root()
    name = f"pvc-{UID}"
    open_dir = tmp_path / "shared"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # root's, writable by anyone, not sticky
    directory = open_dir / "luns"
    directory.mkdir(mode=0o755)
    (directory / f"{name}.img").write_bytes(os.urandom(MiB))
    (directory / f"{name}.img").chmod(0o600)
    theirs = open_dir / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    real = _lio_snap.open_source

    def swapped(*args: Any) -> int:  # what anyone may do in between: rename and replace
        fd = real(*args)
        directory.rename(open_dir / "luns.old")
        directory.symlink_to(theirs)
        return fd

    monkeypatch.setattr(_lio_snap, "open_source", swapped)
    spec = {"name": name, "directory": str(directory), "file": f"{name}.img",
            "snapshot": SNAP, "overcommit": 1.0}  # fmt: skip
    try:
        with pytest.raises(_lio_remote.Refused, match=r"writable by no one else"):
            _lio_snap.snapshot(spec)
        assert list(theirs.iterdir()) == []
        with pytest.raises(_lio_remote.Refused, match=r"writable by no one else"):
            _lio_files.check_directory(str(directory))
    finally:
        if directory.is_symlink():
            directory.unlink()
            (open_dir / "luns.old").rename(directory)
    open_dir.chmod(0o1777)  # sticky, as /tmp: others cannot rename what is not theirs
    _lio_files.check_directory(str(directory))


def test_a_snapshot_of_a_preallocated_lun_leaves_the_lun_owning_its_blocks(
    xfs: Path, tmp_path: Path
) -> None:
    """A reflink snapshot shares the LUN's blocks too: a preallocated (``sparse: "false"``)
    LUN would then need new blocks at its next writes, which a full filesystem refuses, the
    very thing its class promised could not happen. Its snapshot is a full copy; a sparse
    LUN's is still a reflink. The provisioner says which in the request."""
    from tests.iscsi.test_provision import PARAMS, backend, claim

    runner = Ssh({"ok": {"size": 64 * MiB, "created": True}})
    made = backend(runner, tmp_path).provision(claim(), {**PARAMS, "sparse": "false"}, secrets())
    runner.answer = {"ok": {"size": 64 * MiB, "how": "copy"}}
    backend(runner, tmp_path).snapshot(made.options, made.reclaim, SNAP, "default", secrets())
    assert request_of(runner)["spec"]["sparse"] is False

    name = f"pvc-{UID}"
    path = xfs / f"{name}.img"
    data = os.urandom(8 * MiB)
    path.write_bytes(data)
    path.chmod(0o600)
    spec = {"name": name, "directory": str(xfs), "file": f"{name}.img", "snapshot": SNAP,
            "overcommit": 1.0, "sparse": False}  # fmt: skip
    assert _lio_snap.snapshot(spec)["how"] == "copy"
    assert not shared_extents(path)
    assert (xfs / f"{SNAP}.img").read_bytes() == data
    other = SNAP[:-1] + "9"
    assert _lio_snap.snapshot({**spec, "snapshot": other, "sparse": True})["how"] == "reflink"
