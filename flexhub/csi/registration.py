"""The kubelet's plugin registration, served by flexhub itself (no node-driver-registrar).

The kubelet's plugin watcher watches its ``plugins_registry`` directory; for a socket that
appears there it calls the ``pluginregistration.Registration`` service on it: ``GetInfo``
(which plugin, where its CSI socket is as the kubelet sees it, which versions) and then
``NotifyRegistrationStatus`` (whether the kubelet took it). The kubelet drops the plugin when
the socket goes away, so a clean stop removes it; a crash leaves it, and the next start
replaces it (:func:`~flexhub.csi.sockets.remove_stale`), which the watcher sees as a new
plugin: the kubelet registers it again.
"""

from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from flexhub.csi import DRIVER_NAME
from flexhub.csi.proto import pluginregistration_pb2, pluginregistration_pb2_grpc
from flexhub.csi.sockets import listen, remove_socket, remove_stale
from flexhub.errors import UsageError

__all__ = ["PLUGIN_TYPE", "SUPPORTED_VERSIONS", "Registrar", "RegistrationService", "start"]

LOG = logging.getLogger(__name__)

#: The kubelet's name for a CSI plugin (``k8s.io/kubelet/pkg/apis/pluginregistration/v1``).
PLUGIN_TYPE = "CSIPlugin"
#: The CSI versions this plugin speaks, as the kubelet's CSI plugin checks them.
SUPPORTED_VERSIONS = ("1.0.0",)


def registration_socket(directory: Path) -> Path:
    """Where the registration service listens: ``<directory>/<driver>-reg.sock``."""
    return directory / f"{DRIVER_NAME}-reg.sock"


class RegistrationService(pluginregistration_pb2_grpc.RegistrationServicer):
    """``GetInfo`` and ``NotifyRegistrationStatus``; ``endpoint``: the CSI socket's path as
    the kubelet sees it."""

    def __init__(self, endpoint: Path) -> None:
        self.endpoint = endpoint

    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        LOG.info("kubelet asked for the plugin's registration info")
        return pluginregistration_pb2.PluginInfo(
            type=PLUGIN_TYPE,
            name=DRIVER_NAME,
            endpoint=str(self.endpoint),
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    def NotifyRegistrationStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.plugin_registered:
            LOG.info("kubelet registered %s (CSI socket %s)", DRIVER_NAME, self.endpoint)
        else:
            error = " ".join(str(request.error).split())[:500] or "no reason given"
            LOG.error("kubelet refused to register %s: %s", DRIVER_NAME, error)
        return pluginregistration_pb2.RegistrationStatusResponse()


@dataclass
class Registrar:
    """The running registration server and its socket."""

    server: Any
    path: Path

    def stop(self, grace: float = 1) -> None:
        """Remove the socket first (the kubelet drops the plugin), then stop serving."""
        remove_socket(self.path)
        self.server.stop(grace).wait()


def start(directory: Path, endpoint: Path) -> Registrar:
    """Serve the registration service in ``directory`` for the CSI socket ``endpoint``."""
    if not directory.is_absolute() or not endpoint.is_absolute():
        raise UsageError("--registration-dir and --kubelet-endpoint must be absolute paths")
    directory.mkdir(mode=0o750, parents=True, exist_ok=True)
    path = registration_socket(directory)
    remove_stale(path, "--registration-dir")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(  # type: ignore[no-untyped-call]
        RegistrationService(endpoint), server
    )
    listen(server, path, "--registration-dir")
    server.start()
    LOG.info("serving plugin registration on %s (CSI socket %s)", path, endpoint)
    return Registrar(server, path)
