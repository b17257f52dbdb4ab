"""The state journal: one durable JSON record per pod volume directory and per staged volume.

Layout under ``state_dir``::

    pods/<sha256(target)>.json        PodRecord: a pod directory flexhub mounted
    volumes/<sha256(volume_id)>.json  VolumeRecord: a block device attached and staged once
    deferred/<sha256(volume_id)>      a volume whose release waits for its storage (its id)
    formats/<sha256(volume_id)>.json  a format flexhub began on the volume's device and has
                                      not seen finish (see :mod:`flexhub.node.formatintent`)

Every file is written atomically (temporary file in the same directory, ``fsync``, rename,
``fsync`` of the directory), mode 0600, and carries ``"version"``: :data:`SCHEMA_VERSION`.
The temporary is named ``.<name>.<pid>.tmp``; one that a killed writer left is removed by the
next call that writes or deletes a record in that directory, once that pid is gone
(:func:`~flexhub.node.statedir.remove_dead_temporaries`).
Records hold only what is needed to undo a mount, **never a secret**. A record that cannot be
read (corrupt, half-written, unknown version, wrong shape) is logged and treated as missing;
callers then fall back to the mount table. Unknown extra fields are ignored, so a later
release may add fields without breaking this one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from flexhub.errors import StateError
from flexhub.node.fastpath import pod_record_path, sha256
from flexhub.node.frozen import Frozen
from flexhub.node.statedir import (
    fsync_directory,
    private_dir,
    remove_dead_temporaries,
    write_atomically,
)

__all__ = ["SCHEMA_VERSION", "DeferredRelease", "Journal", "PodRecord", "VolumeRecord"]

LOG = logging.getLogger(__name__)

SCHEMA_VERSION = 1

#: The temporaries of :meth:`Journal._write_bytes`: ``.<record file name>.<pid>.tmp``.
TEMPORARY = re.compile(r"\.[0-9a-f]{64}(?:\.json)?\.(?P<pid>[0-9]{1,10})\.tmp")


class PodRecord(Frozen):
    """A pod volume directory flexhub mounted.

    ``staging`` is set for block volumes (the target is a bind of it), ``None`` for
    filesystem backends (the backend mounted ``target`` itself).
    """

    # the fields, in order
    __slots__ = (  # noqa: RUF023
        "target",
        "backend",
        "volume_id",
        "staging",
        "read_only",
        "details",
        "created",
    )
    target: str
    backend: str
    volume_id: str
    staging: str | None
    read_only: bool
    details: dict[str, str]
    created: float

    def __init__(
        self,
        target: str,
        backend: str,
        volume_id: str,
        staging: str | None = None,
        read_only: bool = False,
        details: dict[str, str] | None = None,
        created: float | None = None,
    ) -> None:
        self._set(
            target=target,
            backend=backend,
            volume_id=volume_id,
            staging=staging,
            read_only=read_only,
            details={} if details is None else details,
            created=time.time() if created is None else created,
        )


class VolumeRecord(Frozen):
    """A block device attached by a backend and mounted once on a staging directory.

    Written first as an *intent* (``device == ""``) before the backend attaches anything, with
    the volume's ``options`` (the backend's own keys, never a secret). While the backend
    attaches, what it reports having done (``Node.record_progress``: a loop device attached,
    the portals logged in) is merged into ``partial`` and journalled at once, so that a crash
    during attach is undone by releasing exactly that (``BlockBackend.release``). A backend
    that reports nothing is asked to attach again (idempotent) and detach, as before.
    """

    # the fields, in order
    __slots__ = (  # noqa: RUF023
        "volume_id",
        "backend",
        "device",
        "staging",
        "fs_type",
        "details",
        "created",
        "options",
        "partial",
        "access",
    )
    volume_id: str
    backend: str
    device: str
    staging: str
    fs_type: str
    details: dict[str, str]
    created: float
    options: dict[str, str]
    partial: dict[str, str]
    #: The backend's connection identity (:meth:`BlockBackend.access`), never a secret.
    access: dict[str, str]

    def __init__(
        self,
        volume_id: str,
        backend: str,
        device: str,
        staging: str,
        fs_type: str,
        details: dict[str, str] | None = None,
        created: float | None = None,
        options: dict[str, str] | None = None,
        partial: dict[str, str] | None = None,
        access: dict[str, str] | None = None,
    ) -> None:
        self._set(
            volume_id=volume_id,
            backend=backend,
            device=device,
            staging=staging,
            fs_type=fs_type,
            details={} if details is None else details,
            created=time.time() if created is None else created,
            options={} if options is None else options,
            partial={} if partial is None else partial,
            access={} if access is None else access,
        )

    @property
    def pending(self) -> bool:
        """Whether this is an intent written before the attach returned."""
        return not self.device


_R = TypeVar("_R", PodRecord, VolumeRecord)

_KINDS: dict[type[Any], str] = {PodRecord: "pod", VolumeRecord: "volume"}
_MAP = "dict[str, str]"
#: Each field's type as written in the record, and whether a record may leave it out.
_FIELDS: dict[type[Any], dict[str, tuple[str, bool]]] = {
    PodRecord: {
        "target": ("str", True),
        "backend": ("str", True),
        "volume_id": ("str", True),
        "staging": ("str | None", False),
        "read_only": ("bool", False),
        "details": (_MAP, False),
        "created": ("float", False),
    },
    VolumeRecord: {
        "volume_id": ("str", True),
        "backend": ("str", True),
        "device": ("str", True),
        "staging": ("str", True),
        "fs_type": ("str", True),
        "details": (_MAP, False),
        "created": ("float", False),
        "options": (_MAP, False),
        "partial": (_MAP, False),
        "access": (_MAP, False),
    },
}


def _digest(key: str) -> str:
    return sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def _check_type(name: str, value: Any, record_type: type[Any]) -> bool:
    hint = _FIELDS[record_type][name][0]
    if hint == "str":
        return isinstance(value, str)
    if hint == "str | None":
        return value is None or isinstance(value, str)
    if hint == "bool":
        return isinstance(value, bool)
    if hint == "float":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint == "dict[str, str]":
        return isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        )
    return False  # pragma: no cover - every field type is listed above


def _decode(record_type: type[_R], data: Any) -> _R:
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("version") != SCHEMA_VERSION:
        raise ValueError(f"unsupported schema version {data.get('version')!r}")
    if data.get("kind") != _KINDS[record_type]:
        raise ValueError(f"kind {data.get('kind')!r} is not {_KINDS[record_type]!r}")
    kwargs: dict[str, Any] = {}
    for name, (_, required) in _FIELDS[record_type].items():
        if name not in data:
            if required:
                raise ValueError(f"missing field {name!r}")
            continue
        if not _check_type(name, data[name], record_type):
            raise ValueError(f"field {name!r} has the wrong type")
        kwargs[name] = data[name]
    return record_type(**kwargs)


class Journal:
    """The records under ``state_dir``.

    :param state_dir: flexhub's state directory (created 0700 on first write).
    """

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.pods_dir = self.state_dir / "pods"
        self.volumes_dir = self.state_dir / "volumes"
        self.deferred_dir = self.state_dir / "deferred"
        self.formats_dir = self.state_dir / "formats"
        self._tidied: set[Path] = set()

    # -- files ---------------------------------------------------------------------------------

    def _pod_path(self, target: str | os.PathLike[str]) -> Path:
        return pod_record_path(self.state_dir, os.fspath(target))

    def _volume_path(self, volume_id: str) -> Path:
        return self.volumes_dir / f"{_digest(volume_id)}.json"

    def _write(self, path: Path, record: PodRecord | VolumeRecord) -> None:
        data = {"version": SCHEMA_VERSION, "kind": _KINDS[type(record)]}
        data.update(record.as_dict())
        self._write_bytes(path, json.dumps(data, sort_keys=True, indent=1).encode("utf-8"))

    def _tidy(self, directory: Path) -> None:
        """Remove what killed writers left in ``directory`` (once per directory and call)."""
        if directory not in self._tidied:
            self._tidied.add(directory)
            remove_dead_temporaries(directory, TEMPORARY)

    def _write_bytes(self, path: Path, payload: bytes) -> None:
        directory = path.parent
        try:
            private_dir(self.state_dir, *directory.relative_to(self.state_dir).parts)
            self._tidy(directory)
            write_atomically(path, payload)
        except OSError as exc:
            raise StateError(f"cannot write state record {path}: {exc.strerror}") from None

    def _read(self, path: Path, record_type: type[_R]) -> _R | None:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            LOG.warning("cannot read state record %s (%s): ignoring it", path, exc.strerror)
            return None
        try:
            return _decode(record_type, json.loads(raw.decode("utf-8")))
        except (ValueError, TypeError) as exc:
            LOG.warning(
                "corrupt or unreadable state record %s (%s): falling back to the mount table",
                path,
                exc,
            )
            return None

    def _delete(self, path: Path) -> None:
        self._tidy(path.parent)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StateError(f"cannot delete state record {path}: {exc.strerror}") from None
        with contextlib.suppress(OSError):
            fsync_directory(path.parent)

    def _all(self, directory: Path, record_type: type[_R]) -> Iterator[_R]:
        try:
            names = sorted(os.listdir(directory))
        except FileNotFoundError:
            return
        except OSError as exc:
            LOG.warning("cannot list %s: %s", directory, exc.strerror)
            return
        for name in names:
            if name.startswith(".") or not name.endswith(".json"):
                continue
            record = self._read(directory / name, record_type)
            if record is not None:
                yield record

    # -- pods ----------------------------------------------------------------------------------

    def put_pod(self, record: PodRecord) -> None:
        """Write (or replace) the record of ``record.target``."""
        self._write(self._pod_path(record.target), record)

    def get_pod(self, target: str | os.PathLike[str]) -> PodRecord | None:
        """The record of ``target``; ``None`` when missing or unreadable."""
        record = self._read(self._pod_path(target), PodRecord)
        if record is not None and record.target != os.fspath(target):
            LOG.warning("state record for %s names %s: ignoring it", target, record.target)
            return None
        return record

    def delete_pod(self, target: str | os.PathLike[str]) -> None:
        """Remove the record of ``target`` (readable or not); no-op when absent."""
        self._delete(self._pod_path(target))

    def pods(self) -> list[PodRecord]:
        """Every readable pod record."""
        return list(self._all(self.pods_dir, PodRecord))

    def pods_of(self, volume_id: str) -> list[PodRecord]:
        """The readable pod records of ``volume_id``."""
        return [r for r in self.pods() if r.volume_id == volume_id]

    # -- volumes -------------------------------------------------------------------------------

    def put_volume(self, record: VolumeRecord) -> None:
        """Write (or replace) the record of ``record.volume_id``."""
        self._write(self._volume_path(record.volume_id), record)

    def get_volume(self, volume_id: str) -> VolumeRecord | None:
        """The record of ``volume_id``; ``None`` when missing or unreadable."""
        record = self._read(self._volume_path(volume_id), VolumeRecord)
        if record is not None and record.volume_id != volume_id:
            LOG.warning(
                "state record for volume %s names %s: ignoring it", volume_id, record.volume_id
            )
            return None
        return record

    def has_volume(self, volume_id: str) -> bool:
        """Whether a record of ``volume_id`` is there, readable or not (an unreadable one may
        still describe an attached device: only its absence proves none is)."""
        return os.path.lexists(self._volume_path(volume_id))

    def volume_by_staging(self, staging: str | os.PathLike[str]) -> VolumeRecord | None:
        """The readable volume record whose staging directory is ``staging``."""
        wanted = os.fspath(staging)
        for record in self.volumes():
            if record.staging == wanted:
                return record
        return None

    def delete_volume(self, volume_id: str) -> None:
        """Remove the record of ``volume_id``; no-op when absent."""
        self._delete(self._volume_path(volume_id))

    def delete_volume_by_prefix(self, prefix: str) -> None:
        """Remove the volume records whose file name starts with ``prefix`` (a hash prefix).

        For a record that cannot be read, so its volume id is unknown, but whose staging
        directory (named by the same hash) is known.
        """
        if len(prefix) < 16 or not all(c in "0123456789abcdef" for c in prefix):
            return
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.volumes_dir):
                if name.startswith(prefix) and name.endswith(".json"):
                    LOG.warning("deleting unreadable volume record %s", self.volumes_dir / name)
                    self._delete(self.volumes_dir / name)

    def volumes(self) -> list[VolumeRecord]:
        """Every readable volume record."""
        return list(self._all(self.volumes_dir, VolumeRecord))

    # -- formats begun -------------------------------------------------------------------------

    def _format_path(self, volume_id: str) -> Path:
        return self.formats_dir / f"{_digest(volume_id)}.json"

    def put_format(self, volume_id: str, identity: Mapping[str, str], fs_type: str) -> None:
        """Record, durably, that a format of the device ``identity`` names as ``fs_type``
        begins for ``volume_id`` (written and synced before ``mkfs`` runs)."""
        data = {
            "version": SCHEMA_VERSION,
            "kind": "format",
            "volume_id": volume_id,
            "identity": dict(identity),
            "fs_type": fs_type,
            "created": time.time(),
        }
        payload = json.dumps(data, sort_keys=True, indent=1).encode("utf-8")
        self._write_bytes(self._format_path(volume_id), payload)

    def get_format(self, volume_id: str) -> tuple[dict[str, str], str] | None:
        """``(device identity, fs type)`` of the unfinished format of ``volume_id``; ``None``
        when there is none or it cannot be read."""
        path = self._format_path(volume_id)
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
            identity, fs_type = data["identity"], data["fs_type"]
            valid = (
                data.get("version") == SCHEMA_VERSION
                and data.get("kind") == "format"
                and data.get("volume_id") == volume_id
                and isinstance(fs_type, str)
                and isinstance(identity, dict)
                and identity
                and all(isinstance(k, str) and isinstance(v, str) for k, v in identity.items())
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as exc:
            LOG.warning("ignoring the unreadable format record %s (%s)", path, exc)
            return None
        if not valid:
            LOG.warning("ignoring the format record %s (wrong shape or volume)", path)
            return None
        return identity, fs_type

    def clear_format(self, volume_id: str) -> None:
        """Forget the format of ``volume_id`` (it finished); no-op when there is none."""
        self._delete(self._format_path(volume_id))

    # -- releases deferred ---------------------------------------------------------------------

    def defer_release(self, volume_id: str, attempts: int = 0) -> None:
        """Mark ``volume_id`` as waiting for its release (its record stays in ``volumes/``),
        after ``attempts`` tries; the marker's mtime is the time of the last one."""
        payload = json.dumps({"volume_id": volume_id, "attempts": attempts}).encode("utf-8")
        self._write_bytes(self.deferred_dir / _digest(volume_id), payload)

    def deferred_releases(self) -> list[DeferredRelease]:
        """The releases that wait: one small file each, usually none (one ``listdir`` of an
        empty directory on every unmount)."""
        try:
            names = sorted(os.listdir(self.deferred_dir))
        except FileNotFoundError:
            return []
        except OSError as exc:
            LOG.warning("cannot list %s: %s", self.deferred_dir, exc.strerror)
            return []
        found = []
        for name in names:
            if name.startswith("."):
                continue
            path = self.deferred_dir / name
            try:
                data = json.loads(path.read_bytes())
                since = path.stat().st_mtime
                volume_id, attempts = data["volume_id"], data["attempts"]
            except (OSError, ValueError, TypeError, KeyError):
                LOG.warning("ignoring the unreadable deferred-release marker %s", path)
                continue
            if not isinstance(volume_id, str) or _digest(volume_id) != name:
                LOG.warning("ignoring the deferred-release marker %s (wrong volume)", path)
                continue
            if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 0:
                attempts = 0
            found.append(DeferredRelease(volume_id, attempts, since))
        return found

    def deferred(self) -> list[str]:
        """The volume ids whose release waits."""
        return [d.volume_id for d in self.deferred_releases()]

    def clear_deferred(self, volume_id: str) -> None:
        """Forget that ``volume_id`` waits for its release; no-op when it does not."""
        self._delete(self.deferred_dir / _digest(volume_id))


class DeferredRelease(Frozen):
    """A volume whose release waits for its storage: tried ``attempts`` times, the last (or
    the deferral) at ``since`` (epoch seconds)."""

    __slots__ = ("volume_id", "attempts", "since")  # noqa: RUF023 - the fields, in order
    volume_id: str
    attempts: int
    since: float

    def __init__(self, volume_id: str, attempts: int, since: float) -> None:
        self._set(volume_id=volume_id, attempts=attempts, since=since)


def record_details(details: Mapping[str, str]) -> dict[str, str]:
    """Copy backend details into a plain ``dict[str, str]`` for a record."""
    return {str(k): str(v) for k, v in details.items()}
