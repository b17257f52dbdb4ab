"""The remote program's saved configuration and room check, run on the host.

``save``: a call writes only its own claim's entries into the saved configuration, reading
only its own objects (a recording rtslib that fails any whole-target walk), and the file keeps
every other entry as it was. The room check: the LUN files of a fileio directory on a real
tmpfs of known size, refused past what it holds times ``overcommit``, creating nothing.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flexhub_iscsi import _lio_remote, _lio_room, _lio_save

MiB = 1 << 20
UID = "0b7f3c1e-5d2a-4e8f-9a61-2c4d8e0f1a3b"
NAME = f"pvc-{UID}"
IQN = f"iqn.2003-01.com.example:k8s:{NAME}"


def other(i: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Another claim's saved storage object and target."""
    name = f"pvc-00000000-0000-4000-8000-{i:012d}"
    so = {"plugin": "fileio", "name": name, "dev": f"/srv/iscsi/{name}.img", "size": MiB}
    target = {"wwn": f"iqn.2003-01.com.example:k8s:{name}", "fabric": "iscsi", "tpgs": []}
    return so, target


class Walked(AssertionError):
    pass


class Lib:
    """A recording rtslib: the call's own storage object and target (``present``), each
    lookup and dump recorded; a walk of the whole target (``RTSRoot().dump()``, its
    ``storage_objects`` or ``targets``) fails unless ``walk_ok``."""

    class RTSLibNotInCFS(Exception):
        pass

    def __init__(self, present: bool = True, walk_ok: bool = False) -> None:
        self.present, self.walk_ok = present, walk_ok
        self.events: list[str] = []
        lib = self

        class Root:
            def dump(self) -> dict[str, Any]:
                lib.walked("dump")
                so, target = other(99)
                return {"storage_objects": [so], "targets": [target], "fabric_modules": []}

            @property
            def storage_objects(self) -> list[Any]:
                lib.walked("storage_objects")
                return []

            @property
            def targets(self) -> list[Any]:
                lib.walked("targets")
                return []

        self.Root = Root

    def walked(self, what: str) -> None:
        self.events.append(f"walk {what}")
        if not self.walk_ok:
            raise Walked(what)

    def RTSRoot(self) -> Any:
        return self.Root()

    def FabricModule(self, name: str) -> str:
        return name

    def _dumpable(self, kind: str, key: str, value: str) -> Any:
        if not self.present:
            self.events.append(f"lookup {kind} {value}: none")
            raise self.RTSLibNotInCFS(value)
        self.events.append(f"lookup {kind} {value}")
        events = self.events

        class Obj:
            def dump(self) -> dict[str, Any]:
                events.append(f"dump {kind} {value}")
                if kind == "target":
                    return {"wwn": value, "fabric": "iscsi", "tpgs": [{"tag": 1}]}
                return {"plugin": kind, "name": value, "dev": "new", "size": 2 * MiB}

        return Obj()

    def FileIOStorageObject(self, name: str) -> Any:
        return self._dumpable("fileio", "name", name)

    def BlockStorageObject(self, name: str) -> Any:
        return self._dumpable("block", "name", name)

    def Target(self, fabric: Any, iqn: str, mode: str) -> Any:
        assert mode == "lookup"
        return self._dumpable("target", "wwn", iqn)


@pytest.fixture
def saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "etc" / "saveconfig.json"
    monkeypatch.setattr(_lio_remote, "SAVE_FILE", str(path))
    return path


def write(path: Path, config: dict[str, Any]) -> None:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_text(json.dumps(config, sort_keys=True, indent=2) + "\n")


def test_a_save_reads_and_writes_only_its_own_claims_objects(saved: Path) -> None:
    """200 other claims in the saved file: the call looks up and dumps only its storage
    object and target (no walk of the target), replaces its stale entries in their place,
    and keeps every other entry as it was; the file is 0600 and nothing is left beside it."""
    others = [other(i) for i in range(200)]
    stale_so = {"plugin": "fileio", "name": NAME, "dev": "old", "size": MiB}
    config = {
        "fabric_modules": [{"name": "iscsi", "discovery_enable_auth": True}],
        "storage_objects": [s for s, _ in others[:100]] + [stale_so] + [s for s, _ in others[100:]],
        "targets": [t for _, t in others],
    }
    write(saved, config)
    lib = Lib()
    _lio_remote.save(lib, {"name": NAME, "iqn": IQN, "directory": "/srv/iscsi"})
    assert lib.events == [
        f"lookup fileio {NAME}",
        f"dump fileio {NAME}",
        f"lookup target {IQN}",
        f"dump target {IQN}",
    ]
    after = json.loads(saved.read_text())
    assert after["fabric_modules"] == config["fabric_modules"]
    assert after["storage_objects"][:100] == config["storage_objects"][:100]
    assert after["storage_objects"][100] == {"plugin": "fileio", "name": NAME, "dev": "new",
                                             "size": 2 * MiB}  # fmt: skip
    assert after["storage_objects"][101:] == config["storage_objects"][101:]
    assert after["targets"][:200] == config["targets"]
    assert after["targets"][200] == {"wwn": IQN, "fabric": "iscsi", "tpgs": [{"tag": 1}]}
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    assert sorted(os.listdir(saved.parent)) == ["saveconfig.json"]

    # the claim deleted: its entries dropped, the others' untouched
    lib = Lib(present=False)
    _lio_remote.save(lib, {"name": NAME, "iqn": IQN, "directory": "/srv/iscsi"})
    assert not any(e.startswith(("walk", "dump")) for e in lib.events), lib.events
    after = json.loads(saved.read_text())
    assert after == {**config, "storage_objects": [s for s, _ in others]}


def test_the_first_save_dumps_the_whole_target_once(saved: Path) -> None:
    """No saved file yet (or one that is not a configuration): the whole target is dumped,
    as saveconfig would, and the block backstore's object is looked up as block."""
    for content in (None, "not json", "[]"):
        if content is not None:
            saved.write_text(content)
        lib = Lib(walk_ok=True)
        _lio_remote.save(lib, {"name": NAME, "iqn": IQN, "backstore": "block", "vg": "vg0"})
        assert lib.events == ["walk dump"], lib.events
        assert json.loads(saved.read_text())["storage_objects"] == [other(99)[0]]
    lib = Lib()
    _lio_remote.save(lib, {"name": NAME, "iqn": IQN, "backstore": "block", "vg": "vg0"})
    assert lib.events[0] == f"lookup block {NAME}"
    names = [so["name"] for so in json.loads(saved.read_text())["storage_objects"]]
    assert names == [other(99)[0]["name"], NAME]


def test_merged_keeps_order_and_drops_duplicates() -> None:
    so = {"plugin": "fileio", "name": NAME}
    config = {"storage_objects": [so, {"plugin": "block", "name": NAME}, so], "targets": []}
    out = _lio_save.merged(config, "fileio", NAME, {**so, "size": 1}, IQN, None)
    assert out["storage_objects"] == [{**so, "size": 1}, {"plugin": "block", "name": NAME}]
    assert config["storage_objects"][0] == so  # the input is left as it was


# --------------------------------------------------------------------------------- the room


@pytest.fixture
def luns(tmp_path: Path) -> Iterator[Path]:
    """A fileio directory on its own 16 MiB tmpfs (root's, 0700)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a tmpfs of known size")
    mnt = tmp_path / "luns"
    mnt.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "lio-room", str(mnt)],
                   check=True)  # fmt: skip
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def lun(directory: Path, i: int, size: int) -> Path:
    path = directory / f"pvc-00000000-0000-4000-8000-{i:012d}.img"
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


def provision_spec(directory: Path, size: int, **extra: Any) -> dict[str, Any]:
    return {"name": NAME, "iqn": IQN, "directory": str(directory), "file": f"{NAME}.img",
            "size": size, "sparse": True, "portals": [], "initiators": [], "chap": None,
            **extra}  # fmt: skip


class FileLib(Lib):
    """rtslib with no storage object of the claim's name yet (provision), or one on the
    claim's file (expand)."""

    def __init__(self, directory: Path, size: int = 0) -> None:
        super().__init__(present=bool(size))
        self.path, self.size = str(directory / f"{NAME}.img"), size

    def FileIOStorageObject(self, name: str, **create: Any) -> Any:
        assert not create, "a storage object was made"
        so = super().FileIOStorageObject(name)
        so.udev_path, so.size, so.path = self.path, self.size, "/nonexistent"
        return so


def test_provision_and_expand_refuse_past_the_room_and_create_nothing(
    luns: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sparse 6 MiB LUNs on a 16 MiB filesystem: a third 6 MiB one would promise 18 MiB
    and is refused with the figures (no file, no storage object); with overcommit 2 the room
    check lets it through. Growing a 6 MiB LUN to 12 MiB is refused the same way; files that
    are not LUN files (another name, a symlink) promise nothing."""
    lun(luns, 1, 6 * MiB)
    lun(luns, 2, 6 * MiB)
    (luns / "notes.img").write_bytes(b"")
    os.truncate(luns / "notes.img", 64 * MiB)  # not a LUN file's name: not counted
    (luns / f"pvc-{'1' * 8}-1111-4111-8111-{'1' * 12}.img").symlink_to(luns / "notes.img")
    monkeypatch.setattr(_lio_remote, "rts", lambda: FileLib(luns))
    monkeypatch.setattr(_lio_remote, "ensure_pr_dir", lambda: None)
    with pytest.raises(_lio_remote.NoRoomLeft) as caught:
        _lio_remote.provision(provision_spec(luns, 6 * MiB))
    message = str(caught.value)
    assert message == (
        f"not enough room for {luns}/{NAME}.img (6.0 MiB): the LUN files of {luns} would "
        f"promise 18.0 MiB, and its filesystem can hold 16.0 MiB (16.0 MiB free + 0.0 MiB in "
        "those files) x overcommit 1 = 16.0 MiB"
    ), message
    assert not (luns / f"{NAME}.img").exists()
    # with overcommit 2 the room is there: provision goes on to make the file and its
    # storage object (which this recording rtslib refuses: the call removes its file)
    with pytest.raises(AssertionError, match="storage object was made"):
        _lio_remote.provision(provision_spec(luns, 6 * MiB, overcommit=2.0))
    assert not (luns / f"{NAME}.img").exists()

    mine = luns / f"{NAME}.img"
    mine.write_bytes(b"")
    os.truncate(mine, 2 * MiB)
    monkeypatch.setattr(_lio_remote, "rts", lambda: FileLib(luns, 2 * MiB))
    spec = {"name": NAME, "directory": str(luns), "file": mine.name, "size": 12 * MiB,
            "sparse": True}  # fmt: skip
    with pytest.raises(_lio_remote.NoRoomLeft, match=r"to grow from 2\.0 MiB to 12\.0 MiB"):
        _lio_remote.expand(spec)
    assert mine.stat().st_size == 2 * MiB


def test_room_counts_written_blocks_and_preallocation_needs_free_space(luns: Path) -> None:
    """What the LUN files hold counts as room (available + occupied); a preallocated file
    must fit in the free space now."""
    written = lun(luns, 1, 8 * MiB)
    with open(written, "r+b") as fh:
        fh.write(b"x" * 8 * MiB)
    _lio_room.check_room(str(luns), f"{NAME}.img", 8 * MiB, 1.0, sparse=True)  # 16 <= 16
    with pytest.raises(_lio_room.NoRoomLeft, match=r"8\.0 MiB in those files"):
        _lio_room.check_room(str(luns), f"{NAME}.img", 9 * MiB, 1.0, sparse=True)
    with pytest.raises(_lio_room.NoRoomLeft, match=r"allocating 9\.0 MiB needs that much free"):
        _lio_room.check_room(str(luns), f"{NAME}.img", 9 * MiB, 4.0, sparse=False)
    _lio_room.check_room(str(luns), f"{NAME}.img", 9 * MiB, 4.0, sparse=True)


def test_a_room_refusal_is_answered_as_no_room(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The remote program marks a room refusal so that the provisioner raises NoRoom."""

    def refuse(spec: dict[str, Any]) -> dict[str, Any]:
        raise _lio_remote.NoRoomLeft("not enough room for /srv/iscsi/x.img (1.0 GiB): ...")

    monkeypatch.setitem(_lio_remote.ACTIONS, "provision", refuse)
    monkeypatch.setattr(_lio_remote, "LOCK", "/dev/null")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(SystemExit):
        _lio_remote.main({"action": "provision", "spec": {}})
    line = capsys.readouterr().out.strip()
    assert json.loads(line[len(_lio_remote.MARK) :]) == {
        "error": "not enough room for /srv/iscsi/x.img (1.0 GiB): ...",
        "room": True,
    }


def test_a_delete_that_finds_its_claim_gone_still_drops_it_from_the_saved_file(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete killed after removing the target and backstore but before its save left
    them in the saved file (a reboot would bring a LUN back on a missing file): the retry,
    which finds nothing left to delete, drops them from the file."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the fileio directory must be root's")
    directory = tmp_path / "luns"
    directory.mkdir(mode=0o700)
    so, target = other(1)
    config = {
        "storage_objects": [so, {"plugin": "fileio", "name": NAME, "dev": "x", "size": MiB}],
        "targets": [target, {"wwn": IQN, "fabric": "iscsi", "tpgs": []}],
    }
    write(saved, config)
    lib = Lib(present=False)
    monkeypatch.setattr(_lio_remote, "rts", lambda: lib)
    spec = {"name": NAME, "iqn": IQN, "directory": str(directory), "file": f"{NAME}.img"}
    assert _lio_remote.delete(spec) == {"deleted": []}
    assert json.loads(saved.read_text()) == {"storage_objects": [so], "targets": [target]}


def test_a_claims_storage_objects_are_found_without_reading_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """configfs's core/ of a target with 200 other claims (a directory tree of the same
    shape): the claim's storage objects are built from their own directories only (rtslib's
    walk of every storage object instantiated each of them)."""
    core = tmp_path / "core"
    for i in range(200):
        (core / f"fileio_{i}" / other(i)[0]["name"]).mkdir(parents=True)
    (core / "iblock_200" / NAME).mkdir(parents=True)
    (core / "fileio_201" / NAME).mkdir(parents=True)
    (core / "iblock_202").mkdir()
    built: list[str] = []

    class StorageObject:
        @staticmethod
        def so_from_path(path: str) -> str:
            built.append(path)
            return os.path.basename(path)

    class WalkingLib(Lib):
        tcm = type("tcm", (), {"StorageObject": StorageObject})

    monkeypatch.setattr(_lio_remote, "CORE", str(core))
    assert _lio_remote.named(WalkingLib(), NAME) == [NAME, NAME]
    assert sorted(built) == [f"{core}/fileio_201/{NAME}", f"{core}/iblock_200/{NAME}"]
