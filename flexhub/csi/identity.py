"""The CSI Identity service: the driver's name and version, its capabilities, readiness."""

from __future__ import annotations

from typing import Any

import grpc

from flexhub import __version__
from flexhub.csi import DRIVER_NAME
from flexhub.csi.proto import csi_pb2, csi_pb2_grpc
from flexhub.csi.status import rpc

__all__ = ["IdentityService"]

_Service = csi_pb2.PluginCapability.Service


class IdentityService(csi_pb2_grpc.IdentityServicer):
    """Identity RPCs; ``controller``: whether this process serves the Controller service."""

    def __init__(self, controller: bool) -> None:
        self.controller = controller

    @rpc
    def GetPluginInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return csi_pb2.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    @rpc
    def GetPluginCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        types = [_Service.Type.VOLUME_ACCESSIBILITY_CONSTRAINTS]
        if self.controller:
            types.insert(0, _Service.Type.CONTROLLER_SERVICE)
        return csi_pb2.GetPluginCapabilitiesResponse(
            capabilities=[csi_pb2.PluginCapability(service=_Service(type=t)) for t in types]
        )

    @rpc
    def Probe(self, request: Any, context: grpc.ServicerContext) -> Any:
        from google.protobuf import wrappers_pb2

        return csi_pb2.ProbeResponse(ready=wrappers_pb2.BoolValue(value=True))
