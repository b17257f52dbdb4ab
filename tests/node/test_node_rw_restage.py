"""A read-write staging mount is always preceded by the backend's ``attach`` for writing
(where a backend fences writers: iSCSI reserves the LUN), whatever path leads to it, also a
read-only staging mount left behind by a crash and then restaged read-write.

Real loop devices and mounts; the backend is the test blockfile backend, recording each
``attach`` with the state of the staging mount at that moment (what the core called is the
logic under test; the fencing itself is the iSCSI backend's, shown on two nodes in
``tests/vm/test_iscsi_rw_fence.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
from blockfile import BlockfileBackend
from conftest import Rig

from flexhub.backend import Attachment, Volume
from flexhub.node.mounts import MountTable
from flexhub.node.volumes import mount_volume, staging_dir, unmount_volume

pytestmark = pytest.mark.root


class Recording(BlockfileBackend):
    """Records ``(read_only, staging mount options)`` at every attach; a shared device, as
    iSCSI (read-only stagings get ``norecovery``)."""

    shared_device = True
    attaches: ClassVar[list[tuple[bool, tuple[str, ...] | None]]] = []

    def attach(self, volume: Volume) -> Attachment:
        staging = staging_dir(self.node, self.volume_id(volume))
        entry = MountTable().at(staging)
        options = (*entry.options, *entry.super_options) if entry is not None else None
        type(self).attaches.append((volume.read_only, options))
        return super().attach(volume)


def _staging(rig: Rig, backend: Recording, image: Path) -> tuple[str, ...]:
    entry = MountTable().at(staging_dir(rig.node, backend.volume_id(rig.volume(image))))
    assert entry is not None
    return (*entry.options, *entry.super_options)


def test_a_read_only_staging_left_by_a_crash_is_attached_for_writing_before_rw(
    rig: Rig,
) -> None:
    backend = Recording(rig.node)
    Recording.attaches = []
    image = rig.file()
    first = rig.pod("rw-1")
    mount_volume(rig.node, backend, first, rig.volume(image, "ext4"))
    unmount_volume(rig.node, first, lambda name: backend)

    reader = rig.pod("ro")
    mount_volume(rig.node, backend, reader, rig.volume(image, "ext4", read_only=True))
    assert {"ro", "norecovery"} <= set(_staging(rig, backend, image))
    crashed = rig.drive("unmount", reader, env={"FLEXHUB_TEST_CRASH_AT": "unbound"})
    assert crashed.returncode == -9, crashed
    assert not MountTable().is_mount_point(reader)
    assert "ro" in _staging(rig, backend, image)  # still staged read-only, by no pod

    Recording.attaches = []
    writer = rig.pod("rw-2")
    mount_volume(rig.node, backend, writer, rig.volume(image, "ext4"))
    assert "rw" in _staging(rig, backend, image)
    assert "norecovery" not in _staging(rig, backend, image)
    # attached for writing before the read-write staging mount existed
    assert [ro for ro, _ in Recording.attaches] == [False], Recording.attaches
    (writer / "data").write_text("written")

    unmount_volume(rig.node, writer, lambda name: backend)
    rig.assert_clean()


def test_a_read_only_staging_in_use_is_refused_before_any_attach(rig: Rig) -> None:
    """While read-only pods use the staging mount, a read-write pod is refused without
    attaching for writing (no reservation taken that would outlive the refusal)."""
    backend = Recording(rig.node)
    image = rig.file()
    first = rig.pod("rw-1")
    mount_volume(rig.node, backend, first, rig.volume(image, "ext4"))
    unmount_volume(rig.node, first, lambda name: backend)
    reader = rig.pod("ro")
    mount_volume(rig.node, backend, reader, rig.volume(image, "ext4", read_only=True))
    Recording.attaches = []
    from flexhub.errors import VolumeError

    with pytest.raises(VolumeError, match="read-only"):
        mount_volume(rig.node, backend, rig.pod("rw-2"), rig.volume(image, "ext4"))
    assert Recording.attaches == []
    assert "ro" in _staging(rig, backend, image)
    unmount_volume(rig.node, reader, lambda name: backend)
    rig.assert_clean()
