"""Snapshots, restores and clones of loopfile volumes: copies of backing files on the node.

A snapshot is a copy of the volume's backing file at ``<root>/snapshots/<namespace>/
snap-<uid>.img`` (0600, root's). No volume's ``file`` option can name it: with isolation a
``file`` is resolved in its namespace's area (``<root>/namespaces/<ns>/``), and without it a
``file`` (or a class's ``directory``) starting with ``snapshots/`` is refused; nor is a
snapshot ever adopted into a namespace's area as a pre-isolation file.

The copy is a reflink (``FICLONE``: btrfs, and xfs with ``reflink=1`` on a device whose sectors
are as large as its blocks, see :func:`reflink_safe`): instant, sharing blocks until either side
is written. Where the filesystem cannot reflink safely it is a full copy that
skips holes (``SEEK_DATA``/``SEEK_HOLE``), so a sparse file stays sparse; the record's ``how``
says which. Either way the copy counts in the root's room account
(:mod:`flexhub_loopfile._room`) at its apparent size, and is refused (:class:`NoRoom`) beyond
it. A copy appears atomically (made under a ``.flexhub-new`` name, then linked); the
temporary of a copy killed midway is removed by the next copy to the same name (a retry).

The copy of a volume in use is crash-consistent (what a power cut would leave: its
filesystem's journal replays on the restored volume), not frozen.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from flexhub.backend import InvalidOptions, VolumeError, fsync_directory
from flexhub_loopfile import _files
from flexhub_loopfile._tenancy import SNAPSHOTS

if TYPE_CHECKING:
    from flexhub_loopfile import LoopfileBackend

__all__ = ["SNAPSHOTS", "copy_into", "delete", "snapshot_path"]

LOG = logging.getLogger(__name__)

#: ``FICLONE`` (``_IOW(0x94, 9, int)``): make the destination share the source's blocks.
FICLONE = 0x40049409
_NAME = re.compile(r"snap-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_CHUNK = 1 << 20
_NO_REFLINK = (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.EXDEV, errno.ENOSYS)


def snapshot_path(root: Path, name: str, namespace: str) -> Path:
    """``<root>/snapshots/<namespace>/<name>.img``, both checked."""
    if not _NAME.fullmatch(name):
        raise InvalidOptions(f"snapshot name {name[:80]!r} is not snap-<uid>")
    if not _NAMESPACE.fullmatch(namespace):
        raise InvalidOptions(f"namespace {namespace[:80]!r} is not a Kubernetes namespace")
    return root / SNAPSHOTS / namespace / f"{name}.img"


def _copy_range(src: int, dst: int, start: int, end: int) -> None:
    """Read and write (never ``copy_file_range``: on xfs it shares the blocks, a reflink)."""
    offset = start
    while offset < end:
        chunk = os.pread(src, min(_CHUNK, end - offset), offset)
        if not chunk:
            return
        view = memoryview(chunk)
        while view:
            written = os.pwrite(dst, view, offset)
            view, offset = view[written:], offset + written


def _fs_type(device: int) -> str:
    """The type of the mounted filesystem of ``st_dev`` ``device`` (``""``: unknown)."""
    wanted = f"{os.major(device)}:{os.minor(device)}"
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        fields = line.split()
        if len(fields) > 2 and fields[2] == wanted and " - " in line:
            return line.split(" - ", 1)[1].split()[0]
    return ""


def _logical_block_size(device: int) -> int:
    """The logical block size of the block device ``device`` (a partition: its disk's)."""
    entry = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    for queue in (entry / "queue", entry / ".." / "queue"):
        with contextlib.suppress(OSError, ValueError):
            return int((queue / "logical_block_size").read_text())
    return 0


def reflink_safe(fd: int) -> bool:
    """Whether a reflink of the file ``fd`` keeps its loop device's sector size.

    The kernel gives a loop device in direct-I/O mode the direct-I/O alignment of its file as
    logical block size. xfs reports its device's sector size for a file of its own and its
    block size for a shared (reflinked) one, so after a reflink on an xfs whose device has
    512-byte sectors the *source's* and the copy's loop devices get 4096-byte sectors, and a
    filesystem made with 1 KiB blocks (mkfs.ext4's choice below 512 MiB) no longer mounts
    (found by tests/csi/test_snapshot.py). Safe: btrfs (its alignment is always its sector
    size) and an xfs whose device's sectors are as large as its blocks.
    """
    st = os.fstat(fd)
    kind = _fs_type(st.st_dev)
    if kind == "btrfs":
        return True
    if kind != "xfs":
        return False
    return _logical_block_size(st.st_dev) == os.fstatvfs(fd).f_bsize


def _copy(src: int, dst: int, size: int) -> str:
    """Copy ``src`` into the empty ``dst``: ``"reflink"`` or ``"copy"`` (holes skipped)."""
    if reflink_safe(src):
        try:
            fcntl.ioctl(dst, FICLONE, src)
            return "reflink"
        except OSError as exc:
            if exc.errno not in _NO_REFLINK:
                raise
    os.ftruncate(dst, size)
    offset = 0
    while offset < size:
        try:
            data = os.lseek(src, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole is left
                break
            raise
        hole = os.lseek(src, data, os.SEEK_HOLE)
        _copy_range(src, dst, data, hole)
        offset = hole
    return "copy"


def copy_into(backend: LoopfileBackend, source: Path | None, dest: Path, size: int = 0) -> str:
    """Copy the regular file ``source`` to the new file ``dest`` (grown to ``size`` bytes if
    larger), checked against the root's room under its lock; ``dest`` already there is
    success (a retry). ``source`` ``None`` (a volume never mounted, so never written): an
    empty sparse file of ``size`` bytes.

    :returns: ``"reflink"``, ``"copy"``, ``"empty"`` or ``"exists"``.
    :raises NoRoom: the copy would promise more than the root's filesystem holds.
    :raises VolumeError: the source is missing or not a regular file, or the copy failed.
    """
    from flexhub_loopfile import _room

    if os.path.lexists(dest):
        return "exists"
    try:
        src = os.open(source or "/dev/null", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise VolumeError(f"cannot open {source}: {exc.strerror}") from None
    try:
        st = os.fstat(src)
        if source is not None and not stat.S_ISREG(st.st_mode):
            raise VolumeError(f"{source} is not a regular file")
        length = st.st_size if source is not None else 0
        target = max(length, size)
        with backend._room_lock():
            _remove_leftovers(dest)
            backend._check_room(dest, target, False)
            made = _files.make_parents(dest)
            tmp = dest.with_name(f".{dest.name}.{os.urandom(4).hex()}{_room.NEW_SUFFIX}")
            try:
                how = _write(src if source is not None else None, tmp, length, target)
                try:
                    os.link(tmp, dest)
                except FileExistsError:
                    how = "exists"
            except BaseException:
                _files.remove_dirs(made)
                raise
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        fsync_directory(dest.parent)
    finally:
        os.close(src)
    LOG.info("copied %s to %s (%s, %d bytes)", source, dest, how, target)
    return how


def _remove_leftovers(dest: Path) -> None:
    """Remove the temporaries (``.<name>.<random>.flexhub-new``) a copy to ``dest`` killed
    midway left: copies hold the room lock (as the caller does), so none is another's."""
    from flexhub_loopfile import _room

    try:
        names = os.listdir(dest.parent)
    except FileNotFoundError:
        return
    prefix = f".{dest.name}."
    for name in names:
        if name.startswith(prefix) and name.endswith(_room.NEW_SUFFIX):
            path = dest.parent / name
            if stat.S_ISREG(os.lstat(path).st_mode):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                LOG.info("removed %s, left by a copy killed midway", path)


def _write(src: int | None, tmp: Path, size: int, target: int) -> str:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    dst = os.open(tmp, flags, 0o600)
    try:
        try:
            how = _copy(src, dst, size) if src is not None else "empty"
            if target > size:
                os.ftruncate(dst, target)
            os.fsync(dst)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                from flexhub.backend import NoRoom

                raise NoRoom(f"not enough room on the node to copy {size} bytes") from None
            raise VolumeError(f"cannot copy into {tmp.parent}: {exc.strerror or exc}") from None
    finally:
        os.close(dst)
    return how


def delete(root: Path, relative: str) -> None:
    """Remove the snapshot file ``<root>/<relative>`` (``snapshots/<ns>/snap-<uid>.img``);
    gone is success; anything else at its place (a symlink, a directory) is refused."""
    parts = relative.split("/")
    if (
        len(parts) != 3
        or parts[0] != SNAPSHOTS
        or not _NAMESPACE.fullmatch(parts[1])
        or not parts[2].endswith(".img")
        or not _NAME.fullmatch(parts[2].removesuffix(".img"))
    ):
        raise VolumeError(f"{relative[:120]!r} is not a loopfile snapshot")
    path = root.joinpath(*parts)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode) or path.parent.resolve() != path.parent:
        raise VolumeError(f"{path} is not a regular file in its place: left alone")
    path.unlink()
    LOG.info("deleted snapshot %s", path)
    with contextlib.suppress(OSError):
        path.parent.rmdir()  # the namespace's directory, once empty
