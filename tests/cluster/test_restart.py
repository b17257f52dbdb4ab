"""Scenario 6: the kubelet SIGKILLed and restarted under a running pod, and a pod deleted while
the kubelet is down (the restarted kubelet reconstructs the volume from disk and unmounts it)."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.cluster.cluster import Cluster
from tests.cluster.kube import (
    eventually,
    flex,
    loopfile,
    mount_of,
    namespace,
    pod,
    run_pod,
    volume_dir,
)

pytestmark = [pytest.mark.cluster, pytest.mark.root]


def _gone(cluster: Cluster, ns: str, name: str) -> bool:
    return name not in [p.metadata.name for p in cluster.core.list_namespaced_pod(ns).items]


def test_kubelet_killed_and_restarted(cluster: Cluster) -> None:
    ns = namespace(cluster, "restart")
    volume = {"name": "data", "flexVolume": flex(loopfile("r.img"))}
    running = run_pod(cluster, ns, pod("app", [volume]))
    target = volume_dir(cluster, running.metadata.uid, "data")
    (target / "kept").write_text("before the crash")

    # 1. SIGKILL with the pod running: after the restart the volume is still served and the
    #    kubelet does not mount it a second time (it is already a mount point).
    cluster.processes["kubelet"].kill()
    cluster.kubelet_restart()
    cluster.wait_node_ready()
    time.sleep(25)  # two of the kubelet's 10 s sync periods and its volume reconciler's loops
    assert cluster.core.read_namespaced_pod("app", ns).status.phase == "Running"
    mounts = [c for c in cluster.driver_calls("mount") if c["dir"] == str(target)]
    assert len(mounts) == 1, mounts
    assert mount_of(target) is not None
    assert (target / "kept").read_text() == "before the crash"

    # 2. The pod deleted while the kubelet is down: the object waits (Terminating); the
    #    restarted kubelet finds the volume on disk, unmounts it, and only then is it gone.
    cluster.processes["kubelet"].kill()
    cluster.core.delete_namespaced_pod("app", ns)
    time.sleep(3)
    assert not _gone(cluster, ns, "app"), "the pod went before its volume was torn down"
    assert mount_of(target) is not None
    cluster.kubelet_restart()
    eventually("pod gone after the kubelet's restart", lambda: _gone(cluster, ns, "app"), 180)
    unmounts = [c for c in cluster.driver_calls("unmount") if c["dir"] == str(target)]
    assert unmounts and unmounts[-1]["status"] == "Success"
    assert mount_of(target) is None
    backing = cluster.loopfile_root / "namespaces" / ns / "r.img"
    loops = subprocess.run(["losetup", "-j", str(backing)], capture_output=True, text=True)
    assert loops.stdout == "", f"still attached: {loops.stdout}"
    cluster.wait_node_ready()
