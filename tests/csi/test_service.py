"""The CSI services over a real gRPC unix socket, in process: identity, controller decisions
and the node's argument checks (the node's real stage and publish: test_sanity.py)."""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from flexhub import __version__
from flexhub.csi import DRIVER_NAME, TOPOLOGY_NODE_KEY
from flexhub.csi.proto import csi_pb2 as pb
from flexhub.csi.proto import csi_pb2_grpc as rpc
from flexhub.csi.server import build_server
from flexhub.errors import UsageError
from tests.conftest import needs_root
from tests.csi.sanity import LoopfilePlugin, plugin_config

Mode = pb.VolumeCapability.AccessMode.Mode
S = grpc.StatusCode


@dataclass
class Plugin:
    identity: Any
    controller: Any
    node: Any
    state: Path


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    servers: list[Any] = []
    channels: list[Any] = []

    def start(mode: str = "both", node_id: str = "node-1") -> Plugin:
        sock = tmp_path / f"{mode}-{node_id}.sock"
        servers.append(build_server(plugin_config(tmp_path), f"unix://{sock}", mode, node_id))
        channel = grpc.insecure_channel(f"unix://{sock}")
        channels.append(channel)
        return Plugin(
            rpc.IdentityStub(channel),
            rpc.ControllerStub(channel),
            rpc.NodeStub(channel),
            tmp_path / "state",
        )

    yield start
    for channel in channels:
        channel.close()
    for server in servers:
        server.stop(0)


def mount(mode: int = Mode.SINGLE_NODE_WRITER) -> Any:
    return pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(),
        access_mode=pb.VolumeCapability.AccessMode(mode=mode),
    )


def block() -> Any:
    return pb.VolumeCapability(
        block=pb.VolumeCapability.BlockVolume(),
        access_mode=pb.VolumeCapability.AccessMode(mode=Mode.SINGLE_NODE_WRITER),
    )


def create(plugin: Plugin, name: str = "pvc-a", size: int = 8 << 20, **kw: Any) -> Any:
    kw.setdefault("parameters", {"backend": "loopfile"})
    kw.setdefault("volume_capabilities", [mount()])
    request = pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=size), **kw
    )
    return plugin.controller.CreateVolume(request).volume


def refused(call: Any, request: Any) -> tuple[S, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call(request)
    return caught.value.code(), caught.value.details()


def test_identity_names_the_one_driver_and_what_this_process_serves(serve: Any) -> None:
    both, node_only = serve("both"), serve("node", "node-2")
    info = both.identity.GetPluginInfo(pb.GetPluginInfoRequest())
    assert (info.name, info.vendor_version) == (DRIVER_NAME, __version__)
    Type = pb.PluginCapability.Service.Type

    def services(plugin: Plugin) -> set[int]:
        reply = plugin.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest())
        return {c.service.type for c in reply.capabilities}

    assert services(both) == {Type.CONTROLLER_SERVICE, Type.VOLUME_ACCESSIBILITY_CONSTRAINTS}
    assert services(node_only) == {Type.VOLUME_ACCESSIBILITY_CONSTRAINTS}
    assert both.identity.Probe(pb.ProbeRequest()).ready.value is True
    code, _ = refused(node_only.controller.ControllerGetCapabilities,
                      pb.ControllerGetCapabilitiesRequest())  # fmt: skip
    assert code == S.UNIMPLEMENTED
    info = both.node.NodeGetInfo(pb.NodeGetInfoRequest())
    assert info.node_id == "node-1"
    assert dict(info.accessible_topology.segments) == {TOPOLOGY_NODE_KEY: "node-1"}


def test_a_retried_create_finds_the_first_volume_and_a_different_one_already_exists(
    serve: Any,
) -> None:
    plugin = serve()
    first = create(plugin)
    again = create(plugin)
    assert again == first
    assert first.volume_id.startswith("loopfile:")
    assert first.capacity_bytes == 8 << 20
    assert first.volume_context["backend"] == "loopfile"
    assert first.volume_context["file"].endswith(".img")
    assert [dict(t.segments) for t in first.accessible_topology] == [{TOPOLOGY_NODE_KEY: "node-1"}]
    code, message = refused(
        plugin.controller.CreateVolume,
        pb.CreateVolumeRequest(
            name="pvc-a",
            capacity_range=pb.CapacityRange(required_bytes=16 << 20),
            volume_capabilities=[mount()],
            parameters={"backend": "loopfile"},
        ),
    )
    assert code == S.ALREADY_EXISTS and "\n" not in message
    code, _ = refused(
        plugin.controller.CreateVolume,
        pb.CreateVolumeRequest(
            name="pvc-a",
            capacity_range=pb.CapacityRange(required_bytes=8 << 20),
            volume_capabilities=[mount()],
            parameters={"backend": "loopfile", "preallocate": "true"},
        ),
    )
    assert code == S.ALREADY_EXISTS
    other = create(plugin, "pvc-b")
    assert other.volume_id != first.volume_id


@pytest.mark.parametrize(
    ("parameters", "capability", "words"),
    [
        ({}, None, "backend"),
        ({"backend": "loopfile", "colour": "blue"}, None, "colour"),
        ({"backend": "nosuchbackend"}, None, "nosuchbackend"),
        ({"backend": "loopfile"}, "multi", "MULTI_NODE_MULTI_WRITER"),
    ],
)
def test_a_bad_create_is_invalid_argument_in_one_line_and_records_nothing(
    serve: Any, parameters: dict[str, str], capability: str | None, words: str
) -> None:
    plugin = serve()
    caps = {None: mount(), "multi": mount(Mode.MULTI_NODE_MULTI_WRITER)}
    request = pb.CreateVolumeRequest(
        name="pvc-bad",
        capacity_range=pb.CapacityRange(required_bytes=1 << 20),
        volume_capabilities=[caps[capability]],
        parameters=parameters,
    )
    code, message = refused(plugin.controller.CreateVolume, request)
    assert code == S.INVALID_ARGUMENT, message
    assert words in message and "\n" not in message
    assert not list((plugin.state / "csi" / "volumes").glob("*.json"))


def test_delete_is_idempotent_and_only_the_volume_s_node_deletes_a_node_local_volume(
    serve: Any,
) -> None:
    plugin = serve()
    elsewhere = create(
        plugin,
        "pvc-far",
        accessibility_requirements=pb.TopologyRequirement(
            preferred=[pb.Topology(segments={TOPOLOGY_NODE_KEY: "node-2"})]
        ),
    )
    assert [dict(t.segments) for t in elsewhere.accessible_topology] == [
        {TOPOLOGY_NODE_KEY: "node-2"}
    ]
    code, message = refused(
        plugin.controller.DeleteVolume, pb.DeleteVolumeRequest(volume_id=elsewhere.volume_id)
    )
    assert code == S.FAILED_PRECONDITION and "node-2" in message
    here = create(plugin, "pvc-here")
    for _ in range(2):
        plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=here.volume_id))
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id="never-made-here"))
    code, _ = refused(plugin.controller.DeleteVolume, pb.DeleteVolumeRequest())
    assert code == S.INVALID_ARGUMENT


def test_validate_confirms_what_is_served_and_not_found_for_an_unknown_volume(
    serve: Any,
) -> None:
    plugin = serve()
    volume = create(plugin)
    ok = plugin.controller.ValidateVolumeCapabilities(
        pb.ValidateVolumeCapabilitiesRequest(
            volume_id=volume.volume_id, volume_capabilities=[mount()]
        )
    )
    assert list(ok.confirmed.volume_capabilities) == [mount()]
    raw = plugin.controller.ValidateVolumeCapabilities(
        pb.ValidateVolumeCapabilitiesRequest(
            volume_id=volume.volume_id, volume_capabilities=[block()]
        )
    )
    assert list(raw.confirmed.volume_capabilities) == [block()]  # a block backend's device
    shared = block()
    shared.access_mode.mode = Mode.MULTI_NODE_MULTI_WRITER
    no = plugin.controller.ValidateVolumeCapabilities(
        pb.ValidateVolumeCapabilitiesRequest(
            volume_id=volume.volume_id, volume_capabilities=[shared]
        )
    )
    assert not no.HasField("confirmed") and "one node's" in no.message
    code, _ = refused(
        plugin.controller.ValidateVolumeCapabilities,
        pb.ValidateVolumeCapabilitiesRequest(
            volume_id="loopfile:00000000-0000-5000-8000-000000000000",
            volume_capabilities=[mount()],
        ),
    )
    assert code == S.NOT_FOUND


def test_node_calls_check_their_arguments_before_touching_anything(
    serve: Any, tmp_path: Path
) -> None:
    plugin = serve()
    stage = tmp_path / "stage"
    stage.mkdir()
    context = {"backend": "loopfile", "file": "a.img", "size": "8Mi"}
    cases = [
        (plugin.node.NodeStageVolume,
         pb.NodeStageVolumeRequest(staging_target_path=str(stage), volume_capability=mount(),
                                   volume_context=context), S.INVALID_ARGUMENT),
        (plugin.node.NodeStageVolume,
         pb.NodeStageVolumeRequest(volume_id="v", staging_target_path=str(stage),
                                   volume_context=context), S.INVALID_ARGUMENT),
        (plugin.node.NodeStageVolume,
         pb.NodeStageVolumeRequest(volume_id="v", staging_target_path="relative",
                                   volume_capability=mount(), volume_context=context),
         S.INVALID_ARGUMENT),
        (plugin.node.NodeStageVolume,
         pb.NodeStageVolumeRequest(volume_id="v", staging_target_path=str(stage),
                                   volume_capability=block(), volume_context=context),
         S.INVALID_ARGUMENT),
        (plugin.node.NodeStageVolume,
         pb.NodeStageVolumeRequest(volume_id="v", staging_target_path=str(stage),
                                   volume_capability=mount(), volume_context={"file": "a.img"}),
         S.INVALID_ARGUMENT),
        (plugin.node.NodePublishVolume,
         pb.NodePublishVolumeRequest(volume_id="v", staging_target_path=str(stage),
                                     target_path=str(tmp_path / "pod"),
                                     volume_capability=mount()), S.FAILED_PRECONDITION),
        (plugin.node.NodeUnpublishVolume,
         pb.NodeUnpublishVolumeRequest(volume_id="v"), S.INVALID_ARGUMENT),
        (plugin.node.NodeGetVolumeStats,
         pb.NodeGetVolumeStatsRequest(volume_id="v", volume_path=str(stage)), S.NOT_FOUND),
    ]  # fmt: skip
    for call, request, code in cases:
        assert refused(call, request)[0] == code, request
    assert not (tmp_path / "pod").exists()
    assert not list((tmp_path / "loopfiles").rglob("*.img"))


def test_a_live_socket_is_refused_and_a_stale_one_replaced(serve: Any, tmp_path: Path) -> None:
    import socket

    serve("both")
    with pytest.raises(UsageError, match="another process serves"):
        build_server(
            plugin_config(tmp_path), f"unix://{tmp_path / 'both-node-1.sock'}", "both", "n"
        )
    stale = tmp_path / "stale.sock"
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(stale))
    left.close()  # a socket file nobody listens on: a plugin that died
    server = build_server(plugin_config(tmp_path), f"unix://{stale}", "node", "n")
    server.stop(0)
    regular = tmp_path / "file.sock"
    regular.write_text("not a socket")
    with pytest.raises(UsageError, match="not a socket"):
        build_server(plugin_config(tmp_path), f"unix://{regular}", "node", "n")
    assert regular.read_text() == "not a socket"


def test_list_volumes_pages_by_token_and_refuses_a_foreign_token(serve: Any) -> None:
    plugin = serve()
    made = sorted(create(plugin, f"pvc-{n}").volume_id for n in range(5))
    page = plugin.controller.ListVolumes(pb.ListVolumesRequest(max_entries=2))
    seen = [e.volume.volume_id for e in page.entries]
    assert len(seen) == 2 and page.next_token
    # the last volume of the page is deleted before the next page is asked for
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=seen[-1]))
    while page.next_token:
        page = plugin.controller.ListVolumes(
            pb.ListVolumesRequest(max_entries=2, starting_token=page.next_token)
        )
        seen += [e.volume.volume_id for e in page.entries]
    assert sorted(seen) == made  # every volume once, none skipped
    everything = plugin.controller.ListVolumes(pb.ListVolumesRequest())
    assert len(everything.entries) == 4 and everything.next_token == ""
    code, _ = refused(plugin.controller.ListVolumes, pb.ListVolumesRequest(starting_token="zz"))
    assert code == S.ABORTED


def test_a_secret_never_reaches_a_reply_or_the_state_directory(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    plugin = serve()
    secret = "Sup3r-Secret-Value"
    code, message = refused(
        plugin.controller.CreateVolume,
        pb.CreateVolumeRequest(
            name="pvc-secret",
            capacity_range=pb.CapacityRange(required_bytes=1 << 20),
            volume_capabilities=[mount()],
            # a parameter that happens to hold the secret is named in the refusal
            parameters={"backend": "loopfile", "directory": f"a/{secret}/../b"},
            secrets={"password": secret},
        ),
    )
    assert code == S.INVALID_ARGUMENT and "directory" in message
    assert secret not in message and "***" in message
    code, message = refused(
        plugin.node.NodeStageVolume,
        pb.NodeStageVolumeRequest(
            volume_id="v",
            staging_target_path="/nonexistent",
            volume_capability=mount(),
            volume_context={"backend": "loopfile", "file": f"{secret}/../x.img", "size": "1Mi"},
            secrets={"password": secret},
        ),
    )
    assert code == S.INVALID_ARGUMENT and secret not in message
    assert secret not in caplog.text
    for path in plugin.state.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_controller_expansion_records_the_size_and_leaves_the_loop_file_to_the_node(
    serve: Any,
) -> None:
    plugin = serve()
    volume = create(plugin)
    grow = pb.ControllerExpandVolumeRequest(
        volume_id=volume.volume_id, capacity_range=pb.CapacityRange(required_bytes=16 << 20)
    )
    reply = plugin.controller.ControllerExpandVolume(grow)
    assert (reply.capacity_bytes, reply.node_expansion_required) == (16 << 20, True)
    assert plugin.controller.ControllerExpandVolume(grow) == reply  # idempotent
    smaller = pb.ControllerExpandVolumeRequest(
        volume_id=volume.volume_id, capacity_range=pb.CapacityRange(required_bytes=1 << 20)
    )
    assert plugin.controller.ControllerExpandVolume(smaller).capacity_bytes == 16 << 20
    # a retried create of the same name and its original size now finds a larger volume
    code, _ = refused(
        plugin.controller.CreateVolume,
        pb.CreateVolumeRequest(
            name="pvc-a",
            capacity_range=pb.CapacityRange(required_bytes=8 << 20, limit_bytes=8 << 20),
            volume_capabilities=[mount()],
            parameters={"backend": "loopfile"},
        ),
    )
    assert code == S.ALREADY_EXISTS
    code, _ = refused(
        plugin.controller.ControllerExpandVolume,
        pb.ControllerExpandVolumeRequest(
            volume_id="loopfile:00000000-0000-5000-8000-000000000000",
            capacity_range=pb.CapacityRange(required_bytes=1 << 30),
        ),
    )
    assert code == S.NOT_FOUND
    code, _ = refused(
        plugin.controller.ControllerExpandVolume,
        pb.ControllerExpandVolumeRequest(volume_id=volume.volume_id),
    )
    assert code == S.INVALID_ARGUMENT
    assert not list((plugin.state.parent / "loopfiles").rglob("*.img"))


def test_a_loopfile_class_bounds_its_volumes_at_create_and_expansion(serve: Any) -> None:
    """The class's maxSize: a larger CreateVolume is refused in one line, a growth past the
    bound the volume carries is OUT_OF_RANGE and leaves the record's size alone."""
    plugin = serve()
    bounded = {"backend": "loopfile", "maxSize": "16Mi"}
    code, message = refused(
        plugin.controller.CreateVolume,
        pb.CreateVolumeRequest(
            name="pvc-big",
            capacity_range=pb.CapacityRange(required_bytes=32 << 20),
            volume_capabilities=[mount()],
            parameters=bounded,
        ),
    )
    assert code == S.INVALID_ARGUMENT and "maxSize 16Mi" in message, message
    volume = create(plugin, parameters=bounded)
    assert volume.volume_context["maxSize"] == "16Mi"

    def grow(size: int) -> Any:
        return pb.ControllerExpandVolumeRequest(
            volume_id=volume.volume_id, capacity_range=pb.CapacityRange(required_bytes=size)
        )

    code, message = refused(plugin.controller.ControllerExpandVolume, grow(32 << 20))
    assert code == S.OUT_OF_RANGE and "32Mi" in message and "maxSize 16Mi" in message, message
    assert plugin.controller.ControllerExpandVolume(grow(16 << 20)).capacity_bytes == 16 << 20


def _room_allowed(root: Path) -> int:
    from flexhub_loopfile import _room

    room = _room.measure(root, root)
    return max(0, room.capacity - room.promised)


@needs_root
@pytest.mark.root
def test_get_capacity_is_the_loopfile_node_room_for_this_node_only(
    serve: Any, tmp_path: Path
) -> None:
    """What the room account still allows a new sparse file (overcommit 1), for this node's
    topology; a file promising more than the filesystem holds leaves no room."""
    plugin = serve()
    here = pb.Topology(segments={TOPOLOGY_NODE_KEY: "node-1"})
    request = pb.GetCapacityRequest(parameters={"backend": "loopfile"}, accessible_topology=here)
    reply = plugin.controller.GetCapacity(request)
    root = tmp_path / "loopfiles"
    assert abs(reply.available_capacity - _room_allowed(root)) < 64 << 20
    assert reply.available_capacity > 0
    assert reply.maximum_volume_size.value == reply.available_capacity
    # a class's maxSize bounds the largest volume, not the room (the scheduler reads it)
    bounded = pb.GetCapacityRequest(
        parameters={"backend": "loopfile", "maxSize": "16Mi"}, accessible_topology=here
    )
    small = plugin.controller.GetCapacity(bounded)
    assert small.maximum_volume_size.value == 16 << 20
    assert abs(small.available_capacity - reply.available_capacity) < 64 << 20
    # no parameters: every configured backend that knows its room (here loopfile alone)
    empty = plugin.controller.GetCapacity(pb.GetCapacityRequest())
    assert abs(empty.available_capacity - reply.available_capacity) < 64 << 20
    # another node's room is measured by that node's plugin
    there = pb.GetCapacityRequest(
        parameters={"backend": "loopfile"},
        accessible_topology=pb.Topology(segments={TOPOLOGY_NODE_KEY: "node-2"}),
    )
    code, message = refused(plugin.controller.GetCapacity, there)
    assert code == S.FAILED_PRECONDITION and "node-2" in message
    # a sparse file that promises more than the filesystem holds: no room left
    root.mkdir()
    vfs = os.statvfs(root)
    with open(root / "huge.img", "wb") as f:
        f.truncate(2 * vfs.f_blocks * vfs.f_frsize)
    assert plugin.controller.GetCapacity(request).available_capacity == 0
    caps = plugin.controller.ControllerGetCapabilities(pb.ControllerGetCapabilitiesRequest())
    Type = pb.ControllerServiceCapability.RPC.Type
    assert Type.GET_CAPACITY in {c.rpc.type for c in caps.capabilities}


def test_a_backend_without_capacity_says_not_supported() -> None:
    from flexhub.errors import NotSupported
    from flexhub.provisioning import Provisioning

    with pytest.raises(NotSupported):
        Provisioning().capacity({})


@needs_root
@pytest.mark.root
def test_a_volume_context_with_the_provisioner_s_identity_stages(
    loopfile_plugin: LoopfilePlugin,
) -> None:
    """external-provisioner adds ``storage.kubernetes.io/csiProvisionerIdentity`` to the
    volume attributes of every PV it makes (the kubelet passes them to NodeStageVolume):
    the CO's key, never the backend's option. Failed before: ``unknown option`` under the
    cluster tier's stock kubelet (tests/cluster/test_csi_scenarios.py)."""
    controller, node = loopfile_plugin.controller, loopfile_plugin.node
    stage = loopfile_plugin.top / "stage"
    stage.mkdir()
    volume = controller.CreateVolume(
        pb.CreateVolumeRequest(
            name="pvc-identity",
            capacity_range=pb.CapacityRange(required_bytes=8 << 20),
            volume_capabilities=[mount()],
            parameters={"backend": "loopfile"},
        )
    ).volume
    context = {
        **volume.volume_context,
        "storage.kubernetes.io/csiProvisionerIdentity": "1733432100000-8081-flexhub.csi.k8s.io",
    }
    request = pb.NodeStageVolumeRequest(
        volume_id=volume.volume_id,
        staging_target_path=str(stage),
        volume_capability=mount(),
        volume_context=context,
    )
    try:
        node.NodeStageVolume(request)
        assert os.path.ismount(stage)
    finally:
        node.NodeUnstageVolume(
            pb.NodeUnstageVolumeRequest(volume_id=volume.volume_id, staging_target_path=str(stage))
        )
        controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id))


@needs_root
@pytest.mark.root
def test_a_node_expand_of_a_chap_iscsi_volume_needs_no_chap_credentials(
    serve: Any, tmp_path: Path
) -> None:
    """NodeExpandVolume is FlexVolume's ``expandfs``: it logs in to nothing, so a staged CHAP
    volume's expansion without secrets (kubelet sends some only with ``nodeExpandSecretRef``;
    csi-sanity sends none) is not refused for want of CHAP credentials: it reaches the staged
    volume (here none is journalled: FAILED_PRECONDITION). A stage still needs them."""
    from flexhub.csi.records import StagedContexts

    plugin = serve()
    stage = tmp_path / "stage"
    stage.mkdir()
    context = {"backend": "iscsi", "targetPortal": "127.0.0.1:3260", "lun": "0",
               "iqn": "iqn.2026-01.io.flexhub.test:pvc-a", "chapAuthSession": "true"}  # fmt: skip
    volume_id = "iscsi:6f1c2a9e-1c7b-4a43-9b8e-3a1f0d2c4b5e"
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "stage", str(stage)], check=True)
    try:
        StagedContexts(plugin.state).put(stage, volume_id, context)
        code, message = refused(
            plugin.node.NodeExpandVolume,
            pb.NodeExpandVolumeRequest(
                volume_id=volume_id,
                volume_path=str(stage),
                staging_target_path=str(stage),
                capacity_range=pb.CapacityRange(required_bytes=64 << 20),
            ),
        )
        assert (code, "CHAP" in message) == (S.FAILED_PRECONDITION, False), message
        assert "is not mounted on this node" in message
    finally:
        subprocess.run(["umount", str(stage)], check=True)
    code, message = refused(
        plugin.node.NodeStageVolume,
        pb.NodeStageVolumeRequest(volume_id=volume_id, staging_target_path=str(stage),
                                  volume_capability=mount(), volume_context=context),
    )  # fmt: skip
    assert code == S.INVALID_ARGUMENT and "node.session.auth.username" in message, message


def test_an_id_or_path_with_a_control_character_is_refused_before_it_reaches_a_log(
    serve: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A volume id is a PV's ``volumeHandle``: whoever writes PVs writes it. One holding a
    newline would forge a line of the plugin's log; every id, name and path a request names is
    refused with INVALID_ARGUMENT, in one line, before anything logs or touches it."""
    plugin = serve()
    forged = "v\n2026-12-06 00:00:00 INFO flexhub: forged"
    stage = tmp_path / "stage"
    stage.mkdir()
    source = pb.VolumeContentSource(
        snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=forged)
    )
    cases = [
        (plugin.controller.DeleteVolume, pb.DeleteVolumeRequest(volume_id=forged)),
        (plugin.controller.CreateVolume,
         pb.CreateVolumeRequest(name=forged, volume_capabilities=[mount()],
                                parameters={"backend": "loopfile"})),
        (plugin.controller.CreateVolume,
         pb.CreateVolumeRequest(name="pvc-ok", volume_capabilities=[mount()],
                                parameters={"backend": "loopfile"},
                                volume_content_source=source)),
        (plugin.controller.DeleteSnapshot, pb.DeleteSnapshotRequest(snapshot_id=forged)),
        (plugin.node.NodeUnpublishVolume,
         pb.NodeUnpublishVolumeRequest(volume_id="v", target_path=str(tmp_path / "a\rb"))),
        (plugin.node.NodeUnstageVolume,
         pb.NodeUnstageVolumeRequest(volume_id=forged, staging_target_path=str(stage))),
        (plugin.node.NodeGetVolumeStats,
         pb.NodeGetVolumeStatsRequest(volume_id=forged, volume_path=str(stage))),
    ]  # fmt: skip
    with caplog.at_level(logging.DEBUG):
        for call, request in cases:
            code, message = refused(call, request)
            assert code == S.INVALID_ARGUMENT, request
            assert "\n" not in message and "\r" not in message and "control character" in message
    assert "forged" not in caplog.text
    assert not [r for r in caplog.records if "\n" in r.getMessage()]
    assert not list((tmp_path / "state").rglob("*.json"))


@pytest.mark.parametrize("char", ["\x85", "\x9b", "\x7f", "\u2028", "\u2029"])
def test_c1_controls_and_unicode_line_separators_are_refused_too(serve: Any, char: str) -> None:
    """U+0085 (NEL) ends a line like ``\\n``, U+009B starts a terminal escape, U+2028 and
    U+2029 end a line for ``str.splitlines`` and many log viewers."""
    plugin = serve()
    request = pb.DeleteVolumeRequest(volume_id=f"v{char}2026-12-06 00:00:00 INFO forged")
    code, message = refused(plugin.controller.DeleteVolume, request)
    assert code == S.INVALID_ARGUMENT and "control character" in message
    assert char not in message


def test_no_logged_line_of_any_request_field_breaks(
    serve: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Fields outside the naming set (parameters, contexts, mount flags, fs types), each with a
    newline: they are validated or quoted, and nothing logged holds one."""
    plugin = serve()
    forged = "x\n2026-12-06 00:00:00 INFO flexhub: forged"
    stage = tmp_path / "stage"
    stage.mkdir()
    capability = pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(fs_type=forged, mount_flags=[forged],
                                              volume_mount_group=forged),
        access_mode=pb.VolumeCapability.AccessMode(
            mode=pb.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER),
    )  # fmt: skip
    calls = [
        (plugin.controller.CreateVolume,
         pb.CreateVolumeRequest(name="pvc-a", volume_capabilities=[mount()],
                                parameters={"backend": "loopfile", forged: forged})),
        (plugin.controller.CreateVolume,
         pb.CreateVolumeRequest(name="pvc-b", volume_capabilities=[mount()],
                                parameters={"backend": forged})),
        (plugin.controller.CreateVolume,
         pb.CreateVolumeRequest(name="pvc-c", volume_capabilities=[capability],
                                parameters={"backend": "loopfile"})),
        (plugin.node.NodeStageVolume,
         pb.NodeStageVolumeRequest(volume_id="v", staging_target_path=str(stage),
                                   volume_capability=capability,
                                   volume_context={"backend": "loopfile", forged: forged})),
        (plugin.node.NodeStageVolume,
         pb.NodeStageVolumeRequest(volume_id="v", staging_target_path=str(stage),
                                   volume_capability=mount(),
                                   volume_context={"backend": "loopfile", "file": forged})),
        (plugin.controller.ValidateVolumeCapabilities,
         pb.ValidateVolumeCapabilitiesRequest(volume_id="v", volume_capabilities=[capability],
                                              volume_context={forged: forged},
                                              parameters={forged: forged})),
    ]  # fmt: skip
    with caplog.at_level(logging.DEBUG):
        for call, request in calls:
            try:
                call(request)
            except grpc.RpcError as exc:
                assert "\n" not in (exc.details() or "")
    broken = [r.getMessage() for r in caplog.records if "\n" in r.getMessage()]
    assert not broken, broken
