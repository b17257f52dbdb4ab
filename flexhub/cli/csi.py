"""``flexhub csi``: the CSI plugin (Identity, Controller and/or Node over gRPC)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["register"]


def csi(
    endpoint: Annotated[
        str, typer.Option(help="unix:///path of the socket to serve (created 0600)")
    ] = "unix:///csi/csi.sock",
    mode: Annotated[str, typer.Option(help="controller, node or both")] = "both",
    node_id: Annotated[
        str, typer.Option(help="this node's name (default: $NODE_NAME, else the host name)")
    ] = "",
    config: Annotated[
        Path | None, typer.Option(help="flexhub node config (default: FLEXHUB_CONFIG)")
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error")] = "info",
    registration_dir: Annotated[
        Path | None,
        typer.Option(
            help="the kubelet's plugins_registry: register this node plugin with the kubelet "
            "(serves <dir>/flexhub.csi.k8s.io-reg.sock; node or both mode)"
        ),
    ] = None,
    kubelet_endpoint: Annotated[
        str,
        typer.Option(
            help="the CSI socket's path as the kubelet sees it, given it at registration "
            "(default: the --endpoint path)"
        ),
    ] = "",
    health_port: Annotated[
        int, typer.Option(help="serve HTTP GET /healthz on this port (0: off)")
    ] = 0,
    health_interval: Annotated[
        float,
        typer.Option(
            help="seconds between the node plugin's checks of its published volumes: one "
            "turned abnormal is a Warning Event VolumeConditionAbnormal on its pod (0: off; else 1 "
            "to 86400)"
        ),
    ] = 60,
    kubeconfig: Annotated[
        Path | None,
        typer.Option(
            help="kubeconfig of the health Events and of the converted volumes' records "
            "(default: the pod's service account; neither: no Events, and no converted volume "
            "is reclaimed)"
        ),
    ] = None,
    namespace: Annotated[
        str,
        typer.Option(
            help="flexhub's namespace, where flexhub convert leaves the records of converted "
            "volumes (default: $POD_NAMESPACE, else the service account's, else flexhub-system)"
        ),
    ] = "",
) -> int:
    """Serve CSI for every installed backend (logs to stderr; runs until SIGTERM)."""
    import logging

    from flexhub.config import load_config
    from flexhub.csi.server import serve

    level = getattr(logging, log_level.upper(), None)
    if not isinstance(level, int):
        raise typer.BadParameter(f"--log-level {log_level!r}: debug, info, warning or error")
    root = logging.getLogger()
    if not any(isinstance(h, logging.StreamHandler) for h in root.handlers):
        # a long-running service logs to stderr (the admin CLI logs nowhere without --debug)
        logging.basicConfig(
            level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
        )
    root.setLevel(level)
    from flexhub.driver.logsetup import RememberedRedact

    for handler in root.handlers:  # a secret a request carried never reaches the log
        handler.addFilter(RememberedRedact())
    node = node_id or os.environ.get("NODE_NAME", "") or socket.gethostname()
    return serve(
        load_config(config),
        endpoint,
        mode,
        node,
        registration_dir=registration_dir,
        kubelet_endpoint=kubelet_endpoint,
        health_port=health_port,
        health_interval=health_interval,
        kubeconfig=kubeconfig,
        namespace=namespace,
    )


def register(app: typer.Typer) -> None:
    app.command()(csi)
