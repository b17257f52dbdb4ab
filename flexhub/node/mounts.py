"""The mount table (``/proc/self/mountinfo``), mounting, and unmounting with escalation."""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from flexhub.errors import CommandError, CommandTimeout, InvalidOptions, VolumeError
from flexhub.node.fastpath import escape_mount_path
from flexhub.node.frozen import Frozen
from flexhub.node.runner import CommandRunner

__all__ = [
    "BLOCK_MOUNT_FLAGS",
    "BLOCK_MOUNT_VALUES",
    "CORRUPTED_ERRNOS",
    "MOUNTINFO",
    "MountEntry",
    "MountTable",
    "bind_mount",
    "block_schema_pattern",
    "check_block_mount_options",
    "check_mount_options",
    "cleanup_mount_point",
    "is_corrupted",
    "mount",
    "remount",
    "unmount",
]

LOG = logging.getLogger(__name__)

MOUNTINFO = Path("/proc/self/mountinfo")

#: ``stat`` errors that mean a mount point is corrupted or stale (as ``IsCorruptedMnt``).
CORRUPTED_ERRNOS = frozenset(
    {
        errno.ENOTCONN,
        errno.ESTALE,
        errno.EIO,
        errno.EACCES,
        errno.EHOSTDOWN,
        errno.ETIMEDOUT,
        errno.EWOULDBLOCK,
        errno.ENODEV,
    }
)

#: How many mounts stacked on one path :func:`cleanup_mount_point` removes before giving up.
MAX_STACKED = 32

# Regular expressions are compiled on first use (re's cache), not when a mount imports this.
_OCTAL = r"\\([0-7]{3})"


def _unescape(field: str) -> str:
    if "\\" not in field:
        return field  # nothing escaped: most fields of most lines
    return re.sub(_OCTAL, lambda m: chr(int(m.group(1), 8)), field)


class MountEntry(Frozen):
    """One line of ``/proc/self/mountinfo`` (paths unescaped)."""

    # the fields, in order
    __slots__ = (  # noqa: RUF023
        "mount_id",
        "parent_id",
        "major_minor",
        "root",
        "mount_point",
        "options",
        "fs_type",
        "source",
        "super_options",
    )
    mount_id: int
    parent_id: int
    major_minor: str
    root: str
    mount_point: str
    options: tuple[str, ...]
    fs_type: str
    source: str
    super_options: tuple[str, ...]

    def __init__(
        self,
        mount_id: int,
        parent_id: int,
        major_minor: str,
        root: str,
        mount_point: str,
        options: tuple[str, ...],
        fs_type: str,
        source: str,
        super_options: tuple[str, ...],
    ) -> None:
        self._set(
            mount_id=mount_id,
            parent_id=parent_id,
            major_minor=major_minor,
            root=root,
            mount_point=mount_point,
            options=options,
            fs_type=fs_type,
            source=source,
            super_options=super_options,
        )

    @property
    def read_only(self) -> bool:
        """Whether this mount (the per-mount flags, not the superblock) is read-only."""
        return "ro" in self.options

    @classmethod
    def parse(cls, line: str) -> MountEntry:
        """Parse one mountinfo line.

        :raises ValueError: the line does not have the mountinfo shape.
        """
        fields = line.split()
        sep = fields.index("-", 6)
        if len(fields) < sep + 3:
            raise ValueError(f"short mountinfo line: {line!r}")
        return cls(
            mount_id=int(fields[0]),
            parent_id=int(fields[1]),
            major_minor=fields[2],
            root=_unescape(fields[3]),
            mount_point=_unescape(fields[4]),
            options=tuple(fields[5].split(",")),
            fs_type=_unescape(fields[sep + 1]),
            source=_unescape(fields[sep + 2]),
            super_options=tuple(fields[sep + 3].split(",")) if len(fields) > sep + 3 else (),
        )


def _norm(path: str | os.PathLike[str]) -> str:
    # No realpath: resolving a stale mount point can hang. Callers pass real paths.
    return os.path.normpath(os.path.abspath(os.fspath(path)))


class MountTable:
    """Questions about the node's mounts, answered from a fresh read of mountinfo each time.

    :param source: the mountinfo file (tests pass a fixture file).
    """

    def __init__(self, source: Path = MOUNTINFO) -> None:
        self.source = source

    def _text(self) -> str:
        try:
            return self.source.read_text("utf-8", errors="surrogateescape")
        except OSError as exc:
            raise VolumeError(f"cannot read {self.source}: {exc.strerror}") from None

    def entries(self) -> list[MountEntry]:
        """Every mount, in mountinfo order (malformed lines are skipped and logged)."""
        return parse_mountinfo(self._text())

    def _at_or_under(self, path: str, below: bool) -> list[MountEntry]:
        """The mounts at ``path`` (and below it): only their lines are parsed in full, so the
        cost stays small on a node with thousands of mounts."""
        exact = escape_mount_path(path)
        prefix = exact.rstrip("/") + "/"
        lines = []
        for line in self._text().splitlines():
            fields = line.split(" ", 5)
            if len(fields) < 5:
                continue
            point = fields[4]
            if point == exact or (below and point.startswith(prefix)):
                lines.append(line)
        return parse_mountinfo("\n".join(lines))

    def at(self, path: str | os.PathLike[str]) -> MountEntry | None:
        """The topmost mount whose mount point is exactly ``path``, or ``None``."""
        wanted = _norm(path)
        here = self._at_or_under(wanted, below=False)
        if not here:
            return None
        covered = {e.parent_id for e in here}
        top = [e for e in here if e.mount_id not in covered]
        return (top or here)[-1]

    def is_mount_point(self, path: str | os.PathLike[str]) -> bool:
        """Whether something is mounted exactly at ``path`` (no ``stat``: safe on stale mounts)."""
        return self.at(path) is not None

    def users_of(self, entry: MountEntry) -> list[MountEntry]:
        """Every mount of the same device (same ``major:minor``), ``entry`` itself included."""
        return [e for e in self.entries() if e.major_minor == entry.major_minor]

    def by_source(self, source: str) -> list[MountEntry]:
        """Every mount whose source is ``source`` (a device path or ``server:/export``)."""
        return [e for e in self.entries() if e.source == source]

    def under(self, path: str | os.PathLike[str]) -> list[MountEntry]:
        """Every mount whose mount point is ``path`` or below it."""
        return self._at_or_under(_norm(path), below=True)


def parse_mountinfo(text: str) -> list[MountEntry]:
    """Parse the text of a mountinfo file."""
    entries: list[MountEntry] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            entries.append(MountEntry.parse(line))
        except (ValueError, IndexError):
            LOG.warning("skipping malformed mountinfo line %r", line)
    return entries


def is_corrupted(path: Path, timeout: float = 5.0) -> bool:
    """Whether ``stat``/``statvfs`` of ``path`` fail like a stale mount, or hang past ``timeout``.

    A missing path is not corrupted. The ``stat`` runs in a daemon thread, so a hang costs
    ``timeout`` seconds and one parked thread, never the call.
    """
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            os.stat(path)
            # stat may be answered from the NFS attribute cache for up to a minute;
            # statvfs always asks the server
            os.statvfs(path)
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=probe, name=f"stat {path}", daemon=True)
    worker.start()
    worker.join(timeout)
    if not outcome:
        LOG.warning("stat of %s hung for %gs: treating it as a corrupted mount", path, timeout)
        return True
    error = outcome[0]
    if isinstance(error, OSError) and error.errno in CORRUPTED_ERRNOS:
        LOG.warning("%s is a corrupted mount point: %s", path, os.strerror(error.errno or 0))
        return True
    return False


_FORBIDDEN_EXACT = frozenset(
    {
        "remount",
        "bind",
        "rbind",
        "move",
        "loop",
        "owner",
        "user",
        "users",
    }
)
_FORBIDDEN_PREFIXES = (
    "make-",
    "x-",
    "loop=",
    "offset=",
    "sizelimit=",
    "encryption=",
    "helper=",
    "source=",
    "src=",
    "mkfs",
    "fsck",
    "fd=",
    "uhelper=",
    "comment=",
)
_OPTION_CHARS = r"[A-Za-z0-9_.=:/+-]+"


def check_mount_options(options: Iterable[str]) -> tuple[str, ...]:
    """Reject any mount option that could change what or how something is mounted.

    Defense in depth behind the backend schemas: no option may name another source, turn
    the mount into a bind/move/remount, change propagation, or smuggle in characters that
    ``mount`` or a helper could interpret.

    :returns: the options, unchanged, as a tuple.
    :raises InvalidOptions: naming the first forbidden option.
    """
    checked: list[str] = []
    for option in options:
        lowered = option.lower()
        if (
            not re.fullmatch(_OPTION_CHARS, option)
            or option.startswith(("-", "="))
            or lowered in _FORBIDDEN_EXACT
            or lowered.startswith(_FORBIDDEN_PREFIXES)
        ):
            raise InvalidOptions(f"mount option {option!r} is not allowed")
        checked.append(option)
    return tuple(checked)


#: Mount options of a filesystem on a block device (ext3, ext4, xfs) that a volume may ask
#: for; everything else is refused. Flags:
BLOCK_MOUNT_FLAGS = (
    "noatime",
    "nodiratime",
    "relatime",
    "strictatime",
    "lazytime",
    "nodev",
    "nosuid",
    "noexec",
    "sync",
    "dirsync",
    "discard",
    "nodiscard",
    "acl",
    "noacl",
    "user_xattr",
    "nouser_xattr",
    "barrier",
    "inode64",
    "nouuid",
)
#: ... and options with a value, each value a regular expression of the whole value.
BLOCK_MOUNT_VALUES = {
    "data": "(ordered|writeback|journal)",
    "errors": "(continue|remount-ro)",
    "commit": "([1-9]|[1-9][0-9]|[12][0-9]{2}|300)",
    "barrier": "1",
    "logbsize": "(16|32|64|128|256)k",
    "allocsize": "[1-9][0-9]{0,6}[kmg]?",
    "stripe": "[1-9][0-9]{0,8}",
}
#: Why some options that a volume might ask for are refused (the message of the Failure).
_BLOCK_REFUSED = {
    "errors=panic": "panics the whole node on the first filesystem error",
    "nobarrier": "risks a corrupt filesystem on a power cut",
    "barrier=0": "risks a corrupt filesystem on a power cut",
    "norecovery": "mounts without replaying the journal (a corrupt filesystem)",
    "noload": "mounts without replaying the journal (a corrupt filesystem)",
    "abort": "aborts the journal (a debugging option)",
    "debug": "is a debugging option",
    "dax": "maps the device straight into memory",
}
_BLOCK_REFUSED_PREFIXES = {
    "journal_path=": "names a device of the node",
    "journal_dev=": "names a device of the node",
    "logdev=": "names a device of the node",
    "rtdev=": "names a device of the node",
    "usrjquota=": "names a file of the node",
    "grpjquota=": "names a file of the node",
    "context=": "sets an SELinux label (the container runtime labels volumes)",
    "fscontext=": "sets an SELinux label (the container runtime labels volumes)",
    "defcontext=": "sets an SELinux label (the container runtime labels volumes)",
    "rootcontext=": "sets an SELinux label (the container runtime labels volumes)",
    "commit=": "must be 1 to 300 seconds",
}
_BLOCK_VALUE = (
    "|".join(BLOCK_MOUNT_FLAGS)
    + "|"
    + "|".join(f"{name}={value}" for name, value in BLOCK_MOUNT_VALUES.items())
)


def block_schema_pattern() -> str:
    """The ``blockMountOptions`` pattern of ``schemas/common.json``: the allow-list as a regex."""
    item = f"({_BLOCK_VALUE})"
    # $(?!\n): Python's $ also matches before a final newline (jsonschema uses re.search)
    return f"^$(?!\\n)|^{item}(,{item})*$(?!\\n)"


def check_block_mount_options(options: Iterable[str]) -> tuple[str, ...]:
    """Refuse every mount option of a block volume that is not on the allow-list.

    Nothing that can crash or hang the node (``errors=panic``), corrupt the filesystem
    (``nobarrier``, ``norecovery``), name a node's device or file (``journal_path=``,
    ``usrjquota=``), or set SELinux labels.

    :returns: the options, unchanged, as a tuple.
    :raises InvalidOptions: naming the first option refused, and why when it is known.
    """
    checked = tuple(check_mount_options(options))
    for option in checked:
        if re.fullmatch(_BLOCK_VALUE, option):
            continue
        lowered = option.lower()
        reason = _BLOCK_REFUSED.get(lowered) or next(
            (why for prefix, why in _BLOCK_REFUSED_PREFIXES.items() if lowered.startswith(prefix)),
            "is not on the allow-list of block-volume mount options (see docs/security.md)",
        )
        raise InvalidOptions(f"mount option {option!r} is not allowed: it {reason}")
    return checked


def mount(
    runner: CommandRunner,
    source: str,
    target: str | os.PathLike[str],
    fs_type: str | None = None,
    options: Sequence[str] = (),
    timeout: float | None = None,
    secrets: Sequence[str] = (),
) -> None:
    """``mount [-t FS] [-o OPTS] SOURCE TARGET``, options checked first.

    :raises InvalidOptions: a forbidden option.
    :raises CommandError: mount failed (secrets masked).
    """
    argv = ["mount"]
    if fs_type:
        argv += ["-t", fs_type]
    opts = check_mount_options(options)
    if opts:
        argv += ["-o", ",".join(opts)]
    argv += ["--", source, os.fspath(target)]
    runner(argv, timeout=timeout, secrets=secrets)


def remount(
    runner: CommandRunner,
    target: str | os.PathLike[str],
    options: Sequence[str],
    timeout: float | None = None,
) -> None:
    """``mount -o remount,OPTS TARGET`` (the caller chooses the options: not user input)."""
    runner(
        ["mount", "-o", ",".join(["remount", *options]), "--", os.fspath(target)], timeout=timeout
    )


def bind_mount(
    runner: CommandRunner,
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    read_only: bool,
    table: MountTable | None = None,
    timeout: float | None = None,
) -> None:
    """Bind-mount ``source`` on ``target``; if ``read_only``, remount the bind read-only.

    The read-only flag is verified in mountinfo: a bind that stayed writable is undone and
    reported as a failure.

    :raises VolumeError: the bind did not become read-only.
    """
    table = table or MountTable()
    runner(["mount", "--bind", "--", os.fspath(source), os.fspath(target)], timeout=timeout)
    if not read_only:
        return
    try:
        runner(["mount", "-o", "remount,bind,ro", "--", os.fspath(target)], timeout=timeout)
        entry = table.at(target)
        if entry is None or not entry.read_only:
            raise VolumeError(f"bind mount on {target} did not become read-only")
    except (CommandError, VolumeError):
        try:
            unmount(runner, target, timeout or 30.0, table)
        except CommandError as exc:
            LOG.error("cannot undo the writable bind mount on %s: %s", target, exc)
        raise


def _gone(table: MountTable, path: str, before: MountEntry) -> bool:
    now = table.at(path)
    return now is None or now.mount_id != before.mount_id


def unmount(
    runner: CommandRunner,
    path: str | os.PathLike[str],
    timeout: float,
    table: MountTable | None = None,
) -> None:
    """Remove the topmost mount at ``path``: ``umount``, then ``umount -f``, then ``umount -l``.

    Each step is bounded by ``timeout``. Nothing mounted there is success. The outcome of each
    step is judged by re-reading mountinfo, not by umount's exit status.

    :raises CommandError: every step failed and the mount is still there.
    """
    table = table or MountTable()
    where = _norm(path)
    before = table.at(where)
    if before is None:
        return
    last: CommandError | None = None
    for flags in ((), ("-f",), ("-l",)):
        try:
            # -c: no canonicalisation, which would stat a dead mount and hang
            runner(["umount", "-c", *flags, "--", where], timeout=timeout)
        except CommandError as exc:
            last = exc
            if _gone(table, where, before):
                return
            LOG.warning("umount %s %s failed, escalating: %s", " ".join(flags), where, exc)
            continue
        if _gone(table, where, before):
            return
        last = CommandError(f"umount {where} succeeded but it is still mounted")
    assert last is not None
    if isinstance(last, CommandTimeout):
        raise last
    raise CommandError(f"cannot unmount {where}: {last}", returncode=last.returncode)


def cleanup_mount_point(
    runner: CommandRunner,
    path: str | os.PathLike[str],
    timeout: float,
    table: MountTable | None = None,
) -> None:
    """Unmount every mount stacked on ``path``, stale or corrupted ones included.

    The directory itself stays (kubelet removes it). A path that does not exist, or where
    nothing is mounted, is success.

    :raises CommandError: a mount could not be removed, even lazily.
    """
    table = table or MountTable()
    where = _norm(path)
    for _ in range(MAX_STACKED):
        if not table.is_mount_point(where):
            return
        unmount(runner, where, timeout, table)
    if table.is_mount_point(where):
        raise CommandError(f"more than {MAX_STACKED} mounts stacked on {where}")
