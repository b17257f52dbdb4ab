"""The controller's record of each volume it created: what ``DeleteVolume`` reclaims.

CSI gives ``DeleteVolume`` nothing but the volume id, while a backend's
:meth:`~flexhub.provisioning.Provisioning.reclaim` needs what ``provision`` returned (the PV's
options and reclaim record, which the FlexVolume provisioner keeps on the PV). The controller
keeps them in ``<state_dir>/csi/volumes/<uid>.json`` (0600, written atomically and synced),
one file per volume, named by the uid derived from the request's name. A retried
``CreateVolume`` finds the record and answers the same volume; never a secret in it.

Limitation: the records live on the controller's host. A controller that moves to another
host without its state directory cannot reclaim what it created before (the next step is to
keep them in the API server, as the FlexVolume provisioner keeps them on the PV).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

from flexhub.errors import StateError
from flexhub.node.frozen import Frozen

__all__ = [
    "ADOPTION_LABELS",
    "ADOPTION_RECORD_KEY",
    "CONVERTED",
    "UID",
    "StagedContexts",
    "UidRecords",
    "VolumeRecord",
    "VolumeRecords",
    "adoption_name",
    "record_of",
    "remove_record",
    "uid_of_volume",
]

_R = TypeVar("_R")
#: A volume or snapshot uid (uuid5 of its CreateVolume or CreateSnapshot name).
UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


#: The ConfigMap key of a converted volume's record, and the labels ``flexhub convert`` puts
#: on it (:mod:`flexhub.csi.adopted`, :mod:`flexhub.convert.adopt`): not convert's backup
#: label (``managed-by=flexhub-convert``), so that removing the saved copies leaves them.
ADOPTION_RECORD_KEY = "record.json"
ADOPTION_LABELS = {
    "app.kubernetes.io/managed-by": "flexhub",
    "app.kubernetes.io/component": "converted-volume-record",
}
#: The source of a converted volume's record once the controller keeps it locally (grown):
#: it stands only while the ConfigMap does (a rollback removes that).
CONVERTED = "converted"


def adoption_name(uid: str) -> str:
    """The ConfigMap, in flexhub's namespace, holding the record of the converted volume
    ``<backend>:<uid>``."""
    return f"flexhub-volume-{uid}"


def uid_of_volume(volume_id: str) -> str:
    """The uid part of ``<backend>:<uid>`` (``""`` for an id this controller never made)."""
    backend, _, uid = volume_id.rpartition(":")
    return uid if backend and UID.fullmatch(uid) else ""


class VolumeRecord(Frozen):
    """One created volume."""

    # the fields, in order
    __slots__ = (  # noqa: RUF023
        "name",
        "volume_id",
        "backend",
        "parameters",
        "options",
        "reclaim",
        "size",
        "fs_type",
        "node",
        "namespace",
        "source",
    )
    name: str
    volume_id: str
    backend: str
    parameters: Mapping[str, str]
    options: Mapping[str, str]
    reclaim: Mapping[str, str]
    size: int
    fs_type: str
    node: str
    namespace: str
    #: the content source, ``snapshot:<id>`` or ``volume:<id>``; ``""``: none; ``None``: a
    #: record from before sources were kept (unknown)
    source: str | None

    def __init__(
        self,
        name: str,
        volume_id: str,
        backend: str,
        parameters: Mapping[str, str],
        options: Mapping[str, str],
        reclaim: Mapping[str, str],
        size: int,
        fs_type: str,
        node: str,
        namespace: str,
        source: str | None = None,
    ) -> None:
        self._set(
            name=name,
            volume_id=volume_id,
            backend=backend,
            parameters=dict(parameters),
            options=dict(options),
            reclaim=dict(reclaim),
            size=size,
            fs_type=fs_type,
            node=node,
            namespace=namespace,
            source=source,
        )

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    def backend_reclaim(self) -> dict[str, str]:
        """The reclaim record a backend's ``reclaim``, ``expand_storage`` and ``snapshot``
        are given: the backend's own plus ``onDelete``, with the volume's ``size`` now (bytes,
        as the FlexVolume provisioner's PV annotation carries it): the iSCSI backend bounds
        an LV's zeroing and a copy by it. Kept beside the record, never in it, so that an
        expansion's new size is the one given."""
        return {**self.reclaim, "size": str(self.size)}


def record_of(data: Mapping[str, Any]) -> VolumeRecord:
    """The :class:`VolumeRecord` of a record's JSON object (``source`` may be missing).

    :raises KeyError: a field is missing.
    """
    fields = {k: data[k] for k in VolumeRecord.__slots__ if k != "source"}
    return VolumeRecord(**fields, source=data.get("source"))


class UidRecords(Generic[_R]):
    """JSON records named by a uid in one private directory (:attr:`kind` names them in
    errors; :meth:`_decode` makes a record of a file's object)."""

    kind = "volume"

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _decode(self, data: dict[str, Any]) -> _R:
        raise NotImplementedError

    def _path(self, uid: str) -> Path:
        if not UID.fullmatch(uid):
            raise StateError(f"not a {self.kind} uid: {uid[:80]!r}")
        return self.directory / f"{uid}.json"

    def get(self, uid: str) -> _R | None:
        try:
            data = json.loads(self._path(uid).read_text())
            return self._decode(data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StateError(f"{self.kind} record {uid} unreadable: {exc}") from None

    def uids(self) -> list[str]:
        """Every recorded uid, sorted."""
        try:
            names = [p.stem for p in self.directory.glob("*.json")]
        except OSError as exc:
            raise StateError(f"cannot list the {self.kind} records: {exc.strerror}") from None
        return sorted(n for n in names if UID.fullmatch(n))

    def _put(self, uid: str, data: dict[str, Any]) -> None:
        _write_json(self.directory, self._path(uid), data, f"{self.kind} record {uid}")

    def delete(self, uid: str) -> None:
        """Remove ``uid``'s record; none is no write (:func:`remove_record`)."""
        remove_record(self._path(uid), f"{self.kind} record {uid}")


class VolumeRecords(UidRecords[VolumeRecord]):
    """The records under ``<state_dir>/csi/volumes``."""

    def __init__(self, state_dir: Path) -> None:
        super().__init__(state_dir / "csi" / "volumes")

    def _decode(self, data: dict[str, Any]) -> VolumeRecord:
        return record_of(data)

    def put(self, uid: str, record: VolumeRecord) -> None:
        self._put(uid, record.to_json())


class StagedContexts:
    """The volume context of each volume staged on this node, by staging directory:
    ``NodeExpandVolume`` carries none, and a backend grows a volume from its options (the
    loop file's name and preallocation). ``<state_dir>/csi/staged/<sha256(path)[:32]>.json``,
    0600, written before the stage and removed after the unstage; the context is the PV's
    ``volumeAttributes`` (never a secret)."""

    def __init__(self, state_dir: Path) -> None:
        self.directory = state_dir / "csi" / "staged"

    def _path(self, staging: Path) -> Path:
        import hashlib

        return self.directory / f"{hashlib.sha256(str(staging).encode()).hexdigest()[:32]}.json"

    def put(
        self, staging: Path, volume_id: str, context: Mapping[str, str], access: str = ""
    ) -> None:
        """Record the stage of ``volume_id`` on ``staging``; ``access``: ``block`` (raw) or
        ``mount`` (records of releases before it have none)."""
        data = {
            "staging": str(staging),
            "volume_id": volume_id,
            "context": dict(context),
            "access": access,
        }
        _write_json(self.directory, self._path(staging), data, f"staged context of {staging}")

    def read(self, staging: Path) -> bytes | None:
        """The record of ``staging`` as stored (for :meth:`restore`), ``None`` when none."""
        try:
            return self._path(staging).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateError(f"staged context of {staging} unreadable: {exc}") from None

    def restore(self, staging: Path, data: bytes | None) -> None:
        """Put back what :meth:`read` returned (``None``: remove the record)."""
        if data is None:
            self.delete(staging)
            return
        _write_json(
            self.directory, self._path(staging), json.loads(data), f"staged context of {staging}"
        )

    def get(self, staging: Path) -> tuple[str, dict[str, str]] | None:
        """``(volume id, context)`` of the volume staged on ``staging``, or ``None``."""
        try:
            data = json.loads(self._path(staging).read_text())
            if data["staging"] != str(staging):
                return None
            return str(data["volume_id"]), {str(k): str(v) for k, v in data["context"].items()}
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StateError(f"staged context of {staging} unreadable: {exc}") from None

    def of_volume(self, volume_id: str) -> list[Path]:
        """The staging directories ``volume_id`` is staged on (a request may name none)."""
        return [staging for staging, staged, _ in self.entries() if staged == volume_id]

    def entries(self) -> list[tuple[Path, str, str]]:
        """``(staging directory, volume id, access)`` of every readable record (access
        ``""``: written before it was kept)."""
        found = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                data = json.loads(path.read_text())
                found.append(
                    (Path(data["staging"]), str(data["volume_id"]), str(data.get("access", "")))
                )
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
        return found

    def delete(self, staging: Path) -> None:
        try:
            self._path(staging).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StateError(f"cannot remove the staged context of {staging}: {exc}") from None


def remove_record(path: Path, what: str) -> None:
    """Remove the record file ``path`` (``what`` it is, for the error); a missing one is no
    write at all: unlink(2) of a missing file on a read-only filesystem is EROFS, not ENOENT,
    and a call that only reads must still answer there.

    :raises StateError: it is there and cannot be removed.
    """
    if not os.path.lexists(path):
        return
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise StateError(f"cannot remove {what}: {exc.strerror}") from None


def _write_json(directory: Path, path: Path, data: Any, what: str) -> None:
    """Write ``data`` to ``path`` atomically (0600, synced with its directory)."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(data, out, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        raise StateError(f"cannot write the {what}: {exc.strerror}") from None
