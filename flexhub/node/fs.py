"""Safe format and mount (the rules of Kubernetes' ``SafeFormatAndMount``), and growing."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from flexhub.errors import CommandError, InvalidOptions, VolumeError
from flexhub.node.checkpoints import checkpoint
from flexhub.node.mounts import check_block_mount_options, mount
from flexhub.node.runner import CommandRunner

if TYPE_CHECKING:
    from flexhub.node.formatintent import FormatIntent

__all__ = [
    "GROW_TOLERANCE",
    "SUPPORTED_FS_TYPES",
    "ZERO_SPAN",
    "check_blank",
    "device_size",
    "filesystem_size",
    "format_and_mount",
    "grow_filesystem",
    "probe",
]

LOG = logging.getLogger(__name__)

#: The filesystems flexhub creates, and the ``mkfs`` command line of each.
MKFS: dict[str, tuple[str, ...]] = {
    "ext4": ("mkfs.ext4", "-F", "-m0"),
    "ext3": ("mkfs.ext3", "-F", "-m0"),
    "xfs": ("mkfs.xfs", "-f"),
}
SUPPORTED_FS_TYPES = frozenset(MKFS)

#: ``fsck`` exit bits (fsck(8)): 1 errors corrected, 2 reboot advised, 4 errors left.
FSCK_ERRORS_UNCORRECTED = 4

#: How much of a device's start and end must read back as zeros for it to count as blank.
ZERO_SPAN = 1024 * 1024

#: A filesystem this close (bytes) to its device's size counts as fully grown.
GROW_TOLERANCE = 16 * 1024 * 1024


def _is_ext(fs_type: str) -> bool:
    return fs_type in ("ext2", "ext3", "ext4")


def probe(runner: CommandRunner, device: str) -> tuple[str | None, str | None]:
    """Return ``(filesystem type, partition table type)`` found on ``device`` by ``blkid -p``.

    ``(None, None)`` means blkid found **no signature** (exit 2, silent). That is not "blank":
    blkid answers the same for a device it could not open and for content it does not know
    (a tar archive, a qcow2 image, a database file); :func:`check_blank` decides.

    :raises CommandError: blkid failed otherwise (exit 2 with a message, or exit 8,
        ambivalent probing: a device blkid is not sure about is never formatted).
    """
    result = runner(
        ["blkid", "-p", "-s", "TYPE", "-s", "PTTYPE", "-o", "export", "--", device], check=False
    )
    if result.returncode == 2 and not result.stderr.strip():
        return None, None
    if result.returncode != 0:
        detail = (result.stderr.strip() or result.stdout.strip())[:200]
        raise CommandError(
            f"blkid -p {device} failed (exit {result.returncode}): {detail}",
            returncode=result.returncode,
        )
    values: dict[str, str] = {}
    for line in result.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    found = values.get("TYPE") or None, values.get("PTTYPE") or None
    if found == (None, None):  # exit 0: blkid found something it does not name
        raise VolumeError(f"blkid found a signature on {device} without a type: not touching it")
    return found


def _reads_zeros(runner: CommandRunner, device: str, offset: int, length: int) -> bool:
    """Whether ``length`` bytes of ``device`` from ``offset`` read back as zeros (``cmp``).

    :raises CommandError: the device could not be read (cmp exit 2, or it ended early).
    """
    result = runner(
        ["cmp", "-n", str(length), "-i", f"{offset}:0", "--", device, "/dev/zero"], check=False
    )
    text = (result.stderr.strip() or result.stdout.strip())[:200]
    if result.returncode == 0:
        return True
    if result.returncode == 1 and "differ" in result.stdout and "EOF" not in text:
        return False
    raise CommandError(
        f"cannot read {device} at {offset} (cmp exit {result.returncode}): {text}",
        returncode=result.returncode,
    )


def check_blank(runner: CommandRunner, device: str, hint: bool | None, label: str = "") -> None:
    """Prove that ``device``, on which blkid found no signature, is blank; raise otherwise.

    Blank means: the device opens and has a size, and either ``hint`` is true (the backend
    knows it was never written: a file created by this call, or one without data extents) or,
    when the backend does not know (``None``), its first and last :data:`ZERO_SPAN` bytes
    read back as zeros. ``hint`` false (the backend saw data) is never blank.

    :raises CommandError: the device cannot be opened or read.
    :raises VolumeError: it holds data flexhub cannot identify.
    """
    label = label or device
    size = device_size(runner, device)
    if size <= 0:
        raise CommandError(f"{label} has no size (is it attached?): refusing to format it")
    unknown = VolumeError(
        f"{label} holds data flexhub cannot identify (no filesystem signature, but not "
        "blank): refusing to format it"
    )
    if hint is False:
        raise unknown
    if hint is None:
        span = min(ZERO_SPAN, size)
        for offset in sorted({0, size - span}):
            if not _reads_zeros(runner, device, offset, span):
                raise unknown


def format_and_mount(
    runner: CommandRunner,
    device: str,
    target: str | os.PathLike[str],
    fs_type: str,
    read_only: bool,
    options: Sequence[str] = (),
    mount_timeout: float | None = None,
    blank_hint: bool | None = None,
    label: str = "",
    internal_options: Sequence[str] = (),
    intent: FormatIntent | None = None,
) -> bool:
    """Mount ``device`` on ``target`` as ``fs_type``, creating the filesystem only if blank.

    The rules: probe with ``blkid -p``; refuse a partition table; format only a device with
    no signature that :func:`check_blank` proves blank (``blank_hint`` is the backend's
    :attr:`~flexhub.backend.Attachment.blank`), probed once more right before ``mkfs``, and
    never for a read-only mount; a filesystem of another type is a failure naming both types
    (never a reformat); ``fsck -a`` a read-write ext filesystem first (exit 1 and 2 are fine,
    4 and above fail). ``label`` names the device in errors (default: ``device``).
    ``options`` come from the volume and must pass the allow-list;
    ``internal_options`` are flexhub's own choice (``norecovery`` for a read-only mount of a
    shared device) and are not checked against it.

    ``intent`` (the volume's :class:`~flexhub.node.formatintent.FormatIntent`) is journalled
    before ``mkfs`` runs and cleared once it returns, before the mount. When it names this
    very device on entry (a format flexhub began and never saw finish) and blkid finds nothing
    or only the filesystem that format was making, the device is formatted again; anything
    else blkid finds (another type, a partition table) is not that format's: the intent is
    dropped and the rules above stand. A read-only mount of such a device is refused.

    :returns: whether the device was formatted by this call.
    :raises InvalidOptions: ``fs_type`` is not supported, or a mount option is forbidden.
    :raises VolumeError: the device's content forbids the mount.
    :raises CommandError: a tool failed.
    """
    if fs_type not in SUPPORTED_FS_TYPES:
        raise InvalidOptions(
            f"fsType {fs_type!r} is not supported (use one of {', '.join(sorted(MKFS))})"
        )
    opts = check_block_mount_options(o for o in options if o not in ("ro", "rw"))
    existing, table = probe(runner, device)
    formatted = False
    begun = intent.unfinished() if intent is not None else None
    if begun is not None and (table, existing) not in ((None, None), (None, begun)):
        LOG.warning("%s holds what no format of flexhub made: forgetting its intent", device)
        assert intent is not None
        intent.finish()
        begun = None
    if begun is not None:
        assert intent is not None
        if read_only:
            raise VolumeError(
                f"{label or device} holds a format flexhub began and never finished, and the "
                "volume is read-only: mount it read-write once to finish it"
            )
        LOG.warning(
            "%s holds a format flexhub began and never finished: formatting it again",
            label or device,
        )
        _mkfs(runner, device, fs_type, intent)
        formatted = True
    elif table is not None:
        raise VolumeError(
            f"{device} holds a {table} partition table; flexhub neither formats nor mounts "
            "partitioned devices"
        )
    elif existing is None:
        if read_only:
            raise VolumeError(
                f"{device} has no filesystem and the volume is read-only: refusing to format it"
            )
        check_blank(runner, device, blank_hint, label)
        if probe(runner, device) != (None, None):
            raise VolumeError(f"{label or device} changed while flexhub checked it: not formatting")
        LOG.info("formatting blank device %s as %s", device, fs_type)
        _mkfs(runner, device, fs_type, intent)
        formatted = True
    elif existing != fs_type:
        raise VolumeError(
            f"{device} already holds a {existing} filesystem but fsType {fs_type} was "
            f"requested: refusing to reformat it"
        )
    elif not read_only and _is_ext(existing):
        if not device.startswith("/"):
            raise VolumeError(f"refusing to check {device!r}: not an absolute device path")
        # no "--": util-linux fsck passes everything after it to the checker as options and
        # then checks "all file systems" of fstab instead of the device
        result = runner(["fsck", "-a", device], check=False)
        if result.returncode >= FSCK_ERRORS_UNCORRECTED:
            detail = (result.stdout.strip() or result.stderr.strip())[-300:]
            raise VolumeError(
                f"fsck -a {device} found errors it could not fix (exit {result.returncode}): "
                f"{detail}"
            )
        if result.returncode:
            LOG.warning("fsck -a %s corrected errors (exit %d)", device, result.returncode)
    final = [*opts, *(o for o in internal_options if o not in opts)]
    if _is_ext(fs_type) and not any(o.startswith("errors=") for o in final):
        # the superblock's own default may be errors=panic (a hostile image or LUN)
        final.append("errors=remount-ro")
    if read_only:
        final.append("ro")
    mount(runner, device, target, fs_type=fs_type, options=final, timeout=mount_timeout)
    return formatted


def _mkfs(runner: CommandRunner, device: str, fs_type: str, intent: FormatIntent | None) -> None:
    """``mkfs`` under a journalled intent: begun before it runs, cleared once it returned
    (a failed ``mkfs`` keeps it: what it wrote is flexhub's to redo)."""
    if intent is not None:
        intent.begin(fs_type)
    checkpoint("format-intent")
    runner([*MKFS[fs_type], "--", device])
    checkpoint("formatted")
    if intent is not None:
        intent.finish()


def device_size(runner: CommandRunner, device: str) -> int:
    """The size of a block device in bytes (``blockdev --getsize64``)."""
    out = runner(["blockdev", "--getsize64", device]).stdout.strip()
    try:
        return int(out)
    except ValueError:
        raise CommandError(f"blockdev --getsize64 {device} printed {out[:50]!r}") from None


def filesystem_size(runner: CommandRunner, device: str, mount_point: str, fs_type: str) -> int:
    """The size in bytes the filesystem itself claims (its superblock, not ``statvfs``)."""
    if _is_ext(fs_type):
        out = runner(["dumpe2fs", "-h", "--", device]).stdout
        count = re.search(r"^Block count:\s+(\d+)", out, re.M)
        size = re.search(r"^Block size:\s+(\d+)", out, re.M)
        if count and size:
            return int(count.group(1)) * int(size.group(1))
        raise CommandError(f"dumpe2fs -h {device}: no block count in its output")
    if fs_type == "xfs":
        out = runner(["xfs_info", mount_point]).stdout
        data = re.search(r"^data\s+=\s+bsize=(\d+)\s+blocks=(\d+)", out, re.M)
        if data:
            return int(data.group(1)) * int(data.group(2))
        raise CommandError(f"xfs_info {mount_point}: no data section in its output")
    raise VolumeError(f"cannot measure a {fs_type} filesystem")


def grow_filesystem(runner: CommandRunner, device: str, mount_point: str, fs_type: str) -> int:
    """Grow the mounted filesystem to fill ``device``, and verify that it did.

    ``resize2fs DEVICE`` for ext filesystems, ``xfs_growfs MOUNTPOINT`` for xfs. Success is
    never reported without checking the superblock afterwards: the filesystem must have grown,
    or already fill the device (a retried call).

    :returns: the filesystem size in bytes.
    :raises CommandError: the grow tool failed.
    :raises VolumeError: the filesystem type cannot grow, or did not grow.
    """
    if _is_ext(fs_type):
        argv = ["resize2fs", "--", device]
    elif fs_type == "xfs":
        argv = ["xfs_growfs", "-d", "--", mount_point]
    else:
        raise VolumeError(f"cannot grow a {fs_type} filesystem")
    before = filesystem_size(runner, device, mount_point, fs_type)
    runner(argv)
    after = filesystem_size(runner, device, mount_point, fs_type)
    space = device_size(runner, device)
    if after <= before and space - after > GROW_TOLERANCE:
        raise VolumeError(
            f"the {fs_type} filesystem on {device} did not grow ({after} bytes on a "
            f"{space}-byte device)"
        )
    LOG.info("filesystem on %s is %d bytes (was %d, device %d)", device, after, before, space)
    return after
