"""A release that must wait for unreachable storage (ReleaseDeferred), with real loop devices
and real mounts: the unmount succeeds, the device and its record stay, and the node's next
unmount call after the storage is back releases them. "Unreachable" is a switch of the test
backend here; the iSCSI backend raises the same error for a real dead target in the VM rig
(tests/vm/test_kit_iscsi.py, the kit's ``bounded`` check)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from blockfile import BlockfileBackend
from conftest import Rig

from flexhub.backend import Attachment, ReleaseDeferred, Volume, VolumeError
from flexhub.node.fastpath import nothing_to_unmount
from flexhub.node.volumes import mount_volume, staging_dir, unmount_volume

pytestmark = pytest.mark.root


class SwitchedBackend(BlockfileBackend):
    """The blockfile backend whose storage can be made unreachable: its detach then keeps
    the device, as a backend must when writes may still be queued for the storage."""

    down = False
    detaches = 0

    def detach(self, attachment: Attachment) -> None:
        type(self).detaches += 1
        if self.down:
            raise ReleaseDeferred(f"test: the storage of {attachment.device} is unreachable")
        super().detach(attachment)


@pytest.fixture
def switched(rig: Rig) -> Rig:
    SwitchedBackend.down = False
    SwitchedBackend.detaches = 0
    rig.backend = SwitchedBackend(rig.node)
    rig.node.config.release_retry_interval = 0.0  # every unmount retries (the backoff: below)
    return rig


def _unmount(rig: Rig, target: Path) -> str:
    return unmount_volume(rig.node, target, lambda name: rig.backend)


def _volume_id(path: Path) -> str:
    return f"blockfile:{path.resolve()}"


def _mounted_then_deferred(rig: Rig) -> Path:
    """A volume mounted by pod "a", then unmounted with its storage unreachable: its backing
    file (the loop device and the record stay)."""
    image = rig.file()
    pod = rig.pod("a")
    mount_volume(rig.node, rig.backend, pod, rig.volume(image, "ext4"))
    SwitchedBackend.down = True
    _unmount(rig, pod)
    return image


def test_unmount_succeeds_keeps_the_device_and_a_later_unmount_releases_it(
    switched: Rig,
) -> None:
    rig = switched
    image = rig.file()
    pod, other = rig.pod("a"), rig.pod("b")
    mount_volume(rig.node, rig.backend, pod, rig.volume(image, "ext4"))
    (pod / "data").write_text("kept")
    (loop,) = rig.loops()

    SwitchedBackend.down = True
    message = _unmount(rig, pod)
    assert "unreachable" in message  # the reply names what stays and why
    assert rig.mounts() == []  # the pod's bind and the staging mount are gone
    assert rig.loops() == [loop]  # the device stays for the queued writes
    assert len(rig.records()) == 1 and rig.records()[0].startswith("volumes/")
    assert rig.node.journal.deferred() == [_volume_id(image)]
    assert not staging_dir(rig.node, _volume_id(image)).exists()
    # kubelet's cheap "nothing to unmount" path must not hide the waiting release
    assert not nothing_to_unmount(rig.state, other)

    # Still unreachable: another pod's unmount (nothing of its own) tries again and waits.
    before = SwitchedBackend.detaches
    assert _unmount(rig, other) == ""
    assert SwitchedBackend.detaches == before + 1
    assert rig.loops() == [loop]
    assert rig.node.journal.deferred() == [_volume_id(image)]

    # Back: the next unmount call of the node releases it, and nothing is left.
    SwitchedBackend.down = False
    assert _unmount(rig, rig.pod("c")) == ""
    assert rig.loops() == []
    assert rig.node.journal.deferred() == []
    assert rig.records() == []
    assert rig.staging_dirs() == []
    assert nothing_to_unmount(rig.state, rig.pod("d"))

    # The data written before the deferred unmount is on the storage.
    again = rig.pod("e")
    mount_volume(rig.node, rig.backend, again, rig.volume(image, "ext4"))
    assert (again / "data").read_text() == "kept"
    _unmount(rig, again)
    rig.assert_clean()


def test_a_volume_mounted_again_before_its_storage_returns_stops_waiting(
    switched: Rig,
) -> None:
    rig = switched
    image = _mounted_then_deferred(rig)
    second = rig.pod("b")
    (loop,) = rig.loops()

    # A new pod mounts it: the device is reused, and the volume no longer waits (its own
    # last unmount releases it); the retry never pulls the device from under the pod.
    mount_volume(rig.node, rig.backend, second, rig.volume(image, "ext4"))
    assert rig.loops() == [loop]
    before = SwitchedBackend.detaches
    _unmount(rig, rig.pod("c"))
    assert SwitchedBackend.detaches == before
    assert rig.node.journal.deferred() == []
    (second / "x").write_text("written")

    SwitchedBackend.down = False
    assert _unmount(rig, second) == ""
    rig.assert_clean()


def test_a_failed_retry_never_fails_the_unmount_that_ran_it(switched: Rig) -> None:
    rig = switched
    image = _mounted_then_deferred(rig)

    class Broken(SwitchedBackend):
        def detach(self, attachment: Attachment) -> None:
            raise OSError(5, "Input/output error")

    rig.backend = Broken(rig.node)
    other = rig.pod("b")
    assert _unmount(rig, other) == ""  # logged, not this pod's failure
    assert rig.node.journal.deferred() == [_volume_id(image)]

    rig.backend = SwitchedBackend(rig.node)
    SwitchedBackend.down = False
    _unmount(rig, rig.pod("c"))
    rig.assert_clean()


def test_retries_back_off_so_a_dead_storage_cannot_slow_every_unmount(switched: Rig) -> None:
    rig = switched
    rig.node.config.release_retry_interval = 60.0
    _mounted_then_deferred(rig)
    marker = rig.state / "deferred" / os.listdir(rig.state / "deferred")[0]
    tries = SwitchedBackend.detaches

    _unmount(rig, rig.pod("b"))  # right after the deferral: no try
    assert SwitchedBackend.detaches == tries

    past = time.time() - 61
    os.utime(marker, (past, past))
    _unmount(rig, rig.pod("c"))  # 60 s later: one try, which fails
    assert SwitchedBackend.detaches == tries + 1
    _unmount(rig, rig.pod("d"))  # the next waits twice as long
    assert SwitchedBackend.detaches == tries + 1
    past = time.time() - 100
    os.utime(marker, (past, past))
    _unmount(rig, rig.pod("e"))
    assert SwitchedBackend.detaches == tries + 1
    past = time.time() - 121
    os.utime(marker, (past, past))
    SwitchedBackend.down = False
    _unmount(rig, rig.pod("f"))
    assert SwitchedBackend.detaches == tries + 2
    rig.assert_clean()
    assert rig.node.journal.deferred() == []


class IdentityBackend(SwitchedBackend):
    """Its connection identity is the volume's ``user`` option (as iSCSI's CHAP user)."""

    def access(self, volume: Volume) -> dict[str, str]:
        return {"user": volume.options.get("user", "")}


def test_a_waiting_device_is_reused_only_with_the_same_identity(switched: Rig) -> None:
    rig = switched
    rig.backend = IdentityBackend(rig.node)
    image = rig.file()

    def volume(user: str) -> Volume:
        plain = rig.volume(image, "ext4")
        return Volume(options={**plain.options, "user": user}, fs_type="ext4")

    mount_volume(rig.node, rig.backend, rig.pod("a"), volume("team-a"))
    SwitchedBackend.down = True
    _unmount(rig, rig.pod("a"))
    (loop,) = rig.loops()
    with pytest.raises(VolumeError, match="another connection identity: user differ"):
        mount_volume(rig.node, rig.backend, rig.pod("b"), volume("team-b"))
    assert rig.loops() == [loop] and rig.mounts() == []
    assert rig.node.journal.deferred() == [_volume_id(image)]  # still waiting, untouched
    mount_volume(rig.node, rig.backend, rig.pod("c"), volume("team-a"))
    SwitchedBackend.down = False
    _unmount(rig, rig.pod("c"))
    rig.assert_clean()
