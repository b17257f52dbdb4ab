"""A fileio growth whose save of LIO's configuration failed (ENOSPC on /etc, the program
killed between ``fd_dev_size`` and the rename) is saved by its retry: before, the retry
found the storage object grown, answered at once and never saved, so a reboot of the target
restored the LUN at its old size under a filesystem the node had grown. And a PV made before
room accounting (no ``overcommit`` in its record) grows uncounted, as it did then."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from flexhub_iscsi import _lio, _lio_remote

MiB = 1 << 20
UID = "0b7f3c1e-5d2a-4e8f-9a61-2c4d8e0f1a3b"
NAME = f"pvc-{UID}"
IQN = f"iqn.2003-01.com.example:k8s:{NAME}"


def _lib(image: str, control: Path) -> Any:
    """rtslib as expand sees it: the claim's fileio object, its size what was written to its
    ``control`` (2 MiB before), and its target."""

    class StorageObject:
        udev_path = image

        @property
        def path(self) -> str:
            return str(control.parent)

        @property
        def size(self) -> int:
            text = control.read_text()
            return int(text.split("=")[1]) if text else 2 * MiB

        def dump(self) -> dict[str, Any]:
            return {"plugin": "fileio", "name": NAME, "dev": image, "size": self.size}

    class Target:
        def dump(self) -> dict[str, Any]:
            return {"wwn": IQN, "fabric": "iscsi", "tpgs": []}

    class Lib:
        class RTSLibNotInCFS(Exception):
            pass

        def RTSRoot(self) -> Any:
            return object()

        def FileIOStorageObject(self, name: str) -> Any:
            return StorageObject()

        def FabricModule(self, name: str) -> str:
            return name

        def Target(self, fabric: Any, iqn: str, mode: str) -> Any:
            return Target()

    return Lib()


def test_a_growth_whose_save_failed_is_saved_by_its_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the fileio directory must be root's")
    os.chmod(tmp_path, 0o755)
    luns = tmp_path / "luns"
    luns.mkdir(mode=0o700)
    image = luns / f"{NAME}.img"
    with open(image, "wb") as fh:
        fh.truncate(2 * MiB)
    control = tmp_path / "cfs" / "control"
    control.parent.mkdir()
    control.write_text("")
    saved = tmp_path / "etc" / "saveconfig.json"
    saved.parent.mkdir(mode=0o700)
    saved.write_text(json.dumps({
        "storage_objects": [{"plugin": "fileio", "name": NAME, "dev": str(image),
                             "size": 2 * MiB}],
        "targets": [{"wwn": IQN, "fabric": "iscsi", "tpgs": []}],
    }))  # fmt: skip
    monkeypatch.setattr(_lio_remote, "SAVE_FILE", str(saved))
    lib = _lib(str(image), control)
    monkeypatch.setattr(_lio_remote, "rts", lambda: lib)
    real = _lio_remote.write_saved

    def no_space(path: str, config: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", path + ".flexhub-new")

    spec = {"name": NAME, "iqn": IQN, "directory": str(luns), "file": image.name,
            "size": 8 * MiB, "sparse": True, "overcommit": 1}  # fmt: skip
    monkeypatch.setattr(_lio_remote, "write_saved", no_space)
    with pytest.raises(OSError):
        _lio_remote.expand(spec)
    monkeypatch.setattr(_lio_remote, "write_saved", real)  # /etc has room again
    assert _lio_remote.expand(spec) == {"size": 8 * MiB}
    (entry,) = json.loads(saved.read_text())["storage_objects"]
    assert entry["size"] == 8 * MiB  # a reboot restores the LUN at its grown size


def test_a_record_from_before_room_accounting_grows_uncounted() -> None:
    options = {"targetPortal": "10.0.0.5:3260", "iqn": IQN, "lun": "0"}
    record = {"targetHost": "10.0.0.5", "sshUser": "root", "sshPort": "22",
              "backstore": "fileio", "fileioDirectory": "/srv/iscsi", "sparse": "true",
              "claimUid": UID}  # fmt: skip
    assert _lio.parse_volume(options, record).overcommit == 0.0
    assert _lio.parse_volume(options, {**record, "overcommit": "1"}).overcommit == 1.0
    assert _lio.parse_volume(options, {**record, "overcommit": "2.5"}).overcommit == 2.5


def test_a_saveconfig_of_another_tool_inside_the_merge_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """targetcli's saveconfig (an administrator leaving targetcli) replaces the file while
    flexhub merges its claim: the file is read and merged again, the admin's objects kept
    (before: flexhub's rename of its stale merge dropped them from the next boot)."""
    saved = tmp_path / "saveconfig.json"
    admin_so = {"plugin": "block", "name": "admin-db", "dev": "/dev/sdb"}
    admin_target = {"wwn": "iqn.2003-01.org.admin:db", "fabric": "iscsi", "tpgs": []}
    saved.write_text(json.dumps({"storage_objects": [], "targets": []}))
    monkeypatch.setattr(_lio_remote, "SAVE_FILE", str(saved))

    class Target:
        def dump(self) -> dict[str, Any]:
            # the admin's targetcli exits now (auto_save_on_exit): a whole saveconfig
            saved.write_text(
                json.dumps({"storage_objects": [admin_so], "targets": [admin_target]}, indent=1)
            )
            return {"wwn": IQN, "fabric": "iscsi", "tpgs": []}

    class Lib:
        class RTSLibNotInCFS(Exception):
            pass

        def FileIOStorageObject(self, name: str) -> Any:
            raise self.RTSLibNotInCFS(name)

        def FabricModule(self, name: str) -> str:
            return name

        def Target(self, fabric: Any, iqn: str, mode: str) -> Any:
            return Target()

    _lio_remote.save(Lib(), {"name": NAME, "iqn": IQN})
    after = json.loads(saved.read_text())
    assert admin_so in after["storage_objects"] and admin_target in after["targets"]
    assert {"wwn": IQN, "fabric": "iscsi", "tpgs": []} in after["targets"]


def test_a_saved_file_that_cannot_be_read_now_is_an_error_not_a_fresh_start(
    tmp_path: Path,
) -> None:
    """EIO or EMFILE on the saved file would otherwise be taken for no file, and the whole
    live target written over the entries of objects not live (a failed restore's)."""
    from flexhub_iscsi import _lio_save

    directory = tmp_path / "not-a-file"
    directory.mkdir()
    with pytest.raises(OSError):
        _lio_save.read_saved(str(directory))  # IsADirectoryError: read, not "none"
    assert _lio_save.read_saved(str(tmp_path / "missing")) is None
