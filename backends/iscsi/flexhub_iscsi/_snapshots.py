"""Snapshots of provisioned iSCSI LUNs, on the provisioner's side: the request sent to the
target host and the record kept of a snapshot (never a secret), checked again before use.

A snapshot lives on the target host of its LUN (:mod:`flexhub_iscsi._lio_snap`): the file
``<fileioDirectory>/snap-<uid>.img`` or the LV ``<volumeGroup>/snap-<uid>``. Its record says
where: ``targetHost``, ``sshUser``, ``sshPort``, ``backstore``, ``fileioDirectory`` or
``volumeGroup``, ``snapshot`` (``snap-<uid>``), ``claimUid`` (the source claim's), ``size``
and ``how`` (``reflink`` or ``copy``; ``exists`` for a retry that found it made).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from flexhub.backend import Frozen, InvalidOptions
from flexhub_iscsi import _lio

__all__ = ["LioSnapshot", "copy_timeout", "parse_snapshot", "snapshot_record", "snapshot_spec"]

NAME = re.compile(r"snap-" + _lio.UID.pattern, re.ASCII)


def copy_timeout(backstore: str, size: int) -> float:
    """The bound of a call that copies ``size`` bytes on the target host (at the zeroing's
    pace); a block copy that fails is zeroed again, which may take as long."""
    copies = 2 if backstore == "block" else 1
    return _lio.CALL_TIMEOUT + copies * _lio.zero_seconds(size)


def check_name(name: str) -> str:
    if NAME.fullmatch(name) is None or "\n" in name:
        raise InvalidOptions(f"snapshot name {name[:80]!r} is not snap-<uid>")
    return name


def snapshot_spec(volume: _lio.LioVolume, name: str) -> dict[str, Any]:
    """The target host's request: the claim's file or LV and the snapshot's name (and for a
    file, whether it may be a reflink: not of a preallocated LUN, whose blocks it would
    share)."""
    spec = {**volume.spec(), "snapshot": check_name(name)}
    if volume.backstore == "fileio":
        spec["overcommit"] = volume.overcommit
        spec["sparse"] = volume.sparse
    return spec


def snapshot_record(volume: _lio.LioVolume, name: str, done: Mapping[str, Any]) -> dict[str, str]:
    """What :func:`parse_snapshot` reads back (strings, never a secret)."""
    record = {
        "targetHost": volume.ssh.host,
        "sshUser": volume.ssh.user,
        "sshPort": str(volume.ssh.port),
        "backstore": volume.backstore,
        "snapshot": name,
        "claimUid": volume.name.removeprefix("pvc-"),
        "size": str(int(done["size"])),
        "how": str(done.get("how", "copy")),
    }
    if volume.backstore == "block":
        record["volumeGroup"] = volume.volume_group
    else:
        record["fileioDirectory"] = volume.directory
    return record


class LioSnapshot(Frozen):
    """A snapshot's record, checked."""

    __slots__ = (  # noqa: RUF023 - the fields, in order
        "ssh",
        "backstore",
        "name",
        "directory",
        "volume_group",
    )
    ssh: _lio.Ssh
    backstore: str
    name: str
    directory: str
    volume_group: str

    def __init__(
        self,
        ssh: _lio.Ssh,
        backstore: str,
        name: str,
        directory: str = "",
        volume_group: str = "",
    ) -> None:
        self._set(
            ssh=ssh,
            backstore=backstore,
            name=name,
            directory=directory,
            volume_group=volume_group,
        )

    def spec(self) -> dict[str, Any]:
        """Where it is, for the target host's ``delete_snapshot``."""
        if self.backstore == "block":
            return {"backstore": "block", "vg": self.volume_group, "snapshot": self.name}
        return {"directory": self.directory, "snapshot": self.name}

    def source(self) -> dict[str, str]:
        """Where a restore copies it from."""
        if self.backstore == "block":
            return {"vg": self.volume_group, "name": self.name}
        return {"directory": self.directory, "name": self.name}


def parse_snapshot(record: Mapping[str, str]) -> LioSnapshot:
    """A snapshot record checked again (it names a path and a host: nothing of it reaches
    the target host unchecked).

    :raises InvalidOptions: one line naming the field.
    """
    ssh = _lio._ssh(
        record.get("targetHost", ""),
        record.get("sshUser", ""),
        record.get("sshPort", ""),
        what="snapshot record",
    )
    name = check_name(record.get("snapshot", ""))
    backstore = record.get("backstore", "")
    if backstore == "block":
        group = _lio._volume_group(record.get("volumeGroup", ""), what="snapshot record")
        return LioSnapshot(ssh, "block", name, volume_group=group)
    if backstore != "fileio":
        raise InvalidOptions('snapshot record \'backstore\' must be "fileio" or "block"')
    directory = _lio._directory(record.get("fileioDirectory", ""), what="snapshot record")
    return LioSnapshot(ssh, "fileio", name, directory=directory)
