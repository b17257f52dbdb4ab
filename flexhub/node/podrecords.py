"""Where a block volume is staged and which pods use it: paths, locks, pod records.

A block volume is mounted once per node on ``<state_dir>/staging/<sha256(volume id)[:32]>``
and bound into each pod directory. Who uses a staging mount is derived from the journal's
pod records and checked against mountinfo (:func:`_users`), so the count heals after a
crash or a reboot. Also the journal glue every mount and unmount shares: a record moved to
its resolved pod directory, a secret never journalled, a record forgotten after the unmount
it describes.

Locks: ``("volume", volume id)`` then ``("staging", staging dir)`` (:func:`_volume_locks`),
taken under the caller's ``("pod", target)`` lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from flexhub.backend import Backend
from flexhub.errors import MIN_SECRET_CHARS, BackendError, FlexhubError, StateError
from flexhub.node import Node
from flexhub.node.journal import PodRecord
from flexhub.node.mounts import MountEntry
from flexhub.volume import Volume

__all__ = [
    "RAW_DETAILS",
    "is_raw",
    "is_staging_point",
    "journalled_staging",
    "live_raw_record",
    "pod_dir",
    "raw_consumers",
    "staging_dir",
    "staging_key",
]

LOG = logging.getLogger(__name__)


#: Key of the pod's namespace in a volume record's options (never one of a backend's keys).
_NAMESPACE = "kubernetes.io/pod.namespace"
_K = TypeVar("_K", str, Path)


def staging_dir(node: Node, volume_id: str, co_staging: Path | None = None) -> Path:
    """The directory where the block volume ``volume_id`` is mounted once for the node.

    ``<state_dir>/staging/<sha256(volume id)[:32]>``. For a volume staged for a CO
    (``co_staging``: CSI's ``staging_target_path``), that path repeated below it:
    ``<hash>/var/lib/kubelet/plugins/kubernetes.io/csi/<driver>/<sha>/globalmount``. The
    kubelet unstages a volume only when no other mount of the staged filesystem exists but
    those whose path contains the staging path's part from ``/plugins/kubernetes.io/`` on
    (mount-utils ``HasMountRefs``: mounts of kubelet's own directories seen under another root), and
    flexhub's own staging mount is one. The path is normalised first (no ``..`` can climb).
    """
    from flexhub.node.fastpath import sha256

    digest = sha256(volume_id.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    base = _staging_root(node) / digest
    if co_staging is None:
        return base
    repeated = os.path.normpath(os.path.abspath(co_staging)).lstrip("/")
    return base / repeated if repeated else base


def journalled_staging(node: Node, volume_id: str) -> Path:
    """Where the journal says ``volume_id`` is staged (else :func:`staging_dir`)."""
    record = node.journal.get_volume(volume_id)
    if record is not None and record.staging:
        return Path(record.staging)
    return staging_dir(node, volume_id)


def is_staging_point(node: Node, point: str | os.PathLike[str]) -> bool:
    """Whether ``point`` is a staging mount point of this node (a volume's, at any depth)."""
    return os.fspath(point).startswith(f"{_staging_root(node)}/")


def staging_key(node: Node, staging: Path) -> str:
    """The hash that names the volume of the staging directory ``staging``."""
    try:
        return staging.relative_to(_staging_root(node)).parts[0]
    except (ValueError, IndexError):
        return staging.name


def _staging_root(node: Node) -> Path:
    # mountinfo shows resolved paths; state_dir is ours (never stale), so resolving is safe.
    return Path(os.path.realpath(node.state_dir)) / "staging"


def _abs(target: Path) -> Path:
    return Path(os.path.normpath(os.path.abspath(target)))


def pod_dir(target: Path) -> Path:
    """The pod volume directory as mountinfo names it: kubelet's directories resolved.

    Operators often make ``/var/lib/kubelet`` (or ``.../pods``) a symlink to a data disk;
    kubelet passes the path as configured, mountinfo shows the resolved one. Only the parent
    (kubelet's own directory, never a volume) is resolved; the last component is appended as
    given, because resolving a possibly stale mount point can hang.
    """
    absolute = _abs(target)
    return Path(os.path.realpath(absolute.parent)) / absolute.name


def _adopt_pod_record(node: Node, given: Path, target: Path) -> None:
    """Move a pod record keyed by the unresolved path ``given`` (older flexhub) to ``target``.

    The caller holds the pod lock; a record already under ``target`` wins.
    """
    if given == target or node.journal.get_pod(target) is not None:
        return
    old = node.journal.get_pod(given)
    if old is None:
        return
    LOG.info("pod record of %s moves to its resolved path %s", given, target)
    try:
        node.journal.put_pod(old.replace(target=str(target)))
        node.journal.delete_pod(given)
    except StateError as exc:  # a read-only state_dir: the mount table still tells
        LOG.warning("cannot move the pod record of %s: %s", given, exc)


def _backend_name(node: Node, backend: Backend, volume: Volume) -> str:
    return volume.backend or node.backend or type(backend).__name__


def _check_no_secret(backend_name: str, details: dict[str, str], volume: Volume) -> None:
    # Whole values only: a CHAP user name inside an IQN, or a one-letter value, is no leak;
    # nor is a value the volume's own options hold in the open (a CHAP user name equal to
    # initiatorName): the PV shows it already.
    public = set(volume.options.values())
    secrets = {
        form
        for secret in volume.secrets.revealed()
        if not {secret, secret.strip()} & public
        for form in (secret, secret.strip())
        if len(form) >= MIN_SECRET_CHARS
    }
    for key, value in details.items():
        if value in secrets or value.strip() in secrets or key in secrets:
            raise BackendError(
                f"backend {backend_name!r} returned a secret in its details ({key!r}): "
                "refusing to journal it"
            )


#: A raw consumer's pod record says so in its details: a filesystem stage of the volume is
#: refused while one is journalled (:func:`raw_consumers`).
RAW_DETAILS = {"access": "raw"}


def is_raw(record: PodRecord) -> bool:
    """Whether ``record`` is a raw consumer's (:data:`RAW_DETAILS`)."""
    return record.details.get("access") == RAW_DETAILS["access"]


def _raw_is_live(node: Node, record: PodRecord) -> bool:
    """Whether the raw consumer of ``record`` may still use its device: the volume's record
    is there (pending, unreadable or not: only its absence proves nothing is attached) and
    the consumer's directory exists (CSI's staging target path exists while it is staged)."""
    return node.journal.has_volume(record.volume_id) and os.path.isdir(record.target)


def _prune_raw(node: Node, record: PodRecord) -> None:
    LOG.info(
        "pruning the raw pod record of %s (%s is not attached, or the directory is gone)",
        record.target,
        record.volume_id,
    )
    with contextlib.suppress(FlexhubError):
        node.journal.delete_pod(record.target)


def raw_consumers(node: Node, volume_id: str) -> list[str]:
    """The targets ``volume_id`` is attached raw for on this node (journalled, the call done
    or interrupted): while there is one, its device is never formatted or mounted, nor
    released.

    A raw record is stale once nothing is attached (no volume record at all: its release
    could not delete it, a read-only journal then) or its directory is gone (kubelet forgot
    it): such records are pruned. The caller holds the volume's lock.
    """
    live = []
    for record in node.journal.pods_of(volume_id):
        if not is_raw(record):
            continue
        if _raw_is_live(node, record):
            live.append(record.target)
        else:
            _prune_raw(node, record)
    return live


def live_raw_record(node: Node, target: Path) -> PodRecord | None:
    """The raw consumer's record of ``target`` while it may use its device (no pruning: the
    caller need not hold that volume's lock)."""
    record = node.journal.get_pod(target)
    if record is not None and is_raw(record) and _raw_is_live(node, record):
        return record
    return None


@contextlib.contextmanager
def _volume_locks(node: Node, volume_id: str | None, staging: Path) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if volume_id is not None:
            stack.enter_context(node.lock("volume", volume_id))
        stack.enter_context(node.lock("staging", str(staging)))
        yield


def _same_device(entry: MountEntry | None, other: MountEntry | None) -> bool:
    return entry is not None and other is not None and entry.major_minor == other.major_minor


def _device_number(device: str) -> str | None:
    try:
        rdev = os.stat(device).st_rdev
    except OSError:
        return None
    return f"{os.major(rdev)}:{os.minor(rdev)}"


def _users(node: Node, staging: Path, exclude: Path) -> list[str]:
    """The pod directories still bound to the staging mount (journal checked by mountinfo).

    Pod records of this staging directory whose target is no longer bound to it are stale
    (a crash, a reboot) and are pruned; the caller holds the volume's locks, so no mount of
    it is in flight. Binds found in mountinfo but missing from the journal (a lost record)
    count too: a staging mount is never pulled from under a pod.
    """
    staged = node.mounts.at(staging)
    users: set[str] = set()
    for record in node.journal.pods():
        if record.staging != str(staging) or record.target == str(exclude):
            continue
        if is_raw(record):
            # A raw consumer's directory is never a mount point: it uses the device while
            # the device is attached, whatever mountinfo says (:func:`raw_consumers`).
            if _raw_is_live(node, record):
                users.add(record.target)
            else:
                _prune_raw(node, record)
            continue
        bound = node.mounts.at(record.target)
        if _same_device(bound, staged):
            users.add(record.target)
        else:
            LOG.info("pruning stale pod record of %s (not bound to %s)", record.target, staging)
            with contextlib.suppress(FlexhubError):
                node.journal.delete_pod(record.target)
    if staged is not None:
        copy = _copy_suffix(node, staging)
        for entry in node.mounts.users_of(staged):
            point = entry.mount_point
            if point in (str(staging), str(exclude)) or point in users:
                continue
            if is_staging_point(node, point):
                continue  # another staging dir of the same device: not a pod
            if copy is not None and point.endswith(copy):
                continue  # the staging mount itself, propagated to a peer of the state dir
            LOG.warning("%s is bound to %s without a pod record: counting it", point, staging)
            users.add(point)
    return sorted(users)


def _copy_suffix(node: Node, staging: Path) -> str | None:
    """The end of the path of any copy of the staging mount ``staging`` that mount
    propagation makes at a peer of the state directory (``/staging/<hash>[/<CO path>]``):
    no pod directory ends so."""
    try:
        return "/" + str(staging.relative_to(_staging_root(node).parent))
    except ValueError:
        return None


def _forget(delete: Callable[[_K], None], key: _K, notes: list[str]) -> None:
    """Delete a journal record after the unmount it describes: a failure is only a warning
    (the next call finds nothing mounted and deletes it then)."""
    try:
        delete(key)
    except StateError as exc:
        LOG.warning("unmounted, but the journal was not updated: %s", exc)
        notes.append(f"journal not updated: {exc}")


def _guess_staging(node: Node, target: Path) -> tuple[Path | None, str | None]:
    """Without a pod record: find the staging mount ``target`` is a bind of, from mountinfo."""
    here = node.mounts.at(target)
    if here is None:
        return None, None
    for entry in node.mounts.users_of(here):
        if entry.mount_point != str(target) and is_staging_point(node, entry.mount_point):
            staging = Path(entry.mount_point)
            record = node.journal.volume_by_staging(staging)
            LOG.warning(
                "no readable record for %s: it is a bind of %s (volume %s)",
                target,
                staging,
                record.volume_id if record else "unknown",
            )
            return staging, record.volume_id if record else None
    return None, None
