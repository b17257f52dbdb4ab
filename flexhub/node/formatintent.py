"""Format intents: a format flexhub began and never saw finish is flexhub's to redo.

A first mount killed while ``mkfs`` runs (a node reboot, kubelet killed) leaves a device that
is neither blank nor a filesystem; the safe-format rule would refuse it on every retry. So
before ``mkfs`` runs, the journal records, durably (written, synced, renamed, the directory
synced), the *intent* to format the volume's device, naming the device by its identity
(:func:`device_identity`); the record is removed once ``mkfs`` returns, before the new
filesystem is mounted (so no data of anybody's is ever written under an open intent). A retry
that finds the intent **for the same device identity** formats again, whatever the partial
format left; without an intent, or for another identity, the safe-format rules stand.

The identity, read from sysfs through the device's number:

* a loop device: its backing file's device and inode numbers, inode generation (where the
  filesystem gives one: a file made anew at the same path, even with a reused inode number,
  is another file), the loop offset and size limit, and the device size. It holds across
  reboots: only root on the node writes the file.
* any other block device (an iSCSI LUN, a multipath map): its ``wwid`` (SCSI) or ``dm/uuid``,
  the device size, and the boot id and ``diskseq`` of this attachment. A device that other
  nodes can reach is the format's only while it stayed attached (and fenced) here since: after
  a detach or a reboot another node may have written it, and the intent no longer matches.
* a device without such an identity gets no intent: a format killed on it is refused as before.

The state directory is root's alone (0700), so nobody else can forge an intent.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
from pathlib import Path

from flexhub.node.journal import Journal

__all__ = ["FS_IOC_GETVERSION", "FormatIntent", "device_identity"]

LOG = logging.getLogger(__name__)

#: ``_IOR('v', 1, long)``: a file's inode generation.
FS_IOC_GETVERSION = 0x80087601
SYS = Path("/sys")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_DELETED = " (deleted)"


def _read(path: Path) -> str:
    try:
        return path.read_text("utf-8", errors="replace").strip()
    except OSError:
        return ""


def _generation(fd: int) -> str:
    buf = bytearray(8)
    try:
        fcntl.ioctl(fd, FS_IOC_GETVERSION, buf)
    except OSError as exc:
        if exc.errno not in (errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            LOG.info("cannot read the inode generation: %s", exc.strerror)
        return ""
    return str(struct.unpack_from("=I", buf)[0])


def _loop_file(block: Path) -> dict[str, str] | None:
    backing = _read(block / "loop" / "backing_file")
    if not backing or backing.endswith(_DELETED):
        return None
    try:
        fd = os.open(backing, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        generation = _generation(fd)
    finally:
        os.close(fd)
    return {
        "kind": "loop",
        "file_dev": str(info.st_dev),
        "file_ino": str(info.st_ino),
        "generation": generation,
        "offset": _read(block / "loop" / "offset") or "0",
        "sizelimit": _read(block / "loop" / "sizelimit") or "0",
    }


def device_identity(device: str, sys_root: Path = SYS) -> dict[str, str] | None:
    """The identity of the block device ``device`` (see the module docs); ``None`` when it
    has none flexhub can tell."""
    try:
        info = os.stat(device)
    except OSError:
        return None
    if not stat.S_ISBLK(info.st_mode):
        return None
    block = sys_root / "dev" / "block" / f"{os.major(info.st_rdev)}:{os.minor(info.st_rdev)}"
    sectors = _read(block / "size")
    if not sectors.isdigit() or int(sectors) == 0:
        return None
    size = str(int(sectors) * 512)
    loop = _loop_file(block) if (block / "loop").is_dir() else None
    if loop is not None:
        return {**loop, "size": size}
    uuid = _read(block / "dm" / "uuid")
    wwid = _read(block / "device" / "wwid")
    diskseq = _read(block / "diskseq")
    boot = _read(BOOT_ID)
    if not (uuid or wwid) or not diskseq or not boot:
        return None
    found = {"kind": "dm", "uuid": uuid} if uuid else {"kind": "scsi", "wwid": wwid}
    return {**found, "size": size, "boot_id": boot, "diskseq": diskseq}


class FormatIntent:
    """The journalled intent to format ``device``, the device of ``volume_id``.

    :param sys_root: where sysfs is (tests).
    """

    def __init__(self, journal: Journal, volume_id: str, device: str, sys_root: Path = SYS) -> None:
        self.journal = journal
        self.volume_id = volume_id
        self.device = device
        self.sys_root = sys_root

    def unfinished(self) -> str | None:
        """The fs type of a format flexhub began on this very device and never saw finish;
        ``None`` when there is none (or it names another device)."""
        found = self.journal.get_format(self.volume_id)
        if found is None:
            return None
        identity, fs_type = found
        now = device_identity(self.device, self.sys_root)
        if now != identity:
            # dropped, not kept: the device it named may come back under the same name after
            # its filesystem was mounted and written (another boot's device numbers), and an
            # intent must never outlive a mount that did not format
            LOG.warning(
                "volume %s has an unfinished format of another device (or one that was "
                "released since): not formatting %s again, forgetting that intent",
                self.volume_id,
                self.device,
            )
            self.journal.clear_format(self.volume_id)
            return None
        return fs_type

    def begin(self, fs_type: str) -> None:
        """Journal the intent, before ``mkfs`` runs (nothing when the device has no
        identity: a format killed on it is then refused on retry, as before)."""
        identity = device_identity(self.device, self.sys_root)
        if identity is None:
            LOG.info("%s has no identity flexhub can tell: no format intent", self.device)
            return
        self.journal.put_format(self.volume_id, identity, fs_type)

    def finish(self) -> None:
        """``mkfs`` returned: forget the intent (before the filesystem is mounted)."""
        self.journal.clear_format(self.volume_id)
