"""iSCSI snapshots, restores and clones on the host.

The provisioner's side with a recording ``ssh`` (what each call sends, its bound, the record
kept, refusals that send nothing), and the remote program's parts run for real on the host:
a fileio directory on a real tmpfs (a full copy keeping holes) and on a real xfs with
``reflink=1`` (a reflink), and the block backstore's copies between real loop devices
(``O_DIRECT``) with a recording ``lvm`` (no LVM on the host). The real target is
``tests/vm/test_iscsi_snapshots.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flexhub_iscsi import _lio, _lio_files, _lio_lvm, _lio_remote, _lio_room, _lio_snap, _snapshots

from flexhub.errors import InvalidOptions
from flexhub.provisioning import Claim
from tests.iscsi.test_provision import (
    BLOCK,
    KEY,
    PARAMS,
    PASSWORD,
    UID,
    Ssh,
    backend,
    claim,
    request_of,
    secrets,
)

MiB = 1 << 20
SNAP = "snap-5a0c2b9e-1f3d-5e7a-8b4c-6d2e0f1a3b5c"
NEW = "7c1e9d2a-3b4f-4a5e-8d6c-0f1e2d3c4b5a"


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the LUN directory must be root's")


def provisioned(params: dict[str, str], tmp_path: Path) -> Any:
    return backend(Ssh({"ok": {"size": 64 * MiB, "created": True}}), tmp_path).provision(
        claim(), params, secrets()
    )


# --------------------------------------------------------------------------- provisioner's side


@pytest.mark.parametrize("params", [PARAMS, BLOCK], ids=["fileio", "block"])
def test_snapshot_sends_the_claims_store_and_keeps_a_record_without_secrets(
    tmp_path: Path, params: dict[str, str]
) -> None:
    made = provisioned(params, tmp_path)
    runner = Ssh({"ok": {"size": 64 * MiB, "how": "reflink"}})
    iscsi = backend(runner, tmp_path)
    assert type(iscsi).snapshots is True
    reclaim = {**made.reclaim, "size": str(64 * MiB)}
    record = iscsi.snapshot(made.options, reclaim, SNAP, "default", secrets())
    request = request_of(runner)
    assert request["action"] == "snapshot"
    name = f"pvc-{UID}"
    if params is BLOCK:
        assert request["spec"] == {"name": name, "backstore": "block", "vg": "vg_iscsi",
                                   "snapshot": SNAP}  # fmt: skip
        assert runner.timeouts == [_lio.CALL_TIMEOUT + 2 * _lio.zero_seconds(64 * MiB)]
    else:
        assert request["spec"] == {"name": name, "directory": "/srv/iscsi",
                                   "file": f"{name}.img", "snapshot": SNAP, "overcommit": 1.0,
                                   "sparse": True}  # fmt: skip
        assert runner.timeouts == [_lio.CALL_TIMEOUT + _lio.zero_seconds(64 * MiB)]
    where = {"volumeGroup": "vg_iscsi"} if params is BLOCK else {"fileioDirectory": "/srv/iscsi"}
    assert record == {
        "targetHost": "10.0.0.5", "sshUser": "root", "sshPort": "2222",
        "backstore": made.reclaim["backstore"], "snapshot": SNAP, "claimUid": UID,
        "size": str(64 * MiB), "how": "reflink", **where,
    }  # fmt: skip
    text = json.dumps(record) + " ".join(" ".join(a) for a in runner.raw)
    for secret in (PASSWORD, "fakekeybody", "chap-user"):
        assert secret not in text
    assert "chap" not in request["spec"]  # a snapshot call carries no CHAP

    runner.answer = {"ok": {"deleted": [SNAP]}}
    iscsi.delete_snapshot(record, secrets())
    request = request_of(runner)
    assert request["action"] == "delete_snapshot"
    if params is BLOCK:
        assert request["spec"] == {"backstore": "block", "vg": "vg_iscsi", "snapshot": SNAP}
        assert runner.timeouts[-1] == _lio.CALL_TIMEOUT + _lio.zero_seconds(64 * MiB)
    else:
        assert request["spec"] == {"directory": "/srv/iscsi", "snapshot": SNAP}
        assert runner.timeouts[-1] == _lio.CALL_TIMEOUT


@pytest.mark.parametrize("params", [PARAMS, BLOCK], ids=["fileio", "block"])
def test_restore_and_clone_provision_a_new_lun_from_the_copy(
    tmp_path: Path, params: dict[str, str]
) -> None:
    """The same request as provision (CHAP, ACLs, portals), plus the source: the snapshot's
    file or LV, or the source LUN's where the class keeps its LUNs; the PV as provision's."""
    made = provisioned(params, tmp_path)
    record = backend(Ssh({"ok": {"size": 64 * MiB, "how": "copy"}}), tmp_path).snapshot(
        made.options, made.reclaim, SNAP, "default", secrets()
    )
    runner = Ssh({"ok": {"size": 96 * MiB, "created": False, "how": "copy"}})
    iscsi = backend(runner, tmp_path)
    new = Claim(uid=NEW, namespace="default", name="restored", size=96 * MiB)
    restored = iscsi.restore(new, params, record, secrets())
    request = request_of(runner)
    assert request["action"] == "restore"
    plain = backend(Ssh({"ok": {"size": 96 * MiB}}), tmp_path)
    fresh = plain.provision(new, params, secrets())
    assert restored.options == fresh.options and restored.reclaim == fresh.reclaim
    assert restored.size == 96 * MiB and restored.secret == ("flexhub", "iscsi-chap")
    sent = dict(request["spec"])
    source = sent.pop("source")
    assert sent == request_of(plain.node.runner)["spec"]  # type: ignore[arg-type]
    assert sent["chap"] and sent["name"] == f"pvc-{NEW}"
    assert runner.stdin is not None and PASSWORD in runner.stdin  # on stdin only
    assert PASSWORD not in " ".join(" ".join(a) for a in runner.raw)
    if params is BLOCK:
        assert source == {"vg": "vg_iscsi", "name": SNAP}
    else:
        assert source == {"directory": "/srv/iscsi", "name": SNAP}

    cloned = iscsi.clone(new, params, {**made.options, "backend": "iscsi"}, "default", secrets())
    assert cloned.options == fresh.options
    source = request_of(runner)["spec"]["source"]
    where = {"vg": "vg_iscsi"} if params is BLOCK else {"directory": "/srv/iscsi"}
    assert source == {"name": f"pvc-{UID}", **where}
    assert runner.timeouts[-1] == _snapshots.copy_timeout(made.reclaim["backstore"], 96 * MiB)


def test_bad_snapshot_records_classes_and_sources_are_one_line_and_send_nothing(
    tmp_path: Path,
) -> None:
    made = provisioned(PARAMS, tmp_path)
    record = backend(Ssh({"ok": {"size": 64 * MiB, "how": "copy"}}), tmp_path).snapshot(
        made.options, made.reclaim, SNAP, "default", secrets()
    )
    runner = Ssh()
    iscsi = backend(runner, tmp_path)
    new = Claim(uid=NEW, namespace="default", name="restored", size=64 * MiB)
    bad_records = [
        ({**record, "fileioDirectory": "/srv/../etc"}, "fileioDirectory"),
        ({**record, "snapshot": f"pvc-{UID}"}, "snap-<uid>"),
        ({**record, "snapshot": "snap-../../x"}, "snap-<uid>"),
        ({**record, "targetHost": "-oProxyCommand=x"}, "targetHost"),
        ({**record, "backstore": "ramdisk"}, "backstore"),
        ({**record, "backstore": "block", "volumeGroup": "-vg"}, "volumeGroup"),
    ]
    for bad, why in bad_records:
        for call in (
            lambda r: iscsi.restore(new, PARAMS, r, secrets()),
            lambda r: iscsi.delete_snapshot(r, secrets()),
        ):
            with pytest.raises(InvalidOptions, match=why.replace("<", ".").replace(">", ".")):
                call(bad)
    with pytest.raises(InvalidOptions, match=r"target host 10\.0\.0\.5:2222"):
        iscsi.restore(new, {**PARAMS, "targetHost": "10.0.0.6"}, record, secrets())
    with pytest.raises(InvalidOptions, match="backstore fileio"):
        iscsi.restore(new, BLOCK, record, secrets())
    with pytest.raises(InvalidOptions, match="snap-<uid>"):
        iscsi.snapshot(made.options, made.reclaim, "snap-x", "default", secrets())
    for options in (
        {**made.options, "iqn": "iqn.2003-01.com.example:k8s:../pvc-x"},
        {**made.options, "iqn": made.options["iqn"].replace("pvc-", "snap-")},
        {**made.options, "lun": "1"},
    ):
        with pytest.raises(InvalidOptions, match="source volume"):
            iscsi.clone(new, PARAMS, options, "default", secrets())
    with pytest.raises(InvalidOptions, match="initiators"):  # provision's rules hold
        iscsi.restore(
            new,
            {k: v for k, v in PARAMS.items() if not k.startswith(("initiators", "nodeSecret"))},
            record,
            secrets(chap=False),
        )
    assert runner.calls == []
    for key, value in record.items():
        assert KEY not in value and PASSWORD not in value, key


def test_the_csi_controller_serves_iscsi_snapshots(tmp_path: Path) -> None:
    """The controller routes CreateSnapshot, CreateVolume from a snapshot and from a volume,
    and DeleteSnapshot of an iSCSI volume to this backend (not INVALID_ARGUMENT)."""
    import grpc  # noqa: F401 (the CSI extra)

    from flexhub.config import NodeConfig
    from flexhub.csi.controller import ControllerService
    from flexhub.csi.proto import csi_pb2

    runner = Ssh({"ok": {"size": 64 * MiB, "created": True, "how": "copy"}})
    config = NodeConfig(state_dir=tmp_path / "state", backends={"iscsi": {}})
    service = ControllerService(config, "node-a")
    original = service._backend

    def with_runner(name: str) -> Any:
        found = original(name)
        found.node.runner = runner
        return found

    service._backend = with_runner  # type: ignore[method-assign]
    caps = service.ControllerGetCapabilities(csi_pb2.ControllerGetCapabilitiesRequest(), None)
    kinds = {c.rpc.type for c in caps.capabilities}
    rpc = csi_pb2.ControllerServiceCapability.RPC.Type
    assert {rpc.CREATE_DELETE_SNAPSHOT, rpc.LIST_SNAPSHOTS, rpc.CLONE_VOLUME} <= kinds
    plain = {k: v.reveal() for k, v in secrets().items()}
    mount = csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(),
        access_mode=csi_pb2.VolumeCapability.AccessMode(
            mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
        ),
    )
    parameters = {"backend": "iscsi", **PARAMS}
    size = csi_pb2.CapacityRange(required_bytes=64 * MiB)
    volume = service.CreateVolume(
        csi_pb2.CreateVolumeRequest(name="vol", capacity_range=size, volume_capabilities=[mount],
                                    parameters=parameters, secrets=plain), None,
    ).volume  # fmt: skip
    snap = service.CreateSnapshot(
        csi_pb2.CreateSnapshotRequest(name="snap", source_volume_id=volume.volume_id,
                                      secrets=plain), None,
    ).snapshot  # fmt: skip
    assert snap.snapshot_id.startswith("iscsi:snapshot:") and snap.size_bytes == 64 * MiB
    assert request_of(runner)["action"] == "snapshot"
    for source in (
        csi_pb2.VolumeContentSource(
            snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=snap.snapshot_id)
        ),
        csi_pb2.VolumeContentSource(
            volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=volume.volume_id)
        ),
    ):
        made = service.CreateVolume(
            csi_pb2.CreateVolumeRequest(
                name=f"from-{source.WhichOneof('type')}", capacity_range=size,
                volume_capabilities=[mount], parameters=parameters, secrets=plain,
                volume_content_source=source), None,
        ).volume  # fmt: skip
        assert made.content_source == source
        spec = request_of(runner)["spec"]
        assert request_of(runner)["action"] == "restore"
        assert spec["source"]["name"] in (f"snap-{snap.snapshot_id.rsplit(':', 1)[1]}",
                                          f"pvc-{volume.volume_id.rsplit(':', 1)[1]}")  # fmt: skip
    runner.answer = {"ok": {"deleted": []}}
    service.DeleteSnapshot(
        csi_pb2.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id, secrets=plain), None
    )
    assert request_of(runner)["action"] == "delete_snapshot"
    records = list((tmp_path / "state").rglob("*.json"))
    assert records and all(PASSWORD not in p.read_text() for p in records)


# --------------------------------------------------------------------------- the target host


@pytest.fixture
def luns(tmp_path: Path) -> Iterator[Path]:
    """A root-only LUN directory on its own tmpfs of 64 MiB."""
    needs_root()
    directory = tmp_path / "luns"
    directory.mkdir(mode=0o755)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "tmpfs", str(directory)],
                   check=True)  # fmt: skip
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=False)


@pytest.fixture
def xfs(tmp_path: Path) -> Iterator[Path]:
    """A root-only LUN directory on a real xfs with reflink=1 (4096-byte sectors)."""
    needs_root()
    image = tmp_path / "xfs.img"
    image.write_bytes(b"")
    os.truncate(image, 320 * MiB)
    device = subprocess.run(
        ["losetup", "-f", "--show", "--sector-size", "4096", str(image)],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    directory = tmp_path / "xfs"
    directory.mkdir(mode=0o755)
    try:
        subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", device], check=True)
        subprocess.run(["mount", device, str(directory)], check=True)
        try:
            directory.chmod(0o755)
            yield directory
        finally:
            subprocess.run(["umount", str(directory)], check=False)
    finally:
        subprocess.run(["losetup", "-d", device], check=False)


def lun_file(directory: Path, name: str, size: int) -> bytes:
    """A sparse LUN file with data at 1 MiB and 5 MiB (as a filesystem would write)."""
    path = directory / f"{name}.img"
    with open(path, "wb") as fh:
        fh.truncate(size)
        fh.seek(MiB)
        fh.write(b"FIRST-" * 1000)
        fh.seek(5 * MiB)
        fh.write(os.urandom(64 * 1024))
    path.chmod(0o600)
    return path.read_bytes()


@pytest.mark.parametrize("where", ["luns", "xfs"])
def test_remote_fileio_snapshot_restore_and_delete_on_real_filesystems(
    where: str, request: pytest.FixtureRequest
) -> None:
    """A snapshot of a LUN file is its bytes (a reflink on xfs, a copy keeping holes on
    tmpfs), atomic under its name and idempotent; a restore's file is the snapshot's bytes
    grown to the claim's size; deleting it twice is success."""
    directory: Path = request.getfixturevalue(where)
    name = f"pvc-{UID}"
    data = lun_file(directory, name, 8 * MiB)
    spec = {"name": name, "directory": str(directory), "file": f"{name}.img",
            "snapshot": SNAP, "overcommit": 1.0}  # fmt: skip
    done = _lio_snap.snapshot(spec)
    assert done == {"size": 8 * MiB, "how": "reflink" if where == "xfs" else "copy"}
    snap = directory / f"{SNAP}.img"
    assert snap.read_bytes() == data
    assert snap.stat().st_mode & 0o777 == 0o600
    if where == "luns":
        assert snap.stat().st_blocks * 512 < 2 * MiB  # the holes kept
    assert _lio_snap.snapshot(spec) == {"size": 8 * MiB, "how": "exists"}
    assert sorted(p.name for p in directory.iterdir()) == sorted([f"{name}.img", f"{SNAP}.img"])

    new = f"pvc-{NEW}"
    restore = {"name": new, "directory": str(directory), "file": f"{new}.img", "sparse": True,
               "overcommit": 1.0, "size": 12 * MiB,
               "source": {"directory": str(directory), "name": SNAP}}  # fmt: skip
    assert _lio_snap.prepare_copy(restore) == (True, "reflink" if where == "xfs" else "copy")
    restored = (directory / f"{new}.img").read_bytes()
    assert restored[: 8 * MiB] == data and restored[8 * MiB :] == bytes(4 * MiB)
    assert _lio_snap.prepare_copy(restore) == (False, "exists")  # a retry: provision's turn
    small = {**restore, "name": "pvc-" + UID[:-1] + "9", "file": "pvc-" + UID[:-1] + "9.img",
             "size": 4 * MiB}  # fmt: skip
    with pytest.raises(_lio_remote.Refused, match="more than the claim's"):
        _lio_snap.prepare_copy(small)
    with pytest.raises(_lio_remote.Refused, match="does not exist"):
        _lio_snap.prepare_copy({**small, "size": 8 * MiB, "source": {
            "directory": str(directory), "name": SNAP.replace("5a", "5b")}})  # fmt: skip
    assert not (directory / small["file"]).exists()

    gone = {"directory": str(directory), "snapshot": SNAP}
    assert _lio_snap.delete_snapshot(gone) == {"deleted": [SNAP]}
    assert _lio_snap.delete_snapshot(gone) == {"deleted": []}
    assert not snap.exists() and (directory / f"{name}.img").read_bytes() == data


def test_remote_snapshot_counts_in_the_room_and_a_refusal_leaves_nothing(luns: Path) -> None:
    """A 40 MiB LUN file full of data on a 64 MiB tmpfs: its copy would promise 80 MiB of
    what holds 64 MiB: NoRoomLeft, nothing made; snapshots count as LUN files do."""
    name = f"pvc-{UID}"
    path = luns / f"{name}.img"
    path.write_bytes(b"\x5a" * (40 * MiB))
    spec = {"name": name, "directory": str(luns), "file": f"{name}.img", "snapshot": SNAP,
            "overcommit": 1.0}  # fmt: skip
    with pytest.raises(_lio_remote.NoRoomLeft, match="not enough room"):
        _lio_snap.snapshot(spec)
    assert [p.name for p in luns.iterdir()] == [f"{name}.img"]
    # with overcommit the promise passes, and the full tmpfs is the refusal: nothing left
    with pytest.raises(_lio_remote.NoRoomLeft, match="not enough room"):
        _lio_snap.snapshot({**spec, "overcommit": 4.0})
    assert [p.name for p in luns.iterdir()] == [f"{name}.img"]
    path.unlink()
    path.write_bytes(b"\x5a" * (8 * MiB))
    _lio_snap.snapshot(spec)
    assert _lio_files.file_size(str(luns), f"{SNAP}.img") == 8 * MiB
    promised, _, _ = _lio_room.measure(str(luns), None)
    assert promised == 16 * MiB  # the snapshot is counted


def test_remote_delete_snapshot_refuses_what_is_not_a_plain_file(luns: Path) -> None:
    (luns / f"{SNAP}.img").symlink_to("/etc/passwd")
    with pytest.raises(_lio_remote.Refused, match="plain file"):
        _lio_snap.delete_snapshot({"directory": str(luns), "snapshot": SNAP})
    assert (luns / f"{SNAP}.img").is_symlink()


# --------------------------------------------------------------------------- block, recorded lvm


@pytest.fixture
def loops(tmp_path: Path) -> Iterator[list[str]]:
    """Three real 8 MiB loop devices: the claim's LV (random bytes), then two free ones."""
    needs_root()
    devices = []
    try:
        for i in range(3):
            image = tmp_path / f"lv{i}.img"
            image.write_bytes(os.urandom(8 * MiB) if i == 0 else b"\xee" * (8 * MiB))
            devices.append(subprocess.run(
                ["losetup", "--find", "--show", str(image)],
                check=True, capture_output=True, text=True,
            ).stdout.strip())  # fmt: skip
        yield devices
    finally:
        for device in devices:
            subprocess.run(["losetup", "-d", device], check=False)


class Group:
    """A recording stand-in for ``lvm`` and ``blkdiscard`` over one volume group whose LVs
    are real loop devices (``lvcreate`` takes the next free one)."""

    def __init__(self, loops: list[str]) -> None:
        self.free = loops[1:]
        name = f"pvc-{UID}"
        self.lvs: dict[str, dict[str, Any]] = {
            name: {"size": 8 * MiB, "tags": f"flexhub:{UID}", "device": loops[0]}
        }
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
                "size": size, "tags": ",".join(tags), "device": self.free.pop(0)}  # fmt: skip
        if args[0] == "lvremove":
            lv = self.lvs.pop(args[-1].split("/")[1])
            self.free.append(lv["device"])
        if args[0] == "lvchange" and "--deltag" in args:
            lv = self.lvs[args[-1].split("/")[1]]
            drop = args[args.index("--deltag") + 1]
            lv["tags"] = ",".join(t for t in lv["tags"].split(",") if t != drop)
        return ""

    def zero(self, path: str, offset: int, length: int, shared: bool) -> None:
        self.events.append(f"zero {path} {offset} {length}")
        with open(path, "r+b") as fh:
            fh.seek(offset)
            fh.write(bytes(length))

    def device_of(self, spec: dict[str, Any]) -> str:
        return str(self.lvs[spec["name"]]["device"])


def with_group(monkeypatch: pytest.MonkeyPatch, group: Group) -> None:
    for module in (_lio_snap, _lio_lvm, _lio_remote):  # one namespace when sent
        for name in ("lvm", "zero", "device_of"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(group, name))


def read(device: str, length: int = 8 * MiB) -> bytes:
    fd = os.open(device, os.O_RDONLY | os.O_DIRECT)
    try:
        import mmap

        buffer = mmap.mmap(-1, length)
        os.preadv(fd, [buffer], 0)
        return bytes(buffer)
    finally:
        os.close(fd)


def test_remote_block_snapshot_is_a_whole_copy_in_a_tagged_lv(
    monkeypatch: pytest.MonkeyPatch, loops: list[str], tmp_path: Path
) -> None:
    """The snapshot LV (same extents, tagged flexhub-snapshot:<uid>) holds the LV's bytes,
    read and written with O_DIRECT; it is marked whole only after the copy; asked again it
    is found; a restore's LV is a copy of it, provisioned with copied=True; deleting the
    snapshot zeroes it whole before lvremove, and again is success."""
    group = Group(loops)
    with_group(monkeypatch, group)
    data = read(loops[0])
    spec = {"name": f"pvc-{UID}", "backstore": "block", "vg": "vg_iscsi", "snapshot": SNAP}
    assert _lio_snap.snapshot(spec) == {"size": 8 * MiB, "how": "copy"}
    snap = group.lvs[SNAP]
    assert snap["tags"] == f"flexhub-snapshot:{SNAP[5:]}" and snap["size"] == 8 * MiB
    assert read(snap["device"]) == data
    created = group.events.index("lvcreate")
    assert group.events.index("lvchange") > created  # the copying tag dropped after
    assert _lio_snap.snapshot(spec) == {"size": 8 * MiB, "how": "exists"}

    provisioned: list[bool] = []

    class Lib:  # rtslib: the claim's storage object is looked up in configfs (CORE) only
        class RTSLibNotInCFS(Exception):
            pass

        class tcm:
            class StorageObject:
                @staticmethod
                def so_from_path(path: str) -> Any:
                    return type("SO", (), {"plugin": "fileio", "udev_path": "/srv/x.img",
                                           "name": path.rsplit("/", 1)[1]})()  # fmt: skip

        def RTSRoot(self) -> None:
            return None

    core = tmp_path / "core"
    core.mkdir()
    monkeypatch.setattr(_lio_remote, "rts", Lib)
    monkeypatch.setattr(_lio_remote, "CORE", str(core))
    monkeypatch.setattr(
        _lio_remote, "provision",
        lambda s, copied=False: provisioned.append(copied) or {"size": 8 * MiB, "created": False},
    )  # fmt: skip
    new = f"pvc-{NEW}"
    restore = {"name": new, "backstore": "block", "vg": "vg_iscsi", "size": 8 * MiB,
               "iqn": f"iqn.2003-01.com.example:k8s:{new}",
               "source": {"vg": "vg_iscsi", "name": SNAP}}  # fmt: skip
    assert _lio_remote.restore(restore) == {"size": 8 * MiB, "created": False, "how": "copy"}
    assert group.lvs[new]["tags"] == f"flexhub:{NEW}" and read(group.lvs[new]["device"]) == data
    assert _lio_remote.restore(restore)["how"] == "exists"
    assert provisioned == [True, False]
    # a storage object of the claim's name on something else: refused before any copy
    other = f"pvc-{NEW[:-1]}0"
    (core / "fileio_3" / other).mkdir(parents=True)
    group.events.clear()
    with pytest.raises(_lio_remote.Refused, match="another backing store"):
        _lio_remote.restore({**restore, "name": other})
    assert (
        other not in group.lvs and "lvcreate" not in group.events and provisioned == [True, False]
    )

    device = snap["device"]
    group.events.clear()
    delete = {"backstore": "block", "vg": "vg_iscsi", "snapshot": SNAP}
    assert _lio_snap.delete_snapshot(delete) == {"deleted": [SNAP]}
    assert group.events.index(f"zero {device} 0 {8 * MiB}") < group.events.index("lvremove")
    assert read(device) == bytes(8 * MiB)
    assert _lio_snap.delete_snapshot(delete) == {"deleted": []}


def test_remote_block_copy_that_fails_is_zeroed_and_removed(
    monkeypatch: pytest.MonkeyPatch, loops: list[str]
) -> None:
    """A copy cut short by an error leaves no LV of partial data: zeroed, then removed; a
    source not tagged as flexhub's, or a snapshot not whole yet, is refused and nothing made."""
    group = Group(loops)
    with_group(monkeypatch, group)

    def half(src: str, dst: str, length: int) -> None:
        with open(dst, "r+b") as fh:
            fh.write(b"PARTIAL")
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(_lio_snap, "copy_device", half)
    spec = {"name": f"pvc-{UID}", "backstore": "block", "vg": "vg_iscsi", "snapshot": SNAP}
    with pytest.raises(OSError, match="Input/output"):
        _lio_snap.snapshot(spec)
    assert SNAP not in group.lvs and read(loops[1]) == bytes(8 * MiB)
    assert group.events.index(f"zero {loops[1]} 0 {8 * MiB}") < group.events.index("lvremove")

    group.lvs[f"pvc-{UID}"]["tags"] = "flexhub:" + NEW
    with pytest.raises(_lio_remote.Refused, match="without the tag"):
        _lio_snap.snapshot(spec)
    group.lvs[f"pvc-{UID}"]["tags"] = f"flexhub:{UID}"
    group.lvs[SNAP] = {"size": 8 * MiB, "device": group.free.pop(0),
                       "tags": f"flexhub-snapshot:{SNAP[5:]},{_lio_snap.COPYING_TAG}"}  # fmt: skip
    new = f"pvc-{NEW}"
    restore = {"name": new, "backstore": "block", "vg": "vg_iscsi", "size": 8 * MiB,
               "source": {"vg": "vg_iscsi", "name": SNAP}}  # fmt: skip
    with pytest.raises(_lio_remote.Refused, match="not a whole copy yet"):
        _lio_snap.prepare_copy(restore)
    assert new not in group.lvs
