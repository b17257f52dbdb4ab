"""flexhub's CSI node plugin on the test cluster, as the stock kubelet meets it: ``flexhub csi
--mode node`` on the host with its CSI socket in the kubelet's plugin directory, registering
itself through the kubelet's plugin watcher (``plugins_registry``), and the CSIDriver object.

The node plugin's only API calls are its health watcher's Events: :func:`node_plugin` runs it
with the chart node account's kubeconfig when given one (tests/cluster/accounts.py), else with
no API credentials at all (no kubeconfig, no service account, no ``KUBERNETES_*`` in its
environment: the watcher stays off).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Any

from kubernetes.client.rest import ApiException

from tests.cluster.cluster import NODE, Cluster, Process, free_port
from tests.cluster.csi_breaks import flexhub_argv
from tests.cluster.kube import eventually, mount_of
from tests.conftest import REPO

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
        "podInfoOnMount": True,
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


#: The tier's health watcher interval (the chart's default is 60 s).
HEALTH_INTERVAL = 5


def node_plugin(
    cluster: Cluster, health_port: int | None = None, kubeconfig: Path | None = None
) -> Process:
    """``flexhub csi --mode node`` with the cluster's node config (the FlexVolume driver's
    state directory and loopfile root: one node journal), its log ``flexhub-csi-node``; with
    ``kubeconfig`` (the chart's node account's) its health Events every
    :data:`HEALTH_INTERVAL` seconds."""
    port = free_port() if health_port is None else health_port
    argv = flexhub_argv("csi", "--mode", "node",
            "--endpoint", f"unix://{csi_socket(cluster)}",
            "--registration-dir", str(registration_dir(cluster)),
            "--node-id", NODE, "--health-port", str(port), "--log-level", "debug",
            "--config", str(cluster.config),
            "--health-interval", str(HEALTH_INTERVAL if kubeconfig else 0))  # fmt: skip
    if kubeconfig is not None:
        argv += ["--kubeconfig", str(kubeconfig)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "KUBERNETES_"))}
    env["PYTHONPATH"] = str(REPO)  # a broken plugin runs tests.cluster.csi_breaks
    log = cluster.logs / "flexhub-csi-node.log"
    start = log.stat().st_size if log.exists() else 0  # an earlier plugin's log is above
    proc = Process("flexhub-csi-node", argv, log, env=env)
    proc.health_port = port  # type: ignore[attr-defined]
    proc.log_start = start  # type: ignore[attr-defined]
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


def wait_registered(cluster: Cluster, proc: Process, times: int = 1, timeout: float = 60) -> None:
    """Until the kubelet has told ``proc`` (:func:`node_plugin`'s, since it started)
    ``times`` times that it registered the driver; a plugin that exits fails at once."""
    start = getattr(proc, "log_start", 0)

    def count() -> bool:
        if proc.popen.poll() is not None:
            raise AssertionError(f"the node plugin exited:\n{proc.tail()}")
        with open(proc.log, "rb") as log:
            log.seek(start)
            text = log.read().decode(errors="replace")
        return text.count(f"kubelet registered {DRIVER}") >= times

    eventually(f"the kubelet's registration #{times} of {DRIVER}", count, timeout=timeout)


def staging_path(cluster: Cluster, handle: str) -> Path:
    """The kubelet's staging path of a file system volume of the driver:
    ``<kubelet>/plugins/kubernetes.io/csi/<driver>/<sha256(handle)>/globalmount``."""
    digest = hashlib.sha256(handle.encode()).hexdigest()
    csi = cluster.kubelet_root / "plugins" / "kubernetes.io" / "csi"
    return csi / DRIVER / digest / "globalmount"


def publish_path(cluster: Cluster, pod_uid: str, pv: str) -> Path:
    """Where the kubelet has the plugin publish a pod's file system volume ``pv``."""
    return cluster.kubelet_root / "pods" / pod_uid / "volumes" / "kubernetes.io~csi" / pv / "mount"


def loops_backed_by(backing: Path) -> list[str]:
    """The loop devices whose backing file is ``backing`` (also once it was deleted: the
    kernel then says ``<path> (deleted)``)."""
    found = []
    for entry in sorted(Path("/sys/block").glob("loop*/loop/backing_file")):
        with contextlib.suppress(OSError):
            name = entry.read_text().strip()
            if name in (str(backing), f"{backing} (deleted)"):
                found.append(f"/dev/{entry.parent.parent.name}")
    return found


def unstage(cluster: Cluster, handle: str) -> bool:
    """Cleanup, not a check: the plugin's NodeUnstageVolume of a file system volume the
    kubelet left staged (docs/csi.md, "Known defect"); whether there was one to unstage. A
    refusal is printed, not raised (a cleanup must go on)."""
    import grpc

    from flexhub.csi.proto import csi_pb2, csi_pb2_grpc

    staging = staging_path(cluster, handle)
    if mount_of(staging) is None:
        return False
    request = csi_pb2.NodeUnstageVolumeRequest(volume_id=handle, staging_target_path=str(staging))
    with grpc.insecure_channel(f"unix://{csi_socket(cluster)}") as channel:
        try:
            csi_pb2_grpc.NodeStub(channel).NodeUnstageVolume(request, timeout=60)
        except grpc.RpcError as exc:
            print(f"cleanup: NodeUnstageVolume {handle}: {exc}")
    return True
