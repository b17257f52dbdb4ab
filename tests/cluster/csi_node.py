"""flexhub's CSI node plugin on the test cluster, as the stock kubelet meets it: ``flexhub csi
--mode node`` on the host with its CSI socket in the kubelet's plugin directory, registering
itself through the kubelet's plugin watcher (``plugins_registry``), and the CSIDriver object.

The node plugin runs with no API credentials at all (no kubeconfig, no service account, no
``KUBERNETES_*`` in its environment): it needs none.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from kubernetes.client.rest import ApiException

from tests.cluster.cluster import NODE, Cluster, Process, free_port

DRIVER = "flexhub.csi.k8s.io"
TOPOLOGY_KEY = "topology.flexhub.csi.k8s.io/node"

#: The CSIDriver object. To be replaced by the chart's render (deploy/helm, csi.enabled) once
#: the chart ships it: these are the fields issue #34 fixes for it.
CSI_DRIVER: dict[str, Any] = {
    "apiVersion": "storage.k8s.io/v1",
    "kind": "CSIDriver",
    "metadata": {"name": DRIVER},
    "spec": {
        "attachRequired": False,
        "podInfoOnMount": False,
        "fsGroupPolicy": "File",
        "volumeLifecycleModes": ["Persistent"],
    },
}


def plugin_dir(cluster: Cluster) -> Path:
    return cluster.kubelet_root / "plugins" / DRIVER


def csi_socket(cluster: Cluster) -> Path:
    return plugin_dir(cluster) / "csi.sock"


def registration_dir(cluster: Cluster) -> Path:
    return cluster.kubelet_root / "plugins_registry"


def registration_socket(cluster: Cluster) -> Path:
    return registration_dir(cluster) / f"{DRIVER}-reg.sock"


def node_plugin(cluster: Cluster, health_port: int | None = None) -> Process:
    """``flexhub csi --mode node`` with the cluster's node config (the FlexVolume driver's
    state directory and loopfile root: one node journal), its log ``flexhub-csi-node``."""
    port = free_port() if health_port is None else health_port
    argv = [sys.executable, "-m", "flexhub", "csi", "--mode", "node",
            "--endpoint", f"unix://{csi_socket(cluster)}",
            "--registration-dir", str(registration_dir(cluster)),
            "--node-id", NODE, "--health-port", str(port), "--log-level", "debug",
            "--config", str(cluster.config)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "KUBERNETES_"))}
    proc = Process("flexhub-csi-node", argv, cluster.logs / "flexhub-csi-node.log", env=env)
    proc.health_port = port  # type: ignore[attr-defined]
    return proc


def apply_csi_driver(cluster: Cluster) -> bool:
    """Create the CSIDriver object; ``False`` when one was there already (left as it is)."""
    try:
        cluster.storage.create_csi_driver(CSI_DRIVER)
    except ApiException as exc:
        if exc.status != 409:
            raise
        return False
    return True
