"""A claim's own directory on a mounted export or share: made, removed or archived, never
through a symlink.

Public, for every backend that gives each claim a directory on a filesystem it mounts (nfs and
cifs use it): :mod:`flexhub.pathpattern` names the directory, this module makes and reclaims
it. What stays the backend's is how it reaches the storage: it mounts the export or share for
the provisioner on a private directory (its own mount code, credentials and timeouts) and hands
this module that directory (:func:`in_root`) or a descriptor of it (:func:`make`,
:func:`remove`, :func:`archive`).

Every step starts from the descriptor of the mounted root and walks one segment at a time with
``openat(O_NOFOLLOW | O_DIRECTORY)`` (``mkdirat`` where missing), so a symlink on the way
(planted by any client, served by a hostile server, an SMB reparse point or ``mfsymlinks``
file) is refused, never followed, and nothing is made, removed or renamed outside the root. A
path that is not plain and relative (empty, absolute, a ``.``, ``..`` or empty segment, a NUL)
is refused before anything is touched, whatever checked it before.

* :func:`make`: the claim's directory and missing parents. With a ``mode`` (a server that keeps
  POSIX owners and modes, as NFS does), missing parents get exactly :data:`PARENT_MODE` and the
  directory is made ``0700``, then given its owner (``fchown``) and mode (``fchmod``, after the
  chown, which may clear setgid) through its descriptor; if they cannot be set, a directory made
  by this call is removed again. Without one (an SMB server keeps modes itself and drops a
  client's chmod) directories are made asking :data:`PARENT_MODE` and nothing is chmodded.
  Never ``0777``. Found already (a retried call), it gets its owner and mode again and nothing
  else is made.
* :func:`remove`: ``shutil.rmtree`` with ``dir_fd`` of the parent: on Linux it walks by
  descriptors (``shutil.rmtree.avoids_symlink_attacks``) and never follows a symlink inside the
  tree; where it would, nothing is removed. A missing directory (or parent) is success.
* :func:`archive`: ``renameat`` of the directory to ``archived-<its name>`` beside it; a missing
  directory is success; an existing archive of that name is refused (never replaced).
* :func:`reclaim`: a PV's ``onDelete`` (``delete``, ``retain``, ``archive``) done on the
  directory its reclaim record names (:func:`flexhub.pathpattern.check_recorded`), which
  :func:`provisioned` wrote.
* :func:`bounded` and :func:`in_root`: all of this may block on a dead server, so it runs in a
  daemon thread that is given up after a bound (the caller then tears its mount down, which
  ends the wait).

.. versionadded:: 0.3
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import sys
import threading
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

from flexhub.backend import CommandTimeout, Frozen, InvalidOptions, VolumeError
from flexhub.node.statedir import process_alive
from flexhub.pathpattern import ARCHIVE_PREFIX, check_recorded
from flexhub.provisioning import Claim, Provisioned

__all__ = [
    "PARENT_MODE",
    "RECLAIM_TIMEOUT",
    "MountedRoot",
    "archive",
    "bounded",
    "in_root",
    "make",
    "provisioned",
    "reclaim",
    "remove",
    "temp_is_leftover",
    "temp_mount_point",
]

LOG = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Mode of a missing parent directory the pattern names (e.g. ``team`` in ``team/${pvName}``):
#: never world-writable, or any client could move claims' directories.
PARENT_MODE = 0o755
#: Seconds a reclaim's removal (or rename) of a claim's directory may take on the server: a
#: large tree takes a while; a dead server must still not hold a provisioner worker forever.
RECLAIM_TIMEOUT = 600.0
_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _Missing(VolumeError):
    """A directory on the way does not exist (and was not to be made)."""


def _segments(path: str, where: str) -> list[str]:
    parts = path.split("/")
    if "\0" in path or any(part in ("", ".", "..") for part in parts):
        raise VolumeError(f"{path[:80]!r} is not a plain relative path in the {where}: refused")
    return parts


def _open_dir(parent: int, name: str, shown: str, where: str) -> int:
    """A descriptor of the directory ``name`` below ``parent``, never through a symlink."""
    try:
        return os.open(name, _FLAGS, dir_fd=parent)
    except FileNotFoundError:
        raise _Missing(f"{shown} does not exist in the {where}") from None
    except OSError as exc:
        try:
            info = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except OSError:
            info = None
        if info is None or stat.S_ISDIR(info.st_mode):
            raise VolumeError(f"cannot open {shown} in the {where}: {exc.strerror}") from None
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise VolumeError(f"{shown} is {kind} in the {where}: refused") from None


def _child(
    parent: int, name: str, shown: str, where: str, *, made_mode: int, exact: int | None
) -> tuple[int, bool]:
    """Open (or make, ``made_mode``, then ``fchmod`` to ``exact`` if given) a directory."""
    try:
        return _open_dir(parent, name, shown, where), False
    except _Missing:
        pass
    made = True
    try:
        os.mkdir(name, made_mode, dir_fd=parent)
    except FileExistsError:
        made = False  # made concurrently: opened (and checked) below
    except OSError as exc:
        raise VolumeError(f"cannot make {shown} in the {where}: {exc.strerror}") from None
    fd = _open_dir(parent, name, shown, where)
    if made and exact is not None:
        try:
            os.fchmod(fd, exact)
        except OSError as exc:
            os.close(fd)
            raise VolumeError(f"cannot make {shown} in the {where}: {exc.strerror}") from None
    return fd, made


def _parent(root: int, path: str, where: str, *, create: bool, exact: bool) -> tuple[int, str]:
    """A descriptor of ``path``'s parent, walked (and made) safely, and the last segment."""
    parts = _segments(path, where)
    fd = os.dup(root)
    try:
        for index, name in enumerate(parts[:-1]):
            shown = "/".join(parts[: index + 1])
            if create:
                # one segment at a time, so that every parent made gets exactly PARENT_MODE
                # (never the umask's idea of it) where the server keeps modes
                child, _ = _child(
                    fd,
                    name,
                    shown,
                    where,
                    made_mode=0o700 if exact else PARENT_MODE,
                    exact=PARENT_MODE if exact else None,
                )
            else:
                child = _open_dir(fd, name, shown, where)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def make(
    root: int,
    path: str,
    *,
    owner: tuple[int, int] | None = None,
    mode: int | None = None,
    where: str = "export",
    hint: str = "",
) -> bool:
    """Make (or find) the directory ``path`` below the directory ``root``.

    :param root: a descriptor of the mounted export's or share's root (not consumed).
    :param owner: ``(uid, gid)`` given with ``fchown`` (``None``: the server's).
    :param mode: the directory's exact mode, given with ``fchmod`` after the chown; given,
        missing parents get exactly :data:`PARENT_MODE` too. ``None``: the server keeps modes.
    :param where: what ``root`` is, in messages (``"export"``, ``"share"``).
    :param hint: appended to the message when the owner or mode cannot be set.
    :returns: whether this call made it.
    :raises VolumeError: a bad path, a symlink or non-directory on the way, or the directory,
        its owner or its mode cannot be made or set (the directory made is removed again).
    """
    exact = mode is not None
    parent, leaf = _parent(root, path, where, create=True, exact=exact)
    try:
        fd, made = _child(
            parent, leaf, path, where, made_mode=0o700 if exact else PARENT_MODE, exact=None
        )
        try:
            if owner is not None:
                os.fchown(fd, *owner)
            if mode is not None:
                os.fchmod(fd, mode)
        except OSError as exc:
            if made:
                with contextlib.suppress(OSError):
                    os.rmdir(leaf, dir_fd=parent)
            given = [] if owner is None else [f"the owner {owner[0]}:{owner[1]}"]
            given += [] if mode is None else [f"mode {mode:04o}"]
            raise VolumeError(
                f"cannot give {path} {' and '.join(given)}: {exc.strerror}{hint}"
            ) from None
        finally:
            os.close(fd)
        return made
    finally:
        os.close(parent)


def _ignore_missing(func: Any, path: str, exc: Any) -> None:
    error = exc[1] if isinstance(exc, tuple) else exc
    if not isinstance(error, FileNotFoundError):  # removed meanwhile: that is the goal
        raise error


def remove(root: int, path: str, *, where: str = "export") -> bool:
    """Remove the directory ``path`` below ``root`` and everything in it (an entry of that
    name that is not a directory, a symlink included, is unlinked: only the entry goes).

    :returns: whether there was something to remove (``False``: already gone).
    :raises VolumeError: a bad path, a symlink on the way to it, or something cannot be removed.
    """
    if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover - not on Linux
        raise VolumeError("this platform's rmtree may follow symlinks: refusing to delete")
    try:
        parent, leaf = _parent(root, path, where, create=False, exact=False)
    except _Missing:
        return False
    try:
        try:
            info = os.stat(leaf, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return False
        try:
            if not stat.S_ISDIR(info.st_mode):
                os.unlink(leaf, dir_fd=parent)
            elif sys.version_info >= (3, 12):
                shutil.rmtree(leaf, dir_fd=parent, onexc=_ignore_missing)
            else:  # pragma: no cover - 3.11
                shutil.rmtree(leaf, dir_fd=parent, onerror=_ignore_missing)
        except OSError as exc:
            raise VolumeError(f"cannot remove {path} from the {where}: {exc.strerror}") from None
        return True
    finally:
        os.close(parent)


def archive(root: int, path: str, *, where: str = "export") -> str:
    """Rename the directory ``path`` below ``root`` to ``archived-<name>`` beside it.

    :returns: the archive's path, or ``""`` when the directory is already gone.
    :raises VolumeError: a bad path, a symlink on the way, or the archive's name is taken.
    """
    try:
        parent, leaf = _parent(root, path, where, create=False, exact=False)
    except _Missing:
        return ""
    shown = path[: -len(leaf)] + ARCHIVE_PREFIX + leaf
    try:
        try:
            os.stat(leaf, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return ""
        try:
            os.stat(ARCHIVE_PREFIX + leaf, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            raise VolumeError(f"cannot archive {path}: {shown} exists already")
        try:
            os.rename(leaf, ARCHIVE_PREFIX + leaf, src_dir_fd=parent, dst_dir_fd=parent)
        except FileNotFoundError:
            return ""  # archived (or removed) meanwhile by another call: gone is success
        except OSError as exc:
            raise VolumeError(f"cannot archive {path} as {shown}: {exc.strerror}") from None
        return shown
    finally:
        os.close(parent)


def bounded(func: Callable[[], _T], timeout: float, what: str) -> _T:
    """Run ``func`` in a daemon thread and wait at most ``timeout`` seconds for it.

    :raises CommandTimeout: ``func`` did not return in time (it is abandoned).
    """
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = func()
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="flexhub-walk", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CommandTimeout(f"{what} did not finish within {timeout:g}s")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def in_root(
    directory: Path, work: Callable[[int], _T], *, what: str, bound: float, server: str
) -> _T:
    """Run ``work(root_fd)`` on the mounted ``directory`` (opened as a directory), within
    ``bound`` seconds.

    :param what: the work, in the timeout's message (``"making a/b in host:/export"``).
    :param server: who did not answer, in the timeout's message (``"NFS server host"``).
    :raises CommandTimeout: ``server`` did not answer in time (the caller unmounts).
    """

    def run() -> _T:
        root = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return work(root)
        finally:
            os.close(root)

    try:
        return bounded(run, bound, what)
    except CommandTimeout:
        raise CommandTimeout(f"{server} did not answer within {bound:g}s while {what}") from None


def provisioned(
    claim: Claim,
    options: Mapping[str, str],
    path: str,
    *,
    fs_type: str = "",
    secret: tuple[str, str] | None = None,
) -> Provisioned:
    """What ``provision`` returns for the claim's directory ``path``: the claim's size (not
    enforced), the PV's ``options`` (whose ``subPath`` is ``path``) and the reclaim record
    :func:`reclaim` reads (the path and the claim's uid)."""
    return Provisioned(
        options=options,
        size=claim.size,
        reclaim={"path": path, "claimUid": claim.uid},
        fs_type=fs_type,
        secret=secret,
    )


class MountedRoot(Frozen):
    """The export or share as the backend reaches it for one reclaim.

    :param source: what it is, in log lines and messages (``"host:/exports/k8s"``).
    :param run: ``run(what, bound, work)`` mounts it, runs ``work(root_fd)`` within ``bound``
        seconds (:func:`in_root`), unmounts, and returns what ``work`` returned.
    :param where: ``"export"`` or ``"share"``, in messages.
    """

    __slots__ = ("source", "run", "where")  # noqa: RUF023 - the fields, in order
    source: str
    run: Callable[[str, float, Callable[[int], object]], object]
    where: str

    def __init__(
        self,
        source: str,
        run: Callable[[str, float, Callable[[int], object]], object],
        where: str = "export",
    ) -> None:
        self._set(source=source, run=run, where=where)


def reclaim(
    options: Mapping[str, str],
    reclaim: Mapping[str, str],
    *,
    honoured: Collection[str],
    location: str,
    root: Callable[[], MountedRoot],
) -> None:
    """Delete, archive (``archived-<name>`` beside it) or retain the recorded directory.

    Only the directory the reclaim record names, when it is the PV's ``subPath`` and its name
    holds the claim's uid (:func:`flexhub.pathpattern.check_recorded`), is touched; gone
    already is success.

    :param honoured: the backend's ``on_delete``.
    :param location: the export or share, in the ``retain`` log line (nothing is mounted).
    :param root: called once, after the checks, for what ``delete`` and ``archive`` work on.
    :raises InvalidOptions: an ``onDelete`` not honoured, or a reclaim record not to be trusted.
    """
    on_delete = reclaim.get("onDelete", "delete")
    if on_delete not in honoured:
        raise InvalidOptions(f"invalid onDelete {on_delete[:20]!r}: not one of {sorted(honoured)}")
    if on_delete == "retain":
        LOG.info("retaining %s/%s", location, reclaim.get("path"))
        return
    path = check_recorded(options, reclaim)
    mounted = root()
    where = mounted.where
    if on_delete == "archive":
        shown = mounted.run(
            f"archiving {path} in {mounted.source}",
            RECLAIM_TIMEOUT,
            lambda fd: archive(fd, path, where=where),
        )
        LOG.info("archived %s/%s as %s", mounted.source, path, shown or "(already gone)")
        return
    removed = mounted.run(
        f"removing {path} from {mounted.source}",
        RECLAIM_TIMEOUT,
        lambda fd: remove(fd, path, where=where),
    )
    LOG.info("removed %s/%s%s", mounted.source, path, "" if removed else " (already gone)")


def temp_mount_point(base: Path) -> Path:
    """A new private directory under ``base`` for one call's temporary mount of an export's
    root, named ``<unix time>-<pid>-<random>``: a collector tells a crashed call's leftover
    from a live call's mount by its name (the mounted directory's own times are the export
    root's, which may be years old while another worker or driver call uses it)."""
    import secrets
    import time

    path = base / f"{int(time.time())}-{os.getpid()}-{secrets.token_hex(6)}"
    path.mkdir(mode=0o700)
    return path


def temp_is_leftover(path: Path, now: float, max_age: float) -> bool:
    """Whether the temporary mount point ``path`` is a crashed call's: made more than
    ``max_age`` seconds ago by a process that is gone (its pid alive, even reused: kept). A
    name of the older form (no time, no pid) is judged by its directory's age, as before."""
    made, _, rest = path.name.partition("-")
    pid = rest.partition("-")[0]
    if made.isdigit() and pid.isdigit():
        return now - int(made) >= max_age and not process_alive(int(pid))
    return now - path.lstat().st_mtime >= max_age
