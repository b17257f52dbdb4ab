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
from typing import Any

from flexhub.errors import StateError
from flexhub.node.frozen import Frozen

__all__ = ["VolumeRecord", "VolumeRecords"]

_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


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
        )

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


class VolumeRecords:
    """The records under ``<state_dir>/csi/volumes``."""

    def __init__(self, state_dir: Path) -> None:
        self.directory = state_dir / "csi" / "volumes"

    def _path(self, uid: str) -> Path:
        if not _UID.fullmatch(uid):
            raise StateError(f"not a volume uid: {uid[:80]!r}")
        return self.directory / f"{uid}.json"

    def get(self, uid: str) -> VolumeRecord | None:
        try:
            data = json.loads(self._path(uid).read_text())
            return VolumeRecord(**{k: data[k] for k in VolumeRecord.__slots__})
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StateError(f"volume record {uid} unreadable: {exc}") from None

    def uids(self) -> list[str]:
        """Every recorded uid, sorted."""
        try:
            names = [p.stem for p in self.directory.glob("*.json")]
        except OSError as exc:
            raise StateError(f"cannot list the volume records: {exc.strerror}") from None
        return sorted(n for n in names if _UID.fullmatch(n))

    def put(self, uid: str, record: VolumeRecord) -> None:
        path = self._path(uid)
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump(record.to_json(), out, sort_keys=True)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
            dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            raise StateError(f"cannot write volume record {uid}: {exc.strerror}") from None

    def delete(self, uid: str) -> None:
        try:
            self._path(uid).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StateError(f"cannot remove volume record {uid}: {exc.strerror}") from None
