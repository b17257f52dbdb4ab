"""Loop devices: find, inspect and create their device nodes; remember which ones are ours.

Everything here reads the kernel's view through sysfs (``/sys/block/loopN/...``) and talks to
``/dev/loop-control`` with ioctls; attaching and detaching is left to ``losetup`` (run by the
backend through the node's command runner).

Ownership markers
-----------------

flexhub must never detach a loop device it did not set up (an administrator's, another tool's,
or one that a reboot handed to somebody else). The backend therefore writes a *marker* for every
device it attaches: ``<state_dir>/loopfile/created/loopN``, a small JSON object::

    {"file": "/var/lib/flexhub/loopfiles/db.img", "dev": 2049, "ino": 131,
     "boot_id": "49178216-...", "diskseq": "17"}

The marker is written *before* ``losetup`` runs (without ``diskseq``: "pending") and completed
right after it succeeds, so a crash between the two still leaves a marker. It is written
atomically through ``.loopN.<pid>.tmp``; such a temporary that a killed writer left is removed
by the next marker write, once that pid is gone. A device is ours iff
its marker exists, was written during the current boot, and

* the marker's ``diskseq`` equals the device's current ``/sys/block/loopN/diskseq`` (the kernel
  bumps that number on every attach, so it identifies one attachment), or
* the marker has no ``diskseq`` (pending, or a kernel without diskseq) and the device's backing
  file is the marker's file (same device and inode numbers).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

from flexhub.backend import Frozen, VolumeError, remove_dead_temporaries, write_atomically

__all__ = [
    "LOOP_CTL_ADD",
    "LOOP_CTL_GET_FREE",
    "LOOP_CTL_REMOVE",
    "LOOP_MAJOR",
    "LoopDevice",
    "Markers",
    "boot_id",
    "devices",
    "ensure_node",
    "find_for_file",
    "free_index",
    "loop_name",
]

LOG = logging.getLogger(__name__)

LOOP_CTL_ADD = 0x4C80
LOOP_CTL_REMOVE = 0x4C81
LOOP_CTL_GET_FREE = 0x4C82
#: The loop driver's block major (used only when sysfs does not say).
LOOP_MAJOR = 7

SYS_BLOCK = Path("/sys/block")
SYS_CLASS_BLOCK = Path("/sys/class/block")
DEV = Path("/dev")
LOOP_CONTROL = DEV / "loop-control"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")

_NAME = re.compile(r"^loop([0-9]{1,7})$")
#: The temporaries of :meth:`Markers.write`.
_TEMPORARY = re.compile(r"\.loop[0-9]{1,7}\.(?P<pid>[0-9]{1,10})\.tmp")
_DELETED = " (deleted)"


def loop_name(device: str) -> tuple[str, int]:
    """Split ``/dev/loop3`` (or ``loop3``) into ``("loop3", 3)``.

    :raises VolumeError: ``device`` is not a loop device name.
    """
    name = device.rsplit("/", 1)[-1]
    match = _NAME.fullmatch(name)
    if match is None or (device.startswith("/") and device != f"/dev/{name}"):
        raise VolumeError(f"{device!r} is not a loop device")
    return name, int(match.group(1))


def _read(path: Path) -> str | None:
    try:
        return path.read_text("utf-8", errors="replace").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.ENODEV):
            return None
        raise


class LoopDevice(Frozen):
    """One loop device as sysfs shows it."""

    __slots__ = ("name", "index")  # noqa: RUF023 - the fields, in order
    name: str
    index: int

    def __init__(self, name: str, index: int) -> None:
        self._set(name=name, index=index)

    @property
    def path(self) -> str:
        return f"/dev/{self.name}"

    def _sys(self, *parts: str) -> Path:
        return SYS_BLOCK.joinpath(self.name, *parts)

    def backing_file(self) -> str | None:
        """The backing file's path as the kernel recorded it, or ``None`` when unbound.

        A ``" (deleted)"`` suffix (the file was removed while attached) is kept.
        """
        return _read(self._sys("loop", "backing_file"))

    def backing_identity(self) -> tuple[int, int] | None:
        """``(st_dev, st_ino)`` of the backing file, or ``None`` (unbound, deleted, gone)."""
        backing = self.backing_file()
        if not backing or backing.endswith(_DELETED):
            return None
        try:
            st = os.stat(backing)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def whole_file(self) -> bool:
        """True when the device maps its file from byte 0 to the end (no offset, no limit)."""
        return _read(self._sys("loop", "offset")) in ("0", None) and _read(
            self._sys("loop", "sizelimit")
        ) in ("0", None)

    def diskseq(self) -> str:
        """The kernel's attach sequence number of the device ("" when unsupported)."""
        return _read(self._sys("diskseq")) or ""

    def size(self) -> int:
        """The device's size in bytes (0 when unbound or gone)."""
        text = _read(self._sys("size"))
        return int(text) * 512 if text and text.isdigit() else 0

    def devnum(self) -> tuple[int, int]:
        """``(major, minor)`` from sysfs, or the loop driver's default numbering."""
        text = _read(SYS_CLASS_BLOCK / self.name / "dev")
        if text and re.fullmatch(r"[0-9]+:[0-9]+", text):
            major, minor = text.split(":")
            return int(major), int(minor)
        return LOOP_MAJOR, self.index


def devices() -> list[LoopDevice]:
    """Every loop device the kernel has, by index."""
    found = []
    try:
        entries = list(SYS_BLOCK.iterdir())
    except OSError:
        return []
    for entry in entries:
        match = _NAME.fullmatch(entry.name)
        if match:
            found.append(LoopDevice(entry.name, int(match.group(1))))
    return sorted(found, key=lambda dev: dev.index)


def find_for_file(path: Path) -> LoopDevice | None:
    """Return the lowest loop device that maps all of ``path``, if any.

    Files are compared by device and inode number, not by name.
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    wanted = (st.st_dev, st.st_ino)
    for dev in devices():
        if dev.backing_identity() == wanted and dev.whole_file():
            return dev
    return None


def free_index() -> int | None:
    """Ask ``/dev/loop-control`` for a free loop index (the kernel adds a device if needed).

    :returns: the index, or ``None`` when the node has no ``/dev/loop-control``.
    :raises VolumeError: the kernel has no free loop device and cannot add one.
    """
    try:
        fd = os.open(LOOP_CONTROL, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        LOG.info("cannot open %s: %s", LOOP_CONTROL, exc.strerror)
        return None
    try:
        return int(fcntl.ioctl(fd, LOOP_CTL_GET_FREE))
    except OSError as exc:
        raise VolumeError(f"no free loop device on the node: {exc.strerror}") from None
    finally:
        os.close(fd)


def ensure_node(dev: LoopDevice) -> Path:
    """Make sure ``/dev/loopN`` exists and is the right block device; create it if missing.

    Containers often see a kernel with free loop devices but a ``/dev`` without their nodes.

    :raises VolumeError: something that is not this loop device sits at ``/dev/loopN``.
    """
    node = DEV / dev.name
    major, minor = dev.devnum()
    wanted = os.makedev(major, minor)
    for _ in range(2):
        try:
            st = os.lstat(node)
        except FileNotFoundError:
            try:
                os.mknod(node, 0o660 | stat.S_IFBLK, wanted)
            except FileExistsError:
                continue  # created concurrently (udev, devtmpfs): check it
            LOG.info("created missing loop device node %s (%d:%d)", node, major, minor)
            return node
        if stat.S_ISBLK(st.st_mode) and st.st_rdev == wanted:
            return node
        raise VolumeError(
            f"{node} is not block device {major}:{minor}; refusing to use it as a loop device"
        )
    raise VolumeError(f"{node} keeps appearing and disappearing")  # pragma: no cover


def boot_id() -> str:
    """The kernel's random id of the current boot ("" when unavailable)."""
    return _read(BOOT_ID) or ""


class Markers:
    """The ownership markers of the loop devices flexhub attached (see the module docs).

    :param directory: ``<state_dir>/loopfile/created``.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, dev: LoopDevice) -> Path:
        return self.directory / dev.name

    def read(self, dev: LoopDevice) -> dict[str, Any] | None:
        """The marker of ``dev``, or ``None`` when there is none (or it is unreadable)."""
        try:
            data = json.loads(self._path(dev).read_text("utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            LOG.warning("ignoring unreadable loop marker %s: %s", self._path(dev), exc)
            return None
        return data if isinstance(data, dict) else None

    def write(self, dev: LoopDevice, file: Path, *, diskseq: str = "") -> None:
        """Record that flexhub attaches (``diskseq=""``) or attached ``dev`` to ``file``."""
        st = os.stat(file)
        data = {
            "file": str(file),
            "dev": st.st_dev,
            "ino": st.st_ino,
            "boot_id": boot_id(),
            "diskseq": diskseq,
        }
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        remove_dead_temporaries(self.directory, _TEMPORARY)
        target = self._path(dev)
        write_atomically(
            target, json.dumps(data, sort_keys=True).encode("utf-8"), sync_directory=False
        )

    def remove(self, dev: LoopDevice) -> None:
        """Forget ``dev`` (no error when there is no marker; a read-only or broken state
        directory is only a warning: the device is already released, and a marker of a
        detached device is never trusted, see :meth:`owns`)."""
        try:
            self._path(dev).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            LOG.warning("cannot remove the marker of %s: %s", dev.path, exc.strerror)

    def owns(self, dev: LoopDevice, file: Path | None = None) -> bool:
        """True when flexhub attached ``dev``'s current binding (and, if given, to ``file``)."""
        data = self.read(dev)
        if data is None:
            return False
        if file is not None and data.get("file") != str(file):
            return False
        current_boot = boot_id()
        if not current_boot or data.get("boot_id") != current_boot:
            return False
        recorded = str(data.get("diskseq") or "")
        if recorded:
            return dev.diskseq() == recorded
        return dev.backing_identity() == (data.get("dev"), data.get("ino"))

    def prune(self) -> None:
        """Drop the markers of earlier boots (their devices are gone)."""
        current_boot = boot_id()
        try:
            entries = list(self.directory.iterdir())
        except OSError:
            return
        for entry in entries:
            if not _NAME.fullmatch(entry.name):
                continue
            data = self.read(LoopDevice(entry.name, 0))
            if data is not None and data.get("boot_id") == current_boot:
                continue
            with contextlib.suppress(OSError):
                entry.unlink()
