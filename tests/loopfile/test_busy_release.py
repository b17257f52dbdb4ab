"""A filesystem still mounted in another mount namespace is not gone: the unmount answers
Success (the pod's mounts are gone) but the release waits, keeping the loop device and its
record, until a later unmount finds the device free. Real loop devices, mounts and a real
second mount namespace (``unshare -m``, as a container that copied the host's mounts)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from flexhub_loopfile import LoopfileBackend

from flexhub.node import Node
from flexhub.node.mounts import MountTable
from flexhub.node.volumes import mount_volume, staging_dir, unmount_volume
from flexhub.volume import Volume

pytestmark = pytest.mark.root


def _loop_of(path: Path) -> list[str]:
    out = subprocess.run(
        ["losetup", "-j", str(path), "-O", "NAME", "-n"], capture_output=True, text=True
    ).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


class Namespace:
    """A process in its own private mount namespace, its cwd inside ``directory`` (so the
    filesystem there stays alive in that namespace even once its mount is detached)."""

    def __init__(self, directory: Path) -> None:
        self.proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sleep", "600"], cwd=directory
        )
        for _ in range(100):
            if os.readlink(f"/proc/{self.proc.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"):
                return
            time.sleep(0.05)
        raise AssertionError("unshare made no mount namespace")

    def end(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def holder() -> Iterator[list[Namespace]]:
    made: list[Namespace] = []
    yield made
    for namespace in made:
        namespace.end()


def test_a_filesystem_alive_in_another_namespace_defers_the_release(
    node: Node, backend: LoopfileBackend, root: Path, tmp_path: Path, holder: list[Namespace]
) -> None:
    node.config.release_retry_interval = 0.0  # every later unmount retries at once
    pod = tmp_path / "pods" / "a" / "volumes" / "k8s~flexhub" / "vol"
    pod.mkdir(parents=True)
    volume = Volume(
        options={"backend": "loopfile", "file": "v.img", "size": "64Mi"}, fs_type="ext4"
    )
    mount_volume(node, backend, pod, volume)
    (pod / "data").write_text("kept")
    volume_id = backend.volume_id(volume)
    staging = staging_dir(node, volume_id)
    (loop,) = _loop_of(root / "v.img")
    holder.append(Namespace(staging))  # the namespace holds the staging mount

    message = unmount_volume(node, pod, lambda name: backend)
    assert not MountTable().is_mount_point(pod)
    assert MountTable().at(staging) is None  # gone here, alive over there
    assert "in use" in message, message  # the Success reply says what stays and why
    assert _loop_of(root / "v.img") == [loop]  # the device stays, its record too
    assert node.journal.get_volume(volume_id) is not None
    assert node.journal.deferred() == [volume_id]

    other = tmp_path / "pods" / "b" / "volumes" / "k8s~flexhub" / "vol"
    other.mkdir(parents=True)
    assert unmount_volume(node, other, lambda name: backend) == ""  # still busy: waits
    assert _loop_of(root / "v.img") == [loop]
    assert node.journal.deferred() == [volume_id]

    holder.pop().end()  # the namespace goes: the filesystem shuts down, the device is free
    assert unmount_volume(node, other, lambda name: backend) == ""
    assert _loop_of(root / "v.img") == []
    assert node.journal.get_volume(volume_id) is None
    assert node.journal.deferred() == []
    assert not staging.exists()

    again = tmp_path / "pods" / "c" / "volumes" / "k8s~flexhub" / "vol"
    again.mkdir(parents=True)
    mount_volume(node, backend, again, volume)
    assert (again / "data").read_text() == "kept"  # written back before the device went
    unmount_volume(node, again, lambda name: backend)
    assert _loop_of(root / "v.img") == []


def test_a_reused_device_name_does_not_block_the_release_forever(
    node: Node, backend: LoopfileBackend, root: Path, tmp_path: Path
) -> None:
    """The journalled loop device name maps another, mounted file after a reboot (or any
    loss of the device): ``still_attached`` says it is no longer the volume's, so the core
    does not probe it and loopfile's detach leaves the foreign device alone; the stale
    record is released at once (before the fix: "still in use after its unmount", deferred
    for ever) and the other device stays mounted and attached."""
    node.config.release_retry_interval = 0.0
    pod = tmp_path / "pods" / "a" / "volumes" / "k8s~flexhub" / "vol"
    pod.mkdir(parents=True)
    volume = Volume(
        options={"backend": "loopfile", "file": "v.img", "size": "64Mi"}, fs_type="ext4"
    )
    mount_volume(node, backend, pod, volume)
    volume_id = backend.volume_id(volume)
    staging = staging_dir(node, volume_id)
    (loop,) = _loop_of(root / "v.img")

    # the node reboots: mounts and loop devices are gone, the journal stays
    subprocess.run(["umount", str(pod)], check=True)
    subprocess.run(["umount", str(staging)], check=True)
    subprocess.run(["losetup", "--detach", loop], check=True)
    # after boot the same loop name maps something else, mounted (snapd, another volume...)
    other = tmp_path / "other.img"
    subprocess.run(["truncate", "-s", "64M", str(other)], check=True)
    subprocess.run(["losetup", loop, str(other)], check=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    try:
        subprocess.run(["mkfs.ext4", "-q", loop], check=True)
        subprocess.run(["mount", loop, str(elsewhere)], check=True)
        # kubelet tears the orphaned pod directory down
        message = unmount_volume(node, pod, lambda name: backend)
        assert node.journal.deferred() == [], message
        assert node.journal.get_volume(volume_id) is None
        assert _loop_of(other) == [loop] and os.path.ismount(elsewhere)
    finally:
        subprocess.run(["umount", str(elsewhere)], check=False)
        subprocess.run(["losetup", "--detach", loop], check=False)
