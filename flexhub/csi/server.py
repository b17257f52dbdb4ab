"""``flexhub csi``: the gRPC server on a unix socket, until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from flexhub.config import NodeConfig
from flexhub.csi.sockets import listen, remove_socket, remove_stale
from flexhub.errors import UsageError

__all__ = ["MODES", "build_server", "serve", "socket_path"]

LOG = logging.getLogger(__name__)

MODES = ("controller", "node", "both")
#: Calls served at once (the node's locks and :class:`~flexhub.csi.status.InFlight` order them).
WORKERS = 8
#: flexhub's namespace when neither --namespace nor the pod's service account names one.
DEFAULT_NAMESPACE = "flexhub-system"


def socket_path(endpoint: str) -> Path:
    """The path of ``unix:///path`` (or ``unix:/path``); only unix sockets are served."""
    path = ""
    if endpoint.startswith("unix://"):
        path = endpoint[len("unix://") :]
    elif endpoint.startswith("unix:"):
        path = endpoint[len("unix:") :]
        path = "" if path.startswith("//") else path
    if path.startswith("/") and not path.startswith("//") and "\0" not in path:
        return Path(os.path.normpath(path))
    raise UsageError(f"--endpoint {endpoint[:200]!r}: expected unix:///absolute/path")


def build_server(
    config: NodeConfig,
    endpoint: str,
    mode: str,
    node_id: str,
    node_service: Any = None,
    adoptions: Any = None,
) -> Any:
    """A started gRPC server serving ``mode``'s services on ``endpoint`` (the Node service
    ``node_service`` when given, else a new one; the controller reads converted volumes'
    records through ``adoptions``, :class:`flexhub.csi.adopted.Adoptions`, when given)."""
    from flexhub.csi.identity import IdentityService
    from flexhub.csi.proto import csi_pb2_grpc

    if mode not in MODES:
        raise UsageError(f"--mode {mode!r}: expected one of {', '.join(MODES)}")
    if not node_id:
        raise UsageError("--node-id: this node's name is required (default: $NODE_NAME)")
    path = socket_path(endpoint)
    path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    remove_stale(path, "--endpoint")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS))
    controller = mode in ("controller", "both")
    csi_pb2_grpc.add_IdentityServicer_to_server(IdentityService(controller), server)  # type: ignore[no-untyped-call]
    if controller:
        from flexhub.csi.controller import ControllerService

        service = ControllerService(config, node_id, adoptions)
        csi_pb2_grpc.add_ControllerServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    if mode in ("node", "both"):
        from flexhub.csi.node import NodeService

        node = node_service or NodeService(config, node_id)
        csi_pb2_grpc.add_NodeServicer_to_server(node, server)  # type: ignore[no-untyped-call]
    listen(server, path, "--endpoint")  # the socket: root's alone
    server.start()
    LOG.info("serving CSI (%s) for node %s on %s", mode, node_id, path)
    return server


def serve(
    config: NodeConfig,
    endpoint: str,
    mode: str,
    node_id: str,
    registration_dir: Path | None = None,
    kubelet_endpoint: str = "",
    health_port: int = 0,
    health_interval: float = 0,
    kubeconfig: Path | None = None,
    namespace: str = "",
) -> int:
    """Serve until SIGTERM or SIGINT, then stop (calls in flight get 10 s).

    With ``registration_dir`` (node or both mode) the kubelet's plugin registration is served
    there (:mod:`flexhub.csi.registration`) for the CSI socket ``kubelet_endpoint`` (default:
    the ``endpoint``'s path); with ``health_port`` an HTTP ``/healthz``
    (:mod:`flexhub.csi.liveness`); with ``health_interval`` (node or both mode) the health
    watcher's Events (:mod:`flexhub.csi.healthevents`, API client from ``kubeconfig`` or the
    pod's service account). The controller (controller or both mode) reads the records of
    converted volumes in ``namespace`` (default: the pod's) with the same client."""
    from flexhub.node.statedir import secure_state_dir

    if registration_dir is not None and mode not in ("node", "both"):
        raise UsageError("--registration-dir: only a node plugin (--mode node or both) registers")
    if not 0 <= health_port <= 65535:
        raise UsageError(f"--health-port {health_port}: expected 0 (off) to 65535")
    if not (health_interval == 0 or 1 <= health_interval <= 86400):
        raise UsageError(f"--health-interval {health_interval:g}: expected 0 (off) or 1 to 86400")
    if kubeconfig is not None and not kubeconfig.is_file():
        raise UsageError(f"--kubeconfig {kubeconfig}: no such file")
    path = socket_path(endpoint)
    seen_by_kubelet = _kubelet_path(kubelet_endpoint) if kubelet_endpoint else path
    secure_state_dir(config.state_dir)
    adoptions = None
    if mode in ("controller", "both"):
        from flexhub.csi.adopted import Adoptions
        from flexhub.csi.kubeapi import core_api, in_cluster, own_namespace

        core = core_api(kubeconfig, "converted volumes are not reclaimed")
        if core is None and (kubeconfig is not None or in_cluster()):
            # in a pod (or told a kubeconfig) and no client: a converted volume given Delete
            # would be answered "gone" and its storage left behind; better not to start
            raise UsageError(
                "the controller cannot load its API client (--kubeconfig, or the pod's service "
                "account token): it reads the records of converted volumes with it"
            )
        if core is not None:
            adoptions = Adoptions(core, namespace or own_namespace(DEFAULT_NAMESPACE))
    stop = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        LOG.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    node = None
    if mode in ("node", "both"):
        from flexhub.csi.node import NodeService

        node = NodeService(config, node_id)
        node.upgrade_records()
    server = build_server(config, endpoint, mode, node_id, node, adoptions)
    registrar = liveness = watcher = None
    try:
        if node is not None:
            from flexhub.csi import healthevents

            watcher = healthevents.start(node, node_id, health_interval, kubeconfig)
        if health_port:
            from flexhub.csi import liveness as live

            liveness = live.start(path, health_port)
        if registration_dir is not None:
            from flexhub.csi import registration

            registrar = registration.start(registration_dir, seen_by_kubelet)
        stop.wait()
    finally:
        if watcher is not None:
            watcher.stop()
        if registrar is not None:
            registrar.stop()  # first: the kubelet drops the plugin before its socket goes
        if liveness is not None:
            liveness.stop()
        server.stop(10).wait()
        remove_socket(path)
    return 0


def _kubelet_path(value: str) -> Path:
    """``--kubelet-endpoint``: an absolute path (or ``unix:///path``)."""
    if value.startswith("unix:"):
        return socket_path(value)
    if value.startswith("/") and "\0" not in value:
        return Path(os.path.normpath(value))
    raise UsageError(f"--kubelet-endpoint {value[:200]!r}: expected an absolute path")
