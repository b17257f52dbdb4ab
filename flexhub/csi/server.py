"""``flexhub csi``: the gRPC server on a unix socket, until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from flexhub.config import NodeConfig
from flexhub.errors import UsageError

__all__ = ["MODES", "build_server", "serve", "socket_path"]

LOG = logging.getLogger(__name__)

MODES = ("controller", "node", "both")
#: Calls served at once (the node's locks and :class:`~flexhub.csi.status.InFlight` order them).
WORKERS = 8


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


def _remove_stale(path: Path) -> None:
    """Remove a socket a previous plugin left, never anything else."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise UsageError(f"--endpoint: {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()
        return
    finally:
        probe.close()
    raise UsageError(f"--endpoint: another process serves {path}")


def build_server(config: NodeConfig, endpoint: str, mode: str, node_id: str) -> Any:
    """A started gRPC server serving ``mode``'s services on ``endpoint``."""
    from flexhub.csi.identity import IdentityService
    from flexhub.csi.proto import csi_pb2_grpc

    if mode not in MODES:
        raise UsageError(f"--mode {mode!r}: expected one of {', '.join(MODES)}")
    if not node_id:
        raise UsageError("--node-id: this node's name is required (default: $NODE_NAME)")
    path = socket_path(endpoint)
    path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    _remove_stale(path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS))
    controller = mode in ("controller", "both")
    csi_pb2_grpc.add_IdentityServicer_to_server(IdentityService(controller), server)  # type: ignore[no-untyped-call]
    if controller:
        from flexhub.csi.controller import ControllerService

        csi_pb2_grpc.add_ControllerServicer_to_server(ControllerService(config, node_id), server)  # type: ignore[no-untyped-call]
    if mode in ("node", "both"):
        from flexhub.csi.node import NodeService

        csi_pb2_grpc.add_NodeServicer_to_server(NodeService(config, node_id), server)  # type: ignore[no-untyped-call]
    old = os.umask(0o077)  # the socket: root's alone
    try:
        if not server.add_insecure_port(f"unix://{path}"):
            raise UsageError(f"--endpoint: cannot listen on {path}")
    finally:
        os.umask(old)
    server.start()
    LOG.info("serving CSI (%s) for node %s on %s", mode, node_id, path)
    return server


def serve(config: NodeConfig, endpoint: str, mode: str, node_id: str) -> int:
    """Serve until SIGTERM or SIGINT, then stop (calls in flight get 10 s)."""
    from flexhub.node.statedir import secure_state_dir

    secure_state_dir(config.state_dir)
    stop = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        LOG.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    server = build_server(config, endpoint, mode, node_id)
    stop.wait()
    server.stop(10).wait()
    return 0
