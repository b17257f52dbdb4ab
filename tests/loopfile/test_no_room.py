"""The loopfile room account refuses with :class:`~flexhub.errors.NoRoom` (CSI:
``RESOURCE_EXHAUSTED``), a :class:`~flexhub.errors.VolumeError` still, so the FlexVolume
reply stays ``Failure`` (test_node_room.py checks those replies on a real root)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from flexhub_loopfile import _files, _room

from flexhub.errors import FlexhubError, NoRoom, VolumeError

MiB = 1 << 20


def test_no_room_is_a_volume_error_whose_flexvolume_status_is_failure() -> None:
    assert issubclass(NoRoom, VolumeError)
    assert NoRoom.status == FlexhubError.status == "Failure"
    assert NoRoom.exit_code == 1


def test_a_sparse_promise_beyond_the_filesystem_is_no_room(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(NoRoom, match=r"not enough room for .*overcommit 1"):
        _room.check(root, root / "big.img", 1 << 60, ratio=1.0, preallocate=False)
    assert os.listdir(root) == []


def test_a_preallocation_beyond_the_free_space_is_no_room(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
    with pytest.raises(NoRoom, match=r"preallocating"):
        _room.check(root, root / "big.img", free + (64 * MiB), ratio=1e5, preallocate=True)


def test_enospc_while_creating_or_growing_is_no_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The filesystem itself saying ENOSPC (another writer took the room after the check)."""

    def full(fd: int, *args: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "ftruncate", full)
    path = tmp_path / "f.img"
    path.write_bytes(b"x" * 4096)
    with pytest.raises(NoRoom, match=r"not enough room on the node to grow"):
        _files.grow(path, 4096, 8192, preallocate=False)
