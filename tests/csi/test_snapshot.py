"""Snapshots, restores and clones of loopfile volumes under CSI, on real loop devices and
filesystems: the restored and cloned volumes hold the source's data byte for byte, are made on
the source's node, the copy is a reflink on xfs and a hole-keeping full copy on tmpfs (said in
the plugin's log), snapshots live where no volume can name them, and nothing is left."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from flexhub.csi import TOPOLOGY_NODE_KEY
from flexhub.csi.proto import csi_pb2 as pb
from flexhub.csi.proto import csi_pb2_grpc as rpc
from tests.conftest import needs_root
from tests.csi.sanity import loops_backed_under, node_config, start_plugin, stop_plugin

pytestmark = [needs_root, pytest.mark.root]

MiB = 1 << 20
CAPABILITY = pb.VolumeCapability(
    mount=pb.VolumeCapability.MountVolume(),
    access_mode=pb.VolumeCapability.AccessMode(
        mode=pb.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER
    ),
)


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(MiB), b""):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(params=["tmpfs", "xfs-512", "xfs-4096"])
def root_fs(request: Any, trusted_dir: Path) -> Iterator[tuple[Path, str]]:
    """The node's config, its loopfile root on tmpfs (no reflink) or on its own xfs, on a
    device of 512-byte sectors (a reflink would change the volumes' loop sector size: full
    copy) or of 4096-byte sectors (reflink)."""
    config = node_config(trusted_dir)
    if request.param == "tmpfs":
        yield config, "copy"
        return
    image = trusted_dir / "root.img"
    with open(image, "wb") as f:
        f.truncate(512 * MiB)
    sector = request.param.removeprefix("xfs-")
    device = subprocess.run(
        ["losetup", "-f", "--show", "--sector-size", sector, str(image)],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    root = trusted_dir / "loopfiles"
    try:
        subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", device], check=True)
        subprocess.run(["mount", device, str(root)], check=True)
        try:
            yield config, "reflink" if sector == "4096" else "copy"
        finally:
            for _ in range(50):
                if not subprocess.run(["umount", str(root)], check=False).returncode:
                    break
                time.sleep(0.1)
    finally:
        subprocess.run(["losetup", "-d", device], check=False)


class Node:
    def __init__(self, top: Path, channel: Any) -> None:
        self.top = top
        self.controller = rpc.ControllerStub(channel)
        self.node = rpc.NodeStub(channel)
        self.staged: list[tuple[str, Path, Path]] = []

    def up(self, volume: Any, name: str) -> Path:
        stage, target = self.top / f"stage-{name}", self.top / "pod" / name
        stage.mkdir(parents=True)
        self.node.NodeStageVolume(
            pb.NodeStageVolumeRequest(
                volume_id=volume.volume_id,
                staging_target_path=str(stage),
                volume_capability=CAPABILITY,
                volume_context=volume.volume_context,
            )
        )
        self.staged.append((volume.volume_id, stage, target))
        self.node.NodePublishVolume(
            pb.NodePublishVolumeRequest(
                volume_id=volume.volume_id,
                staging_target_path=str(stage),
                target_path=str(target),
                volume_capability=CAPABILITY,
            )
        )
        return target

    def down(self) -> None:
        while self.staged:
            volume_id, stage, target = self.staged.pop()
            self.node.NodeUnpublishVolume(
                pb.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target))
            )
            self.node.NodeUnstageVolume(
                pb.NodeUnstageVolumeRequest(volume_id=volume_id, staging_target_path=str(stage))
            )


def test_a_restored_snapshot_and_a_clone_hold_the_source_s_bytes(
    trusted_dir: Path, root_fs: tuple[Path, str]
) -> None:
    config, how = root_fs
    endpoint, log = trusted_dir / "csi.sock", trusted_dir / "plugin.log"
    proc = start_plugin(config, endpoint, log)
    channel = grpc.insecure_channel(f"unix://{endpoint}")
    node = Node(trusted_dir, channel)
    c = node.controller
    loopfiles = trusted_dir / "loopfiles"
    try:
        source = c.CreateVolume(
            pb.CreateVolumeRequest(
                name="source",
                capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
                volume_capabilities=[CAPABILITY],
                parameters={"backend": "loopfile"},
            )
        ).volume
        data = os.urandom(3 * MiB)
        target = node.up(source, "source")
        (target / "data").write_bytes(data)
        fd = os.open(target / "data", os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        node.down()  # the source is not in use: its file is what the snapshot must hold
        (source_file,) = (p for p in loopfiles.rglob("pvc-*.img"))
        snap = c.CreateSnapshot(
            pb.CreateSnapshotRequest(name="snap-1", source_volume_id=source.volume_id)
        ).snapshot
        again = c.CreateSnapshot(
            pb.CreateSnapshotRequest(name="snap-1", source_volume_id=source.volume_id)
        ).snapshot
        assert again.snapshot_id == snap.snapshot_id and snap.ready_to_use
        assert snap.size_bytes == source_file.stat().st_size
        (snap_file,) = loopfiles.glob("snapshots/*/snap-*.img")
        assert snap_file.parent.name == "default" and snap_file.stat().st_mode & 0o777 == 0o600
        assert digest(snap_file) == digest(source_file)
        assert f"{snap.size_bytes} bytes, {how}" in log.read_text()
        if how == "copy":  # holes kept
            assert snap_file.stat().st_blocks <= source_file.stat().st_blocks + 64
        # the snapshot outlives its source volume
        c.DeleteVolume(pb.DeleteVolumeRequest(volume_id=source.volume_id))
        assert not source_file.exists()
        restored = c.CreateVolume(
            pb.CreateVolumeRequest(
                name="restored",
                capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
                volume_capabilities=[CAPABILITY],
                parameters={"backend": "loopfile"},
                volume_content_source=pb.VolumeContentSource(
                    snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=snap.snapshot_id)
                ),
                accessibility_requirements=pb.TopologyRequirement(
                    preferred=[pb.Topology(segments={TOPOLOGY_NODE_KEY: "node-elsewhere"})]
                ),
            )
        ).volume
        # made where the snapshot is, whatever the request preferred
        assert [dict(t.segments) for t in restored.accessible_topology] == [
            {TOPOLOGY_NODE_KEY: "node-1"}
        ]
        assert restored.content_source.snapshot.snapshot_id == snap.snapshot_id
        (restored_file,) = (p for p in loopfiles.rglob("pvc-*.img"))
        assert digest(restored_file) == digest(snap_file)
        target = node.up(restored, "restored")
        assert (target / "data").read_bytes() == data
        (target / "more").write_bytes(b"after")  # writes to the restore leave the snapshot
        node.down()
        assert digest(snap_file) != digest(restored_file)
        clone = c.CreateVolume(
            pb.CreateVolumeRequest(
                name="clone",
                capacity_range=pb.CapacityRange(required_bytes=96 * MiB),
                volume_capabilities=[CAPABILITY],
                parameters={"backend": "loopfile"},
                volume_content_source=pb.VolumeContentSource(
                    volume=pb.VolumeContentSource.VolumeSource(volume_id=restored.volume_id)
                ),
            )
        ).volume
        assert clone.capacity_bytes == 96 * MiB
        clone_file = next(p for p in loopfiles.rglob("pvc-*.img") if p != restored_file)
        with open(clone_file, "rb") as a, open(restored_file, "rb") as b:
            assert a.read(64 * MiB) == b.read()  # byte for byte, then grown
        assert clone_file.stat().st_size == 96 * MiB
        target = node.up(clone, "clone")
        assert (target / "data").read_bytes() == data
        assert (target / "more").read_bytes() == b"after"
        node.down()
        listed = c.ListSnapshots(pb.ListSnapshotsRequest(source_volume_id=source.volume_id))
        assert [e.snapshot.snapshot_id for e in listed.entries] == [snap.snapshot_id]
        got = c.GetSnapshot(pb.GetSnapshotRequest(snapshot_id=snap.snapshot_id)).snapshot
        assert got == listed.entries[0].snapshot  # GET_SNAPSHOT: the same as listed
        for volume in (restored, clone):
            c.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id))
        for _ in range(2):
            c.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id))
        assert not snap_file.exists()
        for unknown in (snap.snapshot_id, "loopfile:snapshot:not-ours"):
            with pytest.raises(grpc.RpcError) as missing:
                c.GetSnapshot(pb.GetSnapshotRequest(snapshot_id=unknown))
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as gone:
            c.CreateVolume(
                pb.CreateVolumeRequest(
                    name="late",
                    volume_capabilities=[CAPABILITY],
                    parameters={"backend": "loopfile"},
                    volume_content_source=pb.VolumeContentSource(
                        snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=snap.snapshot_id)
                    ),
                )
            )
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        with contextlib.suppress(grpc.RpcError):
            node.down()
        channel.close()
        stop_plugin(proc)
    assert loops_backed_under(loopfiles) == []
    assert not any(loopfiles.rglob("*.img"))
    assert not list((trusted_dir / "state" / "csi").rglob("*.json"))


def test_no_volume_can_name_or_adopt_a_snapshot_file(tmp_path: Path) -> None:
    """Without isolation a ``file`` under ``snapshots/`` is refused; with it, the namespace's
    own ``snapshots/...`` is just a file of its area, and the root's snapshot is never
    adopted (moved) into it as a pre-isolation file."""
    from flexhub_loopfile import LoopfileBackend

    from flexhub.backend import InvalidOptions, PodInfo, Volume
    from flexhub.config import NodeConfig
    from flexhub.node import Node as FlexNode

    root = tmp_path / "loopfiles"
    snap = root / "snapshots" / "team-a" / "snap-1.img"
    snap.parent.mkdir(parents=True)
    snap.write_bytes(b"secret data")

    def backend(isolation: str) -> LoopfileBackend:
        table = {"root": str(root), "isolation": isolation}
        config = NodeConfig(state_dir=tmp_path / "state", backends={"loopfile": table})
        return LoopfileBackend(FlexNode(config, backend="loopfile"))

    name = "snapshots/team-a/snap-1.img"
    shared = Volume(options={"backend": "loopfile", "file": name})
    with pytest.raises(InvalidOptions, match="snapshots"):
        backend("none")._resolve(shared)
    isolated = backend("namespace")
    volume = Volume(options={"backend": "loopfile", "file": name}, pod=PodInfo(namespace="b"))
    path = isolated._resolve(volume)
    assert path == root / "namespaces" / "b" / name
    assert isolated._legacy(volume, path) is None
    assert snap.read_bytes() == b"secret data"


def test_an_xfs_restore_and_clone_mount_beside_their_mounted_source(trusted_dir: Path) -> None:
    """A restore or clone of an xfs volume is a copy of its filesystem, UUID included, and
    the kernel refuses to mount an xfs whose UUID a mounted one has ("Filesystem has
    duplicate UUID"): the copies carry mount option ``nouuid`` (in their volume context, so
    a converted PV keeps it) and mount on the node while their source is still staged there
    (a pod using it), holding its bytes. Failed before: NodeStageVolume of the restore."""
    config = node_config(trusted_dir)
    endpoint, log = trusted_dir / "csi.sock", trusted_dir / "plugin.log"
    proc = start_plugin(config, endpoint, log)
    channel = grpc.insecure_channel(f"unix://{endpoint}")
    node = Node(trusted_dir, channel)
    c = node.controller
    xfs = {"backend": "loopfile", "fsType": "xfs"}  # xfs needs 300 MiB at least
    made: list[str] = []
    try:
        source = c.CreateVolume(
            pb.CreateVolumeRequest(
                name="xfs-source",
                capacity_range=pb.CapacityRange(required_bytes=320 * MiB),
                volume_capabilities=[CAPABILITY],
                parameters=xfs,
            )
        ).volume
        made.append(source.volume_id)
        assert "mountOptions" not in source.volume_context  # only copies need nouuid
        data = os.urandom(2 * MiB)
        target = node.up(source, "source")
        (target / "data").write_bytes(data)
        fd = os.open(target / "data", os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        snap = c.CreateSnapshot(
            pb.CreateSnapshotRequest(name="xfs-snap", source_volume_id=source.volume_id)
        ).snapshot
        copies = {
            "restored": pb.VolumeContentSource(
                snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=snap.snapshot_id)
            ),
            "clone": pb.VolumeContentSource(
                volume=pb.VolumeContentSource.VolumeSource(volume_id=source.volume_id)
            ),
        }
        for name, content in copies.items():
            copy = c.CreateVolume(
                pb.CreateVolumeRequest(
                    name=f"xfs-{name}",
                    capacity_range=pb.CapacityRange(required_bytes=320 * MiB),
                    volume_capabilities=[CAPABILITY],
                    parameters=xfs,
                    volume_content_source=content,
                )
            ).volume
            made.append(copy.volume_id)
            assert copy.volume_context["mountOptions"].split(",") == ["nouuid"], name
            mounted = node.up(copy, name)  # beside the source, mounted all along
            assert (mounted / "data").read_bytes() == data, name
        assert (target / "data").read_bytes() == data
        node.down()
        for volume_id in made:
            c.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume_id))
        c.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id))
    finally:
        with contextlib.suppress(grpc.RpcError):
            node.down()
        channel.close()
        stop_plugin(proc)
    loopfiles = trusted_dir / "loopfiles"
    assert loops_backed_under(loopfiles) == []
    assert not any(loopfiles.rglob("*.img"))
