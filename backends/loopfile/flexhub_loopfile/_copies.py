"""The optional provisioning methods loopfile serves to the CSI controller: its node room
(``capacity``), snapshots, restores and clones (copies of backing files: :mod:`._snapshot`).
A mixin of :class:`~flexhub_loopfile.LoopfileBackend`, kept apart so that module stays small.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

from flexhub.backend import PodInfo, Secrets, Volume, VolumeError
from flexhub.provisioning import Claim, Provisioned
from flexhub_loopfile import _files, _made, _options, _provision, _room, _tenancy

if TYPE_CHECKING:
    from flexhub_loopfile import LoopfileBackend

__all__ = ["Copies"]

LOG = logging.getLogger(__name__)


def _backend(self: object) -> LoopfileBackend:
    return cast("LoopfileBackend", self)


class Copies:
    """``capacity``, ``max_volume_size``, ``snapshot``, ``delete_snapshot``, ``restore``,
    ``clone``."""

    snapshots = True

    def capacity(self, parameters: Mapping[str, str]) -> int:
        """The node's room (:mod:`flexhub_loopfile._room`): what the root's filesystem can
        hold times ``overcommit``, less what its files promise; for a preallocating class
        also no more than is free now."""
        _tenancy.check_settings(_backend(self).node.settings)
        root = _backend(self)._root()
        room = _room.measure(root, root)
        allowed = (
            int(room.capacity * _tenancy.overcommit(_backend(self).node.settings)) - room.promised
        )
        if _options.preallocate(parameters):
            allowed = min(allowed, room.available)
        return max(0, allowed)

    def max_volume_size(self, parameters: Mapping[str, str]) -> int | None:
        """The class's ``maxSize`` (default 1Ti)."""
        from flexhub_loopfile import _provision

        return _provision.max_size(parameters)[1]

    def snapshot(
        self,
        options: Mapping[str, str],
        reclaim: Mapping[str, str],
        name: str,
        namespace: str,
        secrets: Secrets,
    ) -> dict[str, str]:
        """On the node: copy the volume's file to the root's snapshots (see
        :mod:`flexhub_loopfile._snapshot`): a reflink where the filesystem can, else a full
        copy that keeps holes."""
        from flexhub_loopfile import _snapshot

        volume = Volume(options=dict(options), pod=PodInfo(namespace=namespace))
        source, size = self._source(volume)
        dest = _snapshot.snapshot_path(_backend(self)._root(), name, namespace)
        how = _snapshot.copy_into(_backend(self), source, dest, size)
        return {
            "file": str(dest.relative_to(_backend(self)._root())),
            "size": str(os.stat(dest).st_size),
            "how": how,
        }

    def delete_snapshot(self, snapshot: Mapping[str, str], secrets: Secrets) -> None:
        """On the node: remove the snapshot's file; gone is success."""
        from flexhub_loopfile import _snapshot

        _snapshot.delete(_backend(self)._root(), snapshot.get("file", ""))

    def restore(
        self,
        claim: Claim,
        parameters: Mapping[str, str],
        snapshot: Mapping[str, str],
        secrets: Secrets,
    ) -> Provisioned:
        """On the node: the claim's file is made now, a copy of the snapshot's."""
        relative = snapshot.get("file", "")
        parts = relative.split("/")
        if len(parts) != 3 or parts[0] != _tenancy.SNAPSHOTS:
            raise VolumeError(f"{relative[:120]!r} is not a loopfile snapshot")
        return self._copied(claim, parameters, _backend(self)._root().joinpath(*parts))

    def clone(
        self,
        claim: Claim,
        parameters: Mapping[str, str],
        options: Mapping[str, str],
        namespace: str,
        secrets: Secrets,
    ) -> Provisioned:
        """On the node: the claim's file is made now, a copy of the source volume's."""
        volume = Volume(options=dict(options), pod=PodInfo(namespace=namespace))
        return self._copied(claim, parameters, self._source(volume)[0])

    def _source(self, volume: Volume) -> tuple[Path | None, int]:
        """The volume's file, or ``None`` and its size when it was never mounted (so never
        written: its copy is an empty file)."""
        path = _backend(self)._resolve(volume)
        if path.is_file():
            return path, 0
        made_before = _made.recorded(_backend(self)._state_dir(), path)
        if made_before is not None:  # lost: its copy must not be an empty volume
            raise _made.missing(_options.relative(volume), path, made_before)
        size = _options.size(volume)
        if size is None:
            raise VolumeError(f"volume file {path} does not exist and has no size")
        return None, _files.round_up(size)

    def _copied(
        self, claim: Claim, parameters: Mapping[str, str], source: Path | None
    ) -> Provisioned:
        from flexhub_loopfile import _snapshot

        made = _provision.provision(claim, parameters)
        dest = _backend(self)._resolve(
            Volume(options=dict(made.options), pod=PodInfo(namespace=claim.namespace))
        )
        how = _snapshot.copy_into(_backend(self), source, dest, made.size)
        _made.record(_backend(self)._state_dir(), dest)  # data: never made anew, empty
        LOG.info("made %s from %s (%s)", dest, source, how)
        size = os.stat(dest).st_size
        return made.replace(size=size, options={**made.options, "size": str(size)})
