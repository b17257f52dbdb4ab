"""``--health-port``: an HTTP liveness endpoint, ``GET /healthz``, as a pod's liveness probe
calls it (instead of the upstream livenessprobe sidecar).

Each request calls the plugin's own ``Probe`` over its CSI socket (so a socket that no longer
answers fails it too): 200 ``ok`` when it answers ready, 500 with a one-line reason otherwise.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = ["PROBE_TIMEOUT", "Liveness", "probe", "start"]

LOG = logging.getLogger(__name__)

#: How long one ``/healthz`` waits for the plugin's Probe (a kubelet probe's default is 1 s;
#: an operator sets timeoutSeconds above this).
PROBE_TIMEOUT = 3.0


def probe(socket: Path, timeout: float = PROBE_TIMEOUT) -> str:
    """Call ``Probe`` on the CSI socket: ``""`` when ready, else why not (one line)."""
    import grpc

    from flexhub.csi.proto import csi_pb2, csi_pb2_grpc

    try:
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            reply = csi_pb2_grpc.IdentityStub(channel).Probe(  # type: ignore[no-untyped-call]
                csi_pb2.ProbeRequest(), timeout=timeout
            )
    except grpc.RpcError as exc:
        detail = " ".join(str(exc.details() or "").split())[:300]
        return f"Probe failed: {exc.code().name} {detail}".rstrip()
    if reply.HasField("ready") and not reply.ready.value:
        return "Probe answered not ready"
    return ""


class Liveness:
    """The running HTTP server (:attr:`port` is the one it bound)."""

    def __init__(self, server: ThreadingHTTPServer) -> None:
        self.server = server
        self.port: int = server.server_address[1]
        self.thread = threading.Thread(target=server.serve_forever, name="healthz", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start(socket: Path, port: int, host: str = "") -> Liveness:
    """Serve ``/healthz`` on ``host:port`` (all interfaces by default, as a pod's probe
    reaches it) for the plugin on the CSI ``socket``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/healthz":
                self._answer(404, "not found: only /healthz is served")
                return
            trouble = probe(socket)
            if trouble:
                LOG.warning("liveness: %s", trouble)
            self._answer(500 if trouble else 200, trouble or "ok")

        def _answer(self, code: int, text: str) -> None:
            body = f"{text}\n".encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            LOG.debug("healthz: " + format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    live = Liveness(server)
    LOG.info("serving /healthz on port %d", live.port)
    return live
