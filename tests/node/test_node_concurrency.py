"""Lock granularity with real mounts: calls of one volume that must not queue."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Rig
from rendezvous import RendezvousBackend

from flexhub.config import NodeConfig
from flexhub.node import Node
from flexhub.node.volumes import mount_volume, unmount_volume
from flexhub.volume import Volume

pytestmark = pytest.mark.root


def _all_at_once(calls: list[Callable[[], None]]) -> list[BaseException | None]:
    """Run ``calls`` in threads at once; what each raised (``None``: it succeeded)."""
    errors: list[BaseException | None] = [None] * len(calls)

    def run(index: int) -> None:
        try:
            calls[index]()
        except BaseException as exc:  # reported to the test
            errors[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_filesystem_mounts_and_unmounts_of_one_volume_run_in_parallel(rig: Rig) -> None:
    # Each call waits inside the backend until all three have arrived; had the core
    # serialised them on the volume lock, the waiting ones would time out on it (2 s).
    config = NodeConfig(state_dir=rig.state, lock_timeout=2, unmount_timeout=10)
    node = Node(config, "rendezvous")
    backend = RendezvousBackend(node)
    meet = rig.base / "meet"
    volume = Volume(options={"backend": "rendezvous", "meet": str(meet), "peers": "3"})
    targets = [rig.pod(f"p{i}") for i in range(3)]

    def mount(target: Path) -> Callable[[], None]:
        return lambda: mount_volume(node, backend, target, volume)

    def unmount(target: Path) -> Callable[[], None]:
        return lambda: unmount_volume(node, target, lambda name: backend)

    assert _all_at_once([mount(t) for t in targets]) == [None] * 3
    assert sorted(rig.mounts()) == sorted(str(t) for t in targets)
    assert _all_at_once([unmount(t) for t in targets]) == [None] * 3
    assert rig.mounts() == []
    assert rig.records() == []
