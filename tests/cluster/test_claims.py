"""PersistentVolumes of flexhub bound to claims by the real controller-manager, mounted by the
real kubelet: fsGroup, resize, two pods of one claim, a read-only claim."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.cluster import Cluster
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
MiB = 1024 * 1024


def _class(cluster: Cluster, name: str) -> str:
    """A StorageClass for hand-made PVs that allows expansion."""
    try:
        cluster.storage.create_storage_class(
            {
                "apiVersion": "storage.k8s.io/v1",
                "kind": "StorageClass",
                "metadata": {"name": name},
                "provisioner": "kubernetes.io/no-provisioner",
                "allowVolumeExpansion": True,
                "volumeBindingMode": "Immediate",
            }
        )
    except Exception as exc:
        if getattr(exc, "status", None) != 409:
            raise
    return name


def _pv_and_claim(
    cluster: Cluster,
    ns: str,
    name: str,
    options: dict[str, str],
    size: str = "64Mi",
    modes: tuple[str, ...] = ("ReadWriteOnce",),
    read_only: bool = False,
    fs_type: str = "ext4",
) -> Any:
    """A PV and a claim that selects it by class and size only (no volumeName, no claimRef):
    the binder must pair them."""
    sc = _class(cluster, "flexhub-manual")
    cluster.core.create_persistent_volume(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{ns}-{name}", "labels": {"claim": f"{ns}-{name}"}},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": list(modes),
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": sc,
                "flexVolume": flex(options, read_only=read_only, fs_type=fs_type),
            },
        }
    )
    cluster.core.create_namespaced_persistent_volume_claim(
        ns,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name},
            "spec": {
                "accessModes": list(modes),
                "storageClassName": sc,
                "selector": {"matchLabels": {"claim": f"{ns}-{name}"}},
                "resources": {"requests": {"storage": size}},
            },
        },
    )

    def bound() -> Any:
        claim = cluster.core.read_namespaced_persistent_volume_claim(name, ns)
        return claim if claim.status.phase == "Bound" else None

    claim = eventually(f"claim {ns}/{name} Bound", bound)
    assert claim.spec.volume_name == f"{ns}-{name}"
    return claim


def _claim_volume(claim: str, read_only: bool = False) -> dict[str, Any]:
    source: dict[str, Any] = {"claimName": claim}
    if read_only:
        source["readOnly"] = True
    return {"name": "data", "persistentVolumeClaim": source}


def _size_of(target: Path) -> int:
    out = subprocess.run(
        ["df", "--output=size", "-B1", str(target)], capture_output=True, text=True, check=True
    ).stdout
    return int(out.split()[-1])


def _resize(cluster: Cluster, ns: str, claim: str, size: str) -> None:
    cluster.core.patch_namespaced_persistent_volume_claim(
        claim, ns, {"spec": {"resources": {"requests": {"storage": size}}}}
    )
    eventually(
        f"PV capacity {size}",
        lambda: (
            cluster.core.read_persistent_volume(f"{ns}-{claim}").spec.capacity["storage"] == size
        ),
    )


def test_bound_claim_with_fsgroup_and_online_resize(cluster: Cluster) -> None:
    """Scenarios 2 and 5: the binder pairs the PV with the claim; the pod's fsGroup is applied
    as the README says (the volume's root directory gets the group and g+rwxs, nothing
    recursive); a resize of the claim on an expandable class raises the PV's capacity, the
    kubelet calls ``expandfs``, the filesystem grows and the claim's status says so. (xfs:
    this host cannot grow a mounted ext4, see the next test.)"""
    ns = namespace(cluster, "claims")
    _pv_and_claim(cluster, ns, "db", loopfile("db.img", "320Mi"), size="320Mi", fs_type="xfs")
    running = run_pod(cluster, ns, pod("db", [_claim_volume("db")], security={"fsGroup": 4321}))
    target = volume_dir(cluster, running.metadata.uid, f"{ns}-db")
    entry = mount_of(target)
    assert entry is not None and entry["fstype"] == "xfs"
    info = os.stat(target)
    assert info.st_gid == 4321
    assert info.st_mode & stat.S_ISGID and info.st_mode & stat.S_IRWXG == stat.S_IRWXG
    (target / "before").write_text("x")
    before = _size_of(target)
    _resize(cluster, ns, "db", "400Mi")
    claim = eventually(
        "claim status capacity 400Mi",
        lambda: (
            (
                c := cluster.core.read_namespaced_persistent_volume_claim("db", ns)
            ).status.capacity.get("storage")
            == "400Mi"
            and c
        ),
        timeout=120,
    )
    assert not claim.status.conditions or all(
        c.type != "FileSystemResizePending" for c in claim.status.conditions
    )
    expands = [c for c in cluster.driver_calls("expandfs") if c["volume"] == f"{ns}-db"]
    assert expands and expands[-1]["status"] == "Success"
    assert _size_of(target) > before + 60 * MiB
    backing = cluster.loopfile_root / "namespaces" / ns / "db.img"
    assert backing.stat().st_size == 400 * MiB
    assert (target / "before").read_text() == "x"
    delete_pod(cluster, ns, "db")
    assert mount_of(target) is None


def test_ext4_growth_this_host_cannot_do_fails_honestly(cluster: Cluster) -> None:
    """This host lacks CAP_SYS_RESOURCE, so resize2fs cannot grow a mounted ext4: the kubelet
    reports the driver's Failure (resize2fs's own words) and the claim's status keeps the old
    size instead of claiming a growth that did not happen."""
    ns = namespace(cluster, "ext4grow")
    _pv_and_claim(cluster, ns, "e", loopfile("e.img"))
    running = run_pod(cluster, ns, pod("e", [_claim_volume("e")]))
    target = volume_dir(cluster, running.metadata.uid, f"{ns}-e")
    _resize(cluster, ns, "e", "128Mi")
    failed = eventually(
        "a failed expandfs",
        lambda: [
            c
            for c in cluster.driver_calls("expandfs")
            if c["volume"] == f"{ns}-e" and c["status"] == "Failure"
        ],
    )
    assert "Permission denied to resize filesystem" in failed[-1]["message"]
    shown = eventually(
        "the kubelet's event",
        lambda: next((e for e in events(cluster, ns, "e") if "resize" in e.lower()), None),
    )
    assert "Permission denied to resize filesystem" in shown
    claim = cluster.core.read_namespaced_persistent_volume_claim("e", ns)
    assert claim.status.capacity["storage"] == "64Mi"
    assert _size_of(target) < 70 * MiB
    delete_pod(cluster, ns, "e")


def test_two_pods_share_a_claim_and_a_read_only_claim_cannot_write(cluster: Cluster) -> None:
    """Scenario 7: two pods of one RWO claim on the one node share the volume (what one
    writes the other reads); a pod mounting the claim ``readOnly`` gets a read-only mount."""
    ns = namespace(cluster, "shared")
    _pv_and_claim(cluster, ns, "shared", loopfile("shared.img"))
    first = run_pod(cluster, ns, pod("first", [_claim_volume("shared")]))
    second = run_pod(cluster, ns, pod("second", [_claim_volume("shared")]))
    reader = run_pod(
        cluster, ns, pod("reader", [_claim_volume("shared", read_only=True)], read_only=True)
    )
    a = volume_dir(cluster, first.metadata.uid, f"{ns}-shared")
    b = volume_dir(cluster, second.metadata.uid, f"{ns}-shared")
    r = volume_dir(cluster, reader.metadata.uid, f"{ns}-shared")
    (a / "from-first").write_text("one")
    assert (b / "from-first").read_text() == "one"
    entry = mount_of(r)
    assert entry is not None and "ro" in entry["options"].split(",")
    with pytest.raises(OSError):
        (r / "from-reader").write_text("no")
    for name in ("first", "second", "reader"):
        delete_pod(cluster, ns, name)
    assert all(mount_of(p) is None for p in (a, b, r))


def test_the_kubelet_s_volume_stats_of_a_flexvolume_claim_are_its_statvfs(
    cluster: Cluster,
) -> None:
    """Issue #34, the FlexVolume side: flexhub's ``init`` reports ``supportsMetrics``, so the
    kubelet statfs()es the pod's volume directory (MetricsStatFS) and reports it as its
    ``kubelet_volume_stats_*`` of the claim: equal to statvfs of the mount, and following it
    when a write uses 8 MiB more. (An inline volume has no claim: no series.)"""
    from tests.cluster import volume_stats

    ns = namespace(cluster, "flex-volstats")
    _pv_and_claim(cluster, ns, "stats", loopfile("stats.img"))
    running = run_pod(cluster, ns, pod("app", [_claim_volume("stats")]))
    target = volume_dir(cluster, running.metadata.uid, f"{ns}-stats")
    assert mount_of(target) is not None
    before = volume_stats.wait_equal(cluster, ns, "stats", target)
    assert before["capacity_bytes"] > 50 * MiB  # an ext4 of the 64 MiB loopfile
    assert before["inodes"] > before["inodes_used"] > 0

    (target / "payload").write_bytes(os.urandom(8 * MiB))
    os.sync()
    after = volume_stats.wait_equal(cluster, ns, "stats", target)
    assert after["used_bytes"] - before["used_bytes"] >= 8 * MiB
    assert after["inodes_used"] == before["inodes_used"] + 1
    delete_pod(cluster, ns, "app")
