"""Pods with flexhub volumes under the real scheduler and kubelet (loopfile, on this host).

Each test drives the API only; what it asserts about the node (mounts, data, loop devices)
it reads from the kernel.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.cluster.cluster import NODE, Cluster
from tests.cluster.kube import (
    delete_pod,
    events,
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


def _loops_of(cluster: Cluster, fragment: str) -> list[str]:
    out = subprocess.run(
        ["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if fragment in line]


def test_inline_volume_pod_is_scheduled_mounted_and_torn_down(cluster: Cluster) -> None:
    """Scenario 1 and 4: an inline flexVolume pod, placed by the scheduler (no nodeName), runs
    with its volume a real mount holding what was written through it; deleting the pod runs
    ``unmount`` before the Pod object goes, and nothing stays mounted or attached."""
    ns = namespace(cluster, "inline")
    manifest = pod("app", [{"name": "data", "flexVolume": flex(loopfile("app.img"))}])
    running = run_pod(cluster, ns, manifest)
    assert running.spec.node_name == NODE  # the scheduler bound it
    target = volume_dir(cluster, running.metadata.uid, "data")
    entry = mount_of(target)
    assert entry is not None, f"{target} is not a mount point"
    assert entry["fstype"] == "ext4" and entry["source"].startswith("/dev/loop")
    (target / "hello").write_text("through the kubelet's mount\n")
    backing = cluster.loopfile_root / "namespaces" / ns / "app.img"
    assert backing.stat().st_size == 64 * 1024 * 1024
    assert _loops_of(cluster, str(backing)), "the backing file is not on a loop device"
    mounts = [c for c in cluster.driver_calls("mount") if c["dir"] == str(target)]
    assert [c["status"] for c in mounts] == ["Success"]

    delete_pod(cluster, ns, "app")
    # The Pod object is gone only after the kubelet tore its volumes down.
    unmounts = [c for c in cluster.driver_calls("unmount") if c["dir"] == str(target)]
    assert unmounts and unmounts[-1]["status"] == "Success"
    assert mount_of(target) is None
    assert not _loops_of(cluster, str(backing)), "the loop device outlived the pod"
    # The data is in the file: mount it again by hand, read-only.
    check = subprocess.run(
        ["debugfs", "-R", "cat /hello", str(backing)], capture_output=True, text=True, check=True
    )
    assert check.stdout == "through the kubelet's mount\n"


def test_bad_options_fail_the_mount_with_flexhubs_message(cluster: Cluster) -> None:
    """A pod whose options break the backend's schema never starts; the kubelet reports the
    driver's one-line Failure in the pod's Events."""
    ns = namespace(cluster, "badopts")
    manifest = pod("app", [{"name": "data", "flexVolume": flex(loopfile("../escape.img"))}])
    cluster.core.create_namespaced_pod(ns, manifest)
    message = eventually(
        "FailedMount event",
        lambda: next((e for e in events(cluster, ns, "app") if "FailedMount" in e), None),
    )
    assert "file" in message and "escape" not in str(list(cluster.loopfile_root.rglob("*")))
    assert cluster.core.read_namespaced_pod("app", ns).status.phase == "Pending"
    delete_pod(cluster, ns, "app")
