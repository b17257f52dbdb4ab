"""loopfile's room scan wraps each directory's listing in ``except OSError: continue`` ("a
directory gone meanwhile"); ``FIEMAP`` runs inside it, and an I/O error from it (a failing
disk: EIO) must never drop the rest of that directory from the account (files uncounted,
``promised`` smaller, more admitted than the filesystem holds): the file's sharing counts as
unknown instead, the account's safe side. Found by a hostile review (2026-12-06)."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Any

import pytest
from flexhub_loopfile import _room

from flexhub.errors import FlexhubError
from tests.conftest import needs_root

pytestmark = [needs_root]

MiB = 1 << 20


def test_a_fiemap_error_never_makes_files_uncounted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "loopfiles"
    area = root / "namespaces" / "ns"
    area.mkdir(parents=True)
    for name in ("a.img", "b.img", "c.img"):
        fd = os.open(area / name, os.O_WRONLY | os.O_CREAT, 0o600)
        os.pwrite(fd, b"\x5a" * 65536, 0)  # some blocks: FIEMAP is asked
        os.ftruncate(fd, 64 * MiB)
        os.close(fd)
    honest = _room.measure(root, area / "new.img")
    assert honest.promised == 3 * 64 * MiB

    def failing(fd: int, request: int, *args: Any) -> Any:
        if request == 0xC020660B:  # FS_IOC_FIEMAP
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, request, *args)

    real = fcntl.ioctl
    monkeypatch.setattr(fcntl, "ioctl", failing)
    try:
        measured = _room.measure(root, area / "new.img")
    except (FlexhubError, OSError):
        return  # refusing to measure is the safe answer
    # answered: it must not have forgotten a file's promise
    assert measured.promised >= honest.promised, measured
