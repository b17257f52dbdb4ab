"""Part of the remote program (:mod:`flexhub_iscsi._lio_remote`): the fileio backing files
(checked, opened, grown) and the copies that snapshots, restores and clones make of them and
of logical volumes.

A file is copied with a reflink (``FICLONE``: btrfs, xfs with ``reflink=1``) where the
filesystem can: instant, point in time, sharing blocks until either side is written. LIO's
fileio backstore reads and writes its file through the page cache with 512-byte blocks
whatever the file's direct-I/O alignment, so a reflink changes nothing the initiator sees
(unlike a loop device in direct-I/O mode: see loopfile's ``reflink_safe``). A preallocated
(not sparse) LUN's file made by a restore or a clone is never a reflink: it must own every
block (a shared one needs a new block at its first write, which a full filesystem refuses).
Elsewhere it is a full copy that skips holes (``SEEK_DATA``/``SEEK_HOLE``, read and write:
``copy_file_range`` would reflink on xfs), so a sparse file stays sparse. A copy is made
under a temporary name (``.<name>.flexhub-new``, removed first when a killed call left it) and
renamed into place once synced, so the final name only ever holds a whole copy.

A logical volume is copied with ``O_DIRECT`` reads and writes (:func:`copy_device`): LIO's
iblock backstore writes to the device with bios that bypass the block device's page cache,
so a buffered read could be served stale pages from an earlier read.

Standard library only: this text runs on the target host (python3 3.7 or later).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
from typing import Any

if __name__ != "__main__":  # imported on the host; sent, the parts' texts come before this
    from flexhub_iscsi._lio_errors import NoRoomLeft, Refused

#: ``FICLONE`` (``_IOW(0x94, 9, int)``): make the destination share the source's blocks.
FICLONE = 0x40049409
#: What ``FICLONE`` answers where the filesystem (or the pair of files) cannot share blocks.
NO_REFLINK = (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.EXDEV, errno.ENOSYS)
CHUNK = 1 << 20
NEW_SUFFIX = ".flexhub-new"


def check_directory(path: str) -> None:
    """A directory that only root can change, reached without a symlink through directories
    only root can change: each one above it root's and writable by no one else, or sticky
    (as /tmp: no one else can rename what is root's in it). Anyone who could write one of
    them could rename the LUN directory away and put one of theirs in its place between
    these checks and an open by path."""
    if os.path.realpath(path) != path:
        raise Refused(f"fileioDirectory {path} is (or is under) a symlink")
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise Refused(f"fileioDirectory {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"fileioDirectory {path} is not a directory")
    if st.st_uid != 0 or st.st_mode & 0o022:
        raise Refused(f"fileioDirectory {path} must be owned by root and writable by no one else")
    above = os.path.dirname(path)
    while True:
        st = os.lstat(above)
        if st.st_uid != 0 or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            raise Refused(
                f"fileioDirectory {path}: {above} must be owned by root and writable by no one "
                "else (or sticky)"
            )
        if above == os.path.dirname(above):
            return
        above = os.path.dirname(above)


def open_file(spec: dict[str, Any], create: bool) -> tuple[int, bool]:
    """Open (or create, 0600) the backing file in its directory, never through a symlink."""
    directory, name = spec["directory"], spec["file"]
    check_directory(directory)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        made = False
        if create:
            try:
                fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dfd)
                made = True
            except FileExistsError:
                fd = os.open(name, flags, dir_fd=dfd)
        else:
            fd = os.open(name, flags, dir_fd=dfd)
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise Refused(f"{directory}/{name} is not a plain file of its own")
    return fd, made


def grow(fd: int, size: int, sparse: bool) -> None:
    if os.fstat(fd).st_size >= size:
        return
    if sparse:
        os.ftruncate(fd, size)
    else:
        os.posix_fallocate(fd, 0, size)
    os.fsync(fd)


def ratio(spec: dict[str, Any]) -> float:
    """The class's ``overcommit`` (1: none; 0: a PV from before room accounting)."""
    return float(spec.get("overcommit", 1))


def file_size(directory: str, name: str) -> Any:
    """The size of the plain file ``name`` (root's, one link) in ``directory``, or ``None``
    when there is none; anything else of that name is refused."""
    try:
        st = os.lstat(os.path.join(directory, name))
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != 0:
        raise Refused(f"{directory}/{name} is not a plain file of its own")
    return st.st_size


def open_source(directory: str, name: str, what: str) -> int:
    """The file a copy is made of, opened (read and write: root's, as LIO opens it)."""
    try:
        fd, _ = open_file({"directory": directory, "file": name}, create=False)
    except FileNotFoundError:
        raise Refused(f"{what} {directory}/{name} does not exist") from None
    return fd


def copy_range(src: int, dst: int, start: int, end: int) -> None:
    offset = start
    while offset < end:
        chunk = os.pread(src, min(CHUNK, end - offset), offset)
        if not chunk:
            return
        view = memoryview(chunk)
        while view:
            written = os.pwrite(dst, view, offset)
            view, offset = view[written:], offset + written


def copy_file(src: int, dst: int, reflink: bool = True) -> str:
    """Copy the file ``src`` into the empty file ``dst``: ``"reflink"`` or ``"copy"``
    (always a copy unless ``reflink``)."""
    if reflink:
        try:
            fcntl.ioctl(dst, FICLONE, src)
            return "reflink"
        except OSError as exc:
            if exc.errno not in NO_REFLINK:
                raise
    size = os.fstat(src).st_size
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
        copy_range(src, dst, data, hole)
        offset = hole
    return "copy"


def copy_into(
    src: int, directory: str, name: str, size: int, sparse: bool, reflink: Any = None
) -> str:
    """Copy the file ``src`` to the new file ``directory/name`` (0600, grown to ``size``
    bytes; all of it allocated unless ``sparse``): ``"reflink"`` or ``"copy"``.

    A file that is not ``sparse`` is never a reflink: its blocks would be shared with the
    source's, and ``fallocate`` keeps shared blocks shared, so its first write of each would
    need a new block, which a full filesystem refuses (ENOSPC): what preallocation rules out.
    ``reflink`` ``False``: never a reflink either (a snapshot of a preallocated LUN, whose
    own blocks a reflink would share).

    :raises NoRoomLeft: the filesystem is full (nothing is left of the copy).
    """
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    temporary = f".{name}{NEW_SUFFIX}"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary, dir_fd=dfd)  # a killed call's leftover
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        dst = os.open(temporary, flags, 0o600, dir_fd=dfd)
        try:
            try:
                how = copy_file(src, dst, reflink=sparse and reflink is not False)
                grow(dst, size, True)
                if not sparse:
                    os.posix_fallocate(dst, 0, size)
                os.fsync(dst)
            finally:
                os.close(dst)
            os.rename(temporary, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=dfd)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoRoomLeft(
                    f"not enough room in {directory} to copy {size} bytes into {name}"
                ) from None
            raise
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return how


def remove_file(directory: str, name: str) -> bool:
    """Remove the plain file ``directory/name`` (and a killed copy's temporary); ``False``
    when it is gone already. Anything else of that name is refused and left."""
    check_directory(directory)
    if file_size(directory, name) is None:
        found = False
    else:
        os.unlink(os.path.join(directory, name))
        found = True
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, f".{name}{NEW_SUFFIX}"))
    return found


def copy_device(src: str, dst: str, length: int) -> None:
    """Copy the first ``length`` bytes of the block device ``src`` onto ``dst`` (opened
    exclusively: nobody else may hold the new volume), both with ``O_DIRECT``, then sync.

    :raises Refused: one line naming the copy and the cause (a read or write error, a
        device that ends before ``length``).
    """
    buffer = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    try:
        with memoryview(buffer) as whole:  # every view released before the buffer closes
            copy_blocks(src, dst, length, buffer, whole)
    except OSError as exc:
        raise Refused(f"copy {src} onto {dst}: {exc.strerror or exc}") from None
    finally:
        buffer.close()


def copy_blocks(src: str, dst: str, length: int, buffer: Any, whole: memoryview) -> None:
    source = os.open(src, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    try:
        target = os.open(dst, os.O_WRONLY | os.O_DIRECT | os.O_EXCL | os.O_CLOEXEC)
        try:
            offset = 0
            while offset < length:
                got = os.preadv(source, [buffer], offset)
                if got <= 0:
                    raise Refused(
                        f"copy {src} onto {dst}: it ends at {offset} bytes, before {length}"
                    )
                got = min(got, length - offset)
                done = 0
                while done < got:
                    with whole[done:got] as part:
                        written = os.pwritev(target, [part], offset + done)
                    if written <= 0:
                        raise Refused(f"copy {src} onto {dst}: it ends at {offset + done} bytes")
                    done += written
                offset += got
            os.fsync(target)
        finally:
            os.close(target)
    finally:
        os.close(source)
