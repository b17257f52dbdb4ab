"""A staged volume is shared only with volumes of the same connection identity."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
from blockfile import BlockfileBackend
from conftest import Rig

from flexhub.errors import VolumeError
from flexhub.node.mounts import MountTable
from flexhub.node.volumes import mount_volume, staging_dir, unmount_volume
from flexhub.volume import Secret, Secrets, Volume

pytestmark = pytest.mark.root


class KeyedBlockfile(BlockfileBackend):
    """A blockfile whose access identity is the option ``user`` and a digest of a secret."""

    def access(self, volume: Volume) -> Mapping[str, str]:
        secret = volume.secrets.get("key")
        digest = str(len(secret.reveal())) + "x" if secret is not None else ""
        return {"user": volume.options.get("user", ""), "key digest": digest}


def _volume(file: Path, user: str, key: str) -> Volume:
    return Volume(
        options={"backend": "blockfile", "file": str(file), "user": user},
        secrets=Secrets({"key": Secret(key)}),
    )


def test_a_staged_volume_is_shared_only_with_the_same_identity(rig: Rig) -> None:
    backend = KeyedBlockfile(rig.node)
    file = rig.file()
    a, b, c = rig.pod("a"), rig.pod("b"), rig.pod("c")
    mount_volume(rig.node, backend, a, _volume(file, "alice", "secret-1"))
    (a / "data").write_text("a's")
    record = rig.node.journal.get_volume(backend.volume_id(_volume(file, "", "")))
    assert record is not None and record.access == {"user": "alice", "key digest": "8x"}

    for volume, differ in (
        (_volume(file, "alice", "other-key"), "key digest"),
        (_volume(file, "mallory", "secret-1"), "user"),
    ):
        with pytest.raises(VolumeError) as info:
            mount_volume(rig.node, backend, b, volume)
        message = info.value.message
        assert f"{differ} differ" in message and "refusing to share" in message
        assert "other-key" not in message and "mallory" not in message
        assert not MountTable().is_mount_point(b)
        assert rig.node.journal.get_pod(b) is None
    assert (a / "data").read_text() == "a's"  # A unaffected

    mount_volume(rig.node, backend, c, _volume(file, "alice", "secret-1"))
    assert (c / "data").read_text() == "a's"
    unmount_volume(rig.node, a, lambda name: backend)
    unmount_volume(rig.node, c, lambda name: backend)
    assert not MountTable().is_mount_point(
        staging_dir(rig.node, backend.volume_id(_volume(file, "", "")))
    )
    rig.assert_clean()


def test_a_volume_staged_without_an_identity_is_shared_with_nobody(rig: Rig) -> None:
    """A record journalled before identities were (an upgrade) proves nothing: refuse."""
    backend = KeyedBlockfile(rig.node)
    file = rig.file()
    a, b = rig.pod("a"), rig.pod("b")
    volume = _volume(file, "alice", "secret-1")
    mount_volume(rig.node, backend, a, volume)
    record = rig.node.journal.get_volume(backend.volume_id(volume))
    assert record is not None
    rig.node.journal.put_volume(record.replace(access={}))
    with pytest.raises(VolumeError, match="key digest, user differ"):
        mount_volume(rig.node, backend, b, volume)
    unmount_volume(rig.node, a, lambda name: backend)
    rig.assert_clean()
