"""A CSI controller endpoint that hands out *static* volumes, for a backend that does not provision.

A backend without the provisioning API (the scaffold's ``flexhub new-backend`` backend as
generated) is used under CSI the way it is used under FlexVolume: an admin writes a PV naming
its storage (``csi.volumeHandle`` and ``csi.volumeAttributes``, the backend's options) and
removes the storage by hand when the PV goes. csi-sanity makes its volumes through a controller,
so the test gives it this stand-in for the admin on a socket of its own
(``--csi.controllerendpoint``): ``CreateVolume`` answers with the volume attributes an admin
would write (``{backend: NAME, directory: <a name derived from the request's>}``),
``DeleteVolume`` removes the directory. It advertises no controller capability, so csi-sanity
runs none of its controller specs but the capability list and ValidateVolumeCapabilities against
it (its Identity is flexhub's IdentityService class, run in this process, not the plugin's); everything the node specs do goes to the real ``flexhub csi`` node service.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from flexhub.csi.identity import IdentityService
from flexhub.csi.proto import csi_pb2, csi_pb2_grpc


class StaticVolumes(csi_pb2_grpc.ControllerServicer):
    """Static volumes of backend ``backend``: directories under ``root``."""

    def __init__(self, backend: str, root: Path) -> None:
        self.backend, self.root = backend, root
        self.volumes: dict[str, dict[str, str]] = {}
        self.lock = threading.Lock()

    def ControllerGetCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        return csi_pb2.ControllerGetCapabilitiesResponse()

    def CreateVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.name or not request.volume_capabilities:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name and capabilities required")
        directory = "v" + uuid.uuid5(uuid.NAMESPACE_URL, request.name).hex
        volume_id = f"{self.backend}:{directory}"
        attributes = {"backend": self.backend, "directory": directory}
        with self.lock:
            self.volumes[volume_id] = attributes
        return csi_pb2.CreateVolumeResponse(
            volume=csi_pb2.Volume(volume_id=volume_id, volume_context=attributes)
        )

    def DeleteVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.volume_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "volume_id required")
        with self.lock:
            attributes = self.volumes.pop(request.volume_id, None)
        if attributes is not None:
            shutil.rmtree(self.root / attributes["directory"], ignore_errors=True)
        return csi_pb2.DeleteVolumeResponse()

    def ValidateVolumeCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.volume_id or not request.volume_capabilities:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "volume_id and capabilities required")
        with self.lock:
            known = request.volume_id in self.volumes
        if not known:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no volume {request.volume_id}")
        confirmed = csi_pb2.ValidateVolumeCapabilitiesResponse.Confirmed(
            volume_context=request.volume_context,
            volume_capabilities=request.volume_capabilities,
            parameters=request.parameters,
        )
        return csi_pb2.ValidateVolumeCapabilitiesResponse(confirmed=confirmed)


@contextlib.contextmanager
def static_controller(endpoint: Path, backend: str, root: Path) -> Iterator[StaticVolumes]:
    """:class:`StaticVolumes` served on the unix socket ``endpoint`` until the block ends."""
    service = StaticVolumes(backend, root)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    csi_pb2_grpc.add_ControllerServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    csi_pb2_grpc.add_IdentityServicer_to_server(IdentityService(True), server)  # type: ignore[no-untyped-call]
    if not server.add_insecure_port(f"unix://{endpoint}"):
        raise RuntimeError(f"cannot listen on {endpoint}")
    server.start()
    try:
        yield service
    finally:
        server.stop(5).wait()
