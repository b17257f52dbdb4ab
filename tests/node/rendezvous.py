"""A test-only filesystem backend whose mount and unmount wait for their peers.

Each ``mount`` (and each ``unmount``) leaves a file in the ``meet`` directory and waits, at
most :data:`WAIT` seconds, until ``peers`` calls have arrived. Calls of one volume that the
core serialised could never all arrive: the first would wait alone while the others queue
on its lock. The storage is a real tmpfs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from flexhub.backend import FilesystemBackend, Volume, VolumeError

#: Seconds a call waits for its peers before failing.
WAIT = 10.0


def meet(directory: Path, name: str, peers: int) -> None:
    """Arrive in ``directory`` as ``name`` and wait for ``peers`` arrivals in all."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).touch()
    deadline = time.monotonic() + WAIT
    while len(os.listdir(directory)) < peers:
        if time.monotonic() > deadline:
            raise VolumeError(f"only {len(os.listdir(directory))} of {peers} calls arrived")
        time.sleep(0.02)


def _name(target: Path) -> str:
    return str(target).replace("/", "_")


class RendezvousBackend(FilesystemBackend):
    """Options: ``meet`` (a directory), ``peers`` (how many calls meet there)."""

    def volume_id(self, volume: Volume) -> str:
        return "rendezvous:" + volume.options["meet"]

    def mount(self, target: Path, volume: Volume) -> Mapping[str, str]:
        self.node.runner(["mount", "-t", "tmpfs", "-o", "size=1m", "rendezvous", str(target)])
        meet(Path(volume.options["meet"]) / "mount", _name(target), int(volume.options["peers"]))
        return {"meet": volume.options["meet"], "peers": volume.options["peers"]}

    def unmount(self, target: Path, details: Mapping[str, str]) -> None:
        if "meet" in details:  # not on the rollback of a failed mount
            meet(Path(details["meet"]) / "unmount", _name(target), int(details["peers"]))
        self.node.unmount(target)
