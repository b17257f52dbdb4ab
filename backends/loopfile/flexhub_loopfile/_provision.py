"""Dynamic provisioning of loopfile volumes: a file per claim, made by the node's first mount
and removed by the node's flexhub DaemonSet pod.

:func:`provision` runs in the provisioner and touches no storage: it names the claim's file,
``<directory>/pvc-<claim uid>.img`` (``directory`` defaults to ``provisioned``), and returns
the PV options ``{file, size, maxSize}`` for the node the scheduler chose: a claim larger
than the class's ``maxSize`` (default 1Ti) is refused here, and the node's ``expandfs`` refuses
growing the volume past the bound its PV carries. The node's room is not known here: the
node checks it when the file is made or grown. The driver's ``mount`` on that
node creates the file at that size, as it creates any file it never made, in the claim's namespace
area when ``[loopfile] isolation`` is ``namespace``. The file's size is a real limit: the
filesystem cannot grow past it (only ``expandfs`` grows it, on a PVC resize).

:func:`reclaim` runs on that node (``reclaim_on = "node"``) and removes the file:

* idempotent: a file (or directory) already gone is success; ``onDelete: retain`` keeps it;
* refused (a :class:`~flexhub.backend.VolumeError`, nothing removed) while the node's journal
  has a pod or volume record of it, a deferred release of it, or a loop device maps it;
* never through a symlink: every directory below the loopfile root (``namespaces/<ns>/``
  too) is opened with ``O_NOFOLLOW``, one at a time, and the file is checked (``lstat`` at
  its directory) to be a regular file; a symlink or anything else at its place is refused
  and left alone;
* under the volume's lock (what a mount of it holds) and the root account's lock (what a file
  creation beside it holds); the node's record that it made the file
  (:mod:`flexhub_loopfile._made`) goes with it. The room account
  (:mod:`flexhub_loopfile._room`) keeps no record per file: it measures the root on each
  creation or growth, so the removed file is simply no longer counted.

With isolation on, the file of a volume mounted before isolation was turned on is at the old
place, ``<root>/<file>``; both places are reclaimed (the name holds the claim's uid).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from flexhub.backend import InvalidOptions, Node, VolumeError
from flexhub.provisioning import Claim, Provisioned
from flexhub_loopfile import _loop, _made, _room, _tenancy
from flexhub_loopfile._quantity import parse_quantity, quantity

__all__ = ["DEFAULT_DIRECTORY", "DEFAULT_MAX_SIZE", "file_of", "max_size", "provision", "reclaim"]

LOG = logging.getLogger(__name__)

#: Where a class's files go unless its ``directory`` parameter says otherwise.
DEFAULT_DIRECTORY = "provisioned"
#: The largest claim (and growth) of a class without a ``maxSize`` parameter.
DEFAULT_MAX_SIZE = "1Ti"
#: So that ``<directory>/pvc-<63-character uid>.img`` stays within the 255 of option ``file``.
MAX_DIRECTORY = 180
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")
_UID = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: The name :func:`file_of` gives a claim's file: the only name :func:`reclaim` removes.
_PROVISIONED_NAME = re.compile(r"pvc-[a-z0-9][a-z0-9-]{0,62}\.img")


def _directory(parameters: Mapping[str, str]) -> str:
    text = parameters.get("directory", DEFAULT_DIRECTORY)
    parts = text.split("/")
    if len(text) > MAX_DIRECTORY or not all(
        _SEGMENT.fullmatch(p) and p not in (".", "..") for p in parts
    ):
        raise InvalidOptions(
            f"parameter 'directory': {text[:80]!r} must be a relative path of at most "
            f"{MAX_DIRECTORY} characters, letters, digits and _ . + - (no '.' or '..' segment)"
        )
    if parts[0] in (_tenancy.AREA, _tenancy.SNAPSHOTS):
        raise InvalidOptions(
            f"parameter 'directory': {text[:80]!r} must not start with {parts[0]!r} "
            "(the loopfile root's namespace areas and snapshots)"
        )
    return text


def max_size(parameters: Mapping[str, str]) -> tuple[str, int]:
    """The class's ``maxSize`` as written and in bytes (default :data:`DEFAULT_MAX_SIZE`).

    :raises InvalidOptions: naming parameter ``maxSize``.
    """
    text = parameters.get("maxSize", DEFAULT_MAX_SIZE)
    try:
        return text, parse_quantity(text)
    except ValueError as exc:
        raise InvalidOptions(f"parameter 'maxSize': {exc}") from None


def file_of(claim: Claim, parameters: Mapping[str, str]) -> str:
    """The ``file`` option of the claim's volume: ``<directory>/pvc-<uid>.img``."""
    if not _UID.fullmatch(claim.uid):
        raise InvalidOptions(f"claim uid {claim.uid[:80]!r} is not a Kubernetes uid")
    return f"{_directory(parameters)}/{claim.volume_name}.img"


def provision(claim: Claim, parameters: Mapping[str, str]) -> Provisioned:
    """The PV of ``claim`` (nothing is made here: the node's mount creates the file).

    The same claim always gives the same answer, so a provisioner that crashed before saving
    the PV and provisions again leaks nothing.

    :raises InvalidOptions: the claim has no selected node (the class is not
        ``WaitForFirstConsumer``), no size or one larger than the class's ``maxSize``, or a
        parameter is wrong.
    """
    if not claim.selected_node:
        raise InvalidOptions(
            "volumeBindingMode: a loopfile volume lives on one node, so its StorageClass must "
            "be WaitForFirstConsumer (the claim has no selected node)"
        )
    if claim.size <= 0:
        raise InvalidOptions("resources.requests.storage: a loopfile claim needs a size")
    shared = sorted(set(claim.access_modes) - {"ReadWriteOnce", "ReadWriteOncePod"})
    if shared:
        raise InvalidOptions(
            f"accessModes: a loopfile volume is one node's, so {', '.join(shared)} cannot be "
            "honoured (use ReadWriteOnce or ReadWriteOncePod)"
        )
    bound, most = max_size(parameters)
    if claim.size > most:
        raise InvalidOptions(
            f"resources.requests.storage: {quantity(claim.size)} is more than this class's "
            f"maxSize {bound} (parameters.maxSize, default {DEFAULT_MAX_SIZE}): ask for less, or "
            "use a class that allows more"
        )
    # the PV carries the bound: the node's expandfs refuses growing past it
    options = {"file": file_of(claim, parameters), "size": str(claim.size), "maxSize": bound}
    for key in ("preallocate", "mountOptions"):
        if parameters.get(key):
            options[key] = parameters[key]
    block = 4096
    return Provisioned(
        options=options,
        size=-(-claim.size // block) * block,
        # claimUid: the provisioner checks it is the PV's own (pvc-<uid>), reclaim that the
        # file is named from it, so an edited file option cannot name another claim's file
        reclaim={"namespace": claim.namespace, "claimUid": claim.uid},
        fs_type=parameters.get("fsType", ""),
        node=claim.selected_node,
    )


def _check_provisioned(text: str, isolated: bool) -> None:
    """Refuse a ``file`` that :func:`file_of` cannot have written (a hand-edited PV): only
    ``<directory>/pvc-<uid>.img`` is reclaimed, and with isolation on never one whose path
    starts in the namespaces' areas (its pre-isolation place would be another namespace's).

    :raises InvalidOptions: naming option ``file``; nothing is removed.
    """
    parts = text.split("/")
    if not _PROVISIONED_NAME.fullmatch(parts[-1]) or len(parts) < 2:
        raise InvalidOptions(
            f"option 'file' {text[:80]!r} is not <directory>/pvc-<uid>.img, the name "
            "provisioning gives: refusing to reclaim (was the PV edited?)"
        )
    if isolated and parts[0] == _tenancy.AREA:
        raise InvalidOptions(
            f"option 'file' {text[:80]!r} starts in the namespaces' areas: refusing to reclaim"
        )


def _places(settings: Mapping[str, object], namespace: str) -> list[list[str]]:
    """The directories (below the root, as parts) the file may be in, likeliest first."""
    if not _tenancy.isolated(settings):
        return [[]]
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", namespace):
        raise InvalidOptions(
            f"reclaim namespace {namespace[:80]!r} is not a namespace name: the PV's reclaim "
            "record is not one flexhub wrote"
        )
    return [[_tenancy.AREA, namespace], []]


@contextlib.contextmanager
def _open_parent(base: Path, parts: list[str]) -> Iterator[int | None]:
    """The descriptor of ``base/parts...`` opened one directory at a time without following a
    symlink, or ``None`` when one of them does not exist.

    :raises VolumeError: one of them is a symlink or not a directory.
    """
    fds: list[int] = []
    try:
        try:
            fds.append(os.open(base, _DIR_FLAGS))
            for part in parts:
                fds.append(os.open(part, _DIR_FLAGS, dir_fd=fds[-1]))
        except FileNotFoundError:
            yield None
            return
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise VolumeError(
                    f"refusing to reclaim under {base}/{'/'.join(parts)}: a directory on the "
                    "way is a symlink or not a directory (left alone)"
                ) from None
            raise VolumeError(f"cannot open {base}: {exc.strerror}") from None
        yield fds[-1]
    finally:
        for fd in fds:
            os.close(fd)


def _in_use(node: Node, path: Path, identity: tuple[int, int]) -> str:
    """Why ``path`` is in use on this node (``""``: it is not)."""
    volume_id = f"loopfile:{path}"
    journal = node.journal
    for record in journal.volumes():
        files = {record.details.get("file"), record.partial.get("file")}
        if record.volume_id == volume_id or str(path) in files:
            return f"the node's journal has its staged volume ({record.staging})"
    for pod in journal.pods():
        if pod.volume_id == volume_id:
            return f"the node's journal has it mounted for a pod ({pod.target})"
    if volume_id in journal.deferred():
        return "its release is deferred on this node"
    for dev in _loop.devices():
        if dev.backing_identity() == identity:
            return f"{dev.path} maps it"
    return ""


def _reclaim_at(node: Node, root: Path, parts: list[str]) -> bool:
    """Remove ``root/parts...`` if it is an unused regular file; whether one was removed."""
    path = root.joinpath(*parts)
    with _open_parent(root, parts[:-1]) as parent:
        if parent is None:
            return False
        try:
            st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            raise VolumeError(
                f"refusing to reclaim {path}: it is not a regular file (a symlink?): left alone"
            )
        why = _in_use(node, path, (st.st_dev, st.st_ino))
        if why:
            raise VolumeError(f"refusing to reclaim {path} while it is in use: {why}")
        for entry in os.listdir(parent):  # what an interrupted creation of it left
            if entry.startswith(f".{parts[-1]}.") and entry.endswith(_room.NEW_SUFFIX):
                with contextlib.suppress(OSError):
                    os.unlink(entry, dir_fd=parent)
        try:
            again = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
                raise VolumeError(f"refusing to reclaim {path}: it changed meanwhile")
            os.unlink(parts[-1], dir_fd=parent)
            os.fsync(parent)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise VolumeError(f"cannot remove {path}: {exc.strerror}") from None
    LOG.info("reclaimed %s (%d bytes)", path, st.st_size)
    return True


def reclaim(
    node: Node,
    root: Path,
    text: str,
    reclaim_record: Mapping[str, str],
    room_lock: Callable[[], contextlib.AbstractContextManager[None]],
) -> None:
    """Remove the claim's file on this node (see the module); ``text`` is the PV's checked
    ``file`` option, ``room_lock`` takes the lock on the root's account.

    :raises VolumeError: the file is in use, or not a regular file: nothing was removed.
    :raises InvalidOptions: an ``onDelete`` loopfile does not honour.
    """
    on_delete = reclaim_record.get("onDelete", "delete")
    if on_delete == "retain":
        LOG.info("onDelete retain: keeping %s", text)
        return
    if on_delete != "delete":
        raise InvalidOptions(f"onDelete {on_delete[:80]!r}: loopfile honours delete and retain")
    _check_provisioned(text, _tenancy.isolated(node.settings))
    uid = reclaim_record.get("claimUid")
    if not uid:
        # both reclaim paths fill it from the PV's name (which cannot be edited): a record
        # without one must not choose which namespace's file goes
        raise InvalidOptions("the reclaim record names no claimUid: refusing to reclaim")
    if text.rsplit("/", 1)[-1] != f"pvc-{uid}.img":
        raise InvalidOptions(
            f"option 'file' {text[:80]!r} is not the file of claim {uid[:80]!r} (the reclaim "
            "record's claimUid): refusing to reclaim (was the PV edited?)"
        )
    removed = False
    for place in _places(node.settings, reclaim_record.get("namespace", "")):
        parts = [*place, *text.split("/")]
        # the volume's lock (a mount of it holds it), then the account's (a creation holds it)
        with node.lock("volume", f"loopfile:{root.joinpath(*parts)}"), room_lock():
            removed |= _reclaim_at(node, root, parts)
            # after the file: a reclaim that stops between the two is retried (the PV keeps
            # its finalizer), finds the file gone and forgets it then
            _made.forget(node.state_dir, root.joinpath(*parts))
    if not removed:
        LOG.info("%s is already gone: nothing to reclaim", text)
