"""What an interrupted attach left (an intent record whose attach reported progress: an iSCSI
session logged in with its CHAP, say) is never taken over by a mount of the same volume with
another connection identity: that mount is refused, and its rollback releases the leftover,
so a retry attaches with its own identity (its own login) instead of riding the other's.

Real loop devices and mounts; the intent record is written as an attach SIGKILLed after its
first report leaves it (the crash itself is covered by the crash tests).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import pytest
from blockfile import BlockfileBackend
from conftest import Rig

from flexhub.errors import VolumeError
from flexhub.node.journal import VolumeRecord
from flexhub.node.volumes import mount_volume, staging_dir, unmount_volume
from flexhub.volume import Volume

pytestmark = pytest.mark.root


class Identified(BlockfileBackend):
    """Its identity is the option ``user``; it releases what an attach reported."""

    releases_partial = True
    released: ClassVar[list[dict[str, str]]] = []

    def access(self, volume: Volume) -> Mapping[str, str]:
        return {"user": volume.options.get("user", "")}

    def release(self, partial: Mapping[str, str]) -> None:
        type(self).released.append(dict(partial))


def test_an_interrupted_attach_is_not_taken_over_with_another_identity(rig: Rig) -> None:
    backend = Identified(rig.node)
    Identified.released = []
    image = rig.file()

    def volume(user: str) -> Volume:
        return Volume(
            options={"backend": "blockfile", "file": str(image), "user": user}, fs_type="ext4"
        )

    volume_id = backend.volume_id(volume(""))
    rig.node.journal.put_volume(
        VolumeRecord(
            volume_id,
            "blockfile",
            "",
            str(staging_dir(rig.node, volume_id)),
            "ext4",
            {},
            options={"backend": "blockfile", "file": str(image), "user": "team-a"},
            partial={"session": "logged in as team-a"},
            access={"user": "team-a"},
        )
    )
    pod = rig.pod("b")
    with pytest.raises(VolumeError, match="another connection identity: user differ"):
        mount_volume(rig.node, backend, pod, volume("team-b"))
    assert Identified.released == [{"session": "logged in as team-a"}]  # the leftover went
    assert rig.node.journal.get_volume(volume_id) is None
    assert rig.mounts() == [] and rig.loops() == []

    mount_volume(rig.node, backend, pod, volume("team-b"))  # kubelet's retry: its own attach
    record = rig.node.journal.get_volume(volume_id)
    assert record is not None and record.access == {"user": "team-b"}
    unmount_volume(rig.node, pod, lambda name: backend)
    rig.assert_clean()


def test_the_same_identity_finishes_its_interrupted_attach(rig: Rig) -> None:
    backend = Identified(rig.node)
    Identified.released = []
    image = rig.file()
    options = {"backend": "blockfile", "file": str(image), "user": "team-a"}
    volume_id = backend.volume_id(Volume(options=options))
    rig.node.journal.put_volume(
        VolumeRecord(
            volume_id,
            "blockfile",
            "",
            str(staging_dir(rig.node, volume_id)),
            "ext4",
            {},
            options=options,
            partial={"session": "logged in as team-a"},
            access={"user": "team-a"},
        )
    )
    pod = rig.pod("a")
    mount_volume(rig.node, backend, pod, Volume(options=options, fs_type="ext4"))
    assert Identified.released == []
    unmount_volume(rig.node, pod, lambda name: backend)
    rig.assert_clean()
