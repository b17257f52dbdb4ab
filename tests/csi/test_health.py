"""NodeGetVolumeHealth (node capability GET_VOLUME_HEALTH, CSI v1.13's successor of the removed
VOLUME_CONDITION): healthy is a successful reply with no entry; a volume this node cannot reach
is a successful reply with INACCESSIBLE, a CamelCase reason and a one-line message.

Real: a loopfile xfs volume staged and published by ``flexhub csi``, then its filesystem shut
down (``xfs_io -x -c shutdown``: every stat of it fails with EIO, as a filesystem that lost its
device does). A stat that hangs (a hard NFS mount whose server is gone) cannot be made on this
host without FUSE or a server to kill: that case is a unit with ``os.stat`` held.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from flexhub.csi import health
from flexhub.csi.proto import csi_pb2 as pb
from tests.conftest import needs_root
from tests.csi.sanity import LoopfilePlugin

INACCESSIBLE = pb.VolumeHealthErrorType.INACCESSIBLE
CAPABILITY = pb.VolumeCapability(
    mount=pb.VolumeCapability.MountVolume(),
    access_mode=pb.VolumeCapability.AccessMode(
        mode=pb.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER
    ),
)


def _entries(reply: Any) -> list[tuple[int, str, str]]:
    return [(e.status, e.reason, e.message) for e in reply.health_statuses]


def test_a_hanging_stat_is_inaccessible_in_time_and_takes_no_second_thread(
    monkeypatch: Any,
) -> None:
    release = threading.Event()
    real = os.stat

    def stuck(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) == "/stuck/volume":
            release.wait(30)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stuck)
    try:
        started = time.monotonic()
        reply = health.volume_health("v", [Path("/stuck/volume")], lambda _: True, 0.5)
        assert time.monotonic() - started < 5
        assert _entries(reply) == [
            (
                INACCESSIBLE,
                "StatTimeout",
                "/stuck/volume did not answer a stat within 0.5 s (its server unreachable?)",
            )
        ]
        started = time.monotonic()
        again = health.volume_health("v", [Path("/stuck/volume")], lambda _: True, 0.5)
        assert time.monotonic() - started < 0.4  # answered at once: the first stat still hangs
        assert _entries(again)[0][1] == "StatTimeout"
    finally:
        release.set()


def test_a_call_holds_one_bound_however_many_of_its_paths_hang(monkeypatch: Any) -> None:
    """A staging and a publish path on one dead server: probed at once, so the call holds a
    plugin worker one bound, not one a path (8 such calls took every worker for 2 bounds)."""
    release = threading.Event()
    real = os.stat

    def stuck(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).startswith("/dead/"):
            release.wait(30)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stuck)
    try:
        started = time.monotonic()
        paths = [Path("/dead/stage"), Path("/dead/target")]
        reply = health.volume_health("v", paths, lambda _: True, 1.0)
        took = time.monotonic() - started
        assert took < 1.8, took
        assert [e[1] for e in _entries(reply)] == ["StatTimeout"]
        assert "/dead/stage" in _entries(reply)[0][2] and "/dead/target" in _entries(reply)[0][2]
    finally:
        release.set()


def test_stale_paths_make_one_entry_and_an_unmounted_path_another(monkeypatch: Any) -> None:
    real = os.stat

    def stale(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).startswith("/stale/"):
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stale)
    paths = [Path("/stale/stage"), Path("/stale/target"), Path("/gone")]
    reply = health.volume_health("vol-1", paths, lambda p: p != Path("/gone"), 5)
    assert reply.volume_id == "vol-1"
    assert _entries(reply) == [
        (
            INACCESSIBLE,
            "StaleMount",
            "/stale/stage is a stale or broken mount (Stale file handle); "
            "/stale/target is a stale or broken mount (Stale file handle)",
        ),
        (INACCESSIBLE, "NotMounted", "/gone holds no mount of the volume"),
    ]
    assert _entries(health.volume_health("vol-1", [Path("/")], lambda _: True, 5)) == []


@needs_root
@pytest.mark.root
def test_a_loopfile_volume_is_healthy_then_inaccessible_once_its_filesystem_is_down(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    trusted_dir = loopfile_plugin.top
    controller, node = loopfile_plugin.controller, loopfile_plugin.node
    stage, target = trusted_dir / "stage", trusted_dir / "pod" / "mount"
    stage.mkdir()
    (trusted_dir / "pod").mkdir()
    volume: Any = None
    try:
        caps = node.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest()).capabilities
        assert pb.NodeServiceCapability.RPC.Type.GET_VOLUME_HEALTH in {c.rpc.type for c in caps}
        volume = controller.CreateVolume(
            pb.CreateVolumeRequest(
                name="health",
                capacity_range=pb.CapacityRange(required_bytes=320 << 20),
                volume_capabilities=[CAPABILITY],
                parameters={"backend": "loopfile", "fsType": "xfs"},
            )
        ).volume
        vid = volume.volume_id
        with pytest.raises(grpc.RpcError) as unstaged:
            node.NodeGetVolumeHealth(pb.NodeGetVolumeHealthRequest(volume_id=vid))
        assert unstaged.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as no_id:
            node.NodeGetVolumeHealth(pb.NodeGetVolumeHealthRequest())
        assert no_id.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        node.NodeStageVolume(
            pb.NodeStageVolumeRequest(
                volume_id=vid,
                staging_target_path=str(stage),
                volume_capability=CAPABILITY,
                volume_context=volume.volume_context,
            )
        )
        node.NodePublishVolume(
            pb.NodePublishVolumeRequest(
                volume_id=vid,
                staging_target_path=str(stage),
                target_path=str(target),
                volume_capability=CAPABILITY,
            )
        )
        both = pb.NodeGetVolumeHealthRequest(
            volume_id=vid, staging_target_path=str(stage), volume_publish_path=str(target)
        )
        for request in (pb.NodeGetVolumeHealthRequest(volume_id=vid), both):
            reply = node.NodeGetVolumeHealth(request).volume_health
            assert (reply.volume_id, _entries(reply)) == (vid, [])
        # a staging path this node did not stage for the volume, or a volume it never
        # staged: NOT_FOUND, never a health report of whatever is mounted there
        for request in (
            pb.NodeGetVolumeHealthRequest(volume_id=vid, staging_target_path="/"),
            pb.NodeGetVolumeHealthRequest(
                volume_id="nope", staging_target_path="/proc", volume_publish_path="/proc"
            ),
            pb.NodeGetVolumeHealthRequest(volume_id="nope", volume_publish_path=str(target)),
        ):
            with pytest.raises(grpc.RpcError) as elsewhere:
                node.NodeGetVolumeHealth(request)
            assert elsewhere.value.code() == grpc.StatusCode.NOT_FOUND, request
        # a path the CO names that holds no mount: inaccessible, not an error
        nowhere = trusted_dir / "pod" / "never-published"
        reply = node.NodeGetVolumeHealth(
            pb.NodeGetVolumeHealthRequest(volume_id=vid, volume_publish_path=str(nowhere))
        ).volume_health
        assert _entries(reply) == [
            (INACCESSIBLE, "NotMounted", f"{nowhere} holds no mount of the volume")
        ]

        subprocess.run(["xfs_io", "-x", "-c", "shutdown", str(target)], check=True, timeout=60)
        reply = node.NodeGetVolumeHealth(both).volume_health
        assert _entries(reply) == [
            (
                INACCESSIBLE,
                "StaleMount",
                f"{stage} is a stale or broken mount (Input/output error); "
                f"{target} is a stale or broken mount (Input/output error)",
            )
        ]
        # the stats call still answers an error (v1.13's stats reply has no condition)
        with pytest.raises(grpc.RpcError) as stats:
            node.NodeGetVolumeStats(
                pb.NodeGetVolumeStatsRequest(volume_id=vid, volume_path=str(target))
            )
        assert stats.value.code() == grpc.StatusCode.INTERNAL
        assert "StaleMount" in (trusted_dir / "plugin.log").read_text()
    finally:
        if volume is not None:
            for call, request in (
                (node.NodeUnpublishVolume,
                 pb.NodeUnpublishVolumeRequest(volume_id=volume.volume_id,
                                               target_path=str(target))),
                (node.NodeUnstageVolume,
                 pb.NodeUnstageVolumeRequest(volume_id=volume.volume_id,
                                             staging_target_path=str(stage))),
                (controller.DeleteVolume, pb.DeleteVolumeRequest(volume_id=volume.volume_id)),
            ):  # fmt: skip
                with contextlib.suppress(grpc.RpcError):
                    call(request)


def test_two_calls_at_once_share_a_slow_stat_and_neither_says_timeout(monkeypatch: Any) -> None:
    """The health watcher's round and the kubelet's NodeGetVolumeStats (the same probe) on one
    path at once, its stat slow (0.3 s) but well within the bound: both see the answer. The
    second was 'did not answer a stat yet' (StatTimeout) at once: a false abnormal, which the
    watcher wrote as a VolumeConditionAbnormal Event."""
    real = os.stat

    def slow(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) == "/":
            time.sleep(0.3)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", slow)
    replies: list[Any] = []
    callers = [
        threading.Thread(
            target=lambda: replies.append(
                health.volume_health("v", [Path("/")], lambda _: True, 5.0)
            )
        )
        for _ in range(2)
    ]
    for caller in callers:
        caller.start()
        time.sleep(0.05)
    for caller in callers:
        caller.join(10)
    assert [_entries(r) for r in replies] == [[], []]
