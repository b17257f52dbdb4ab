"""The kubelet's ``kubelet_volume_stats_*`` gauges of a claim, read from its own ``/metrics``,
against ``statvfs`` of the pod's volume (issue #34).

The kubelet computes a pod's volume stats every ``volumeStatsAggPeriod`` (5 s in the tier):
``NodeGetVolumeStats`` for a CSI volume, ``statfs`` of the pod's volume directory for a
FlexVolume one whose driver reports ``supportsMetrics``. Its collector
(pkg/kubelet/metrics/collectors/volume_stats.go) reports them, by namespace and claim, for the
pods its stats provider lists; the CRI stats provider lists a pod only when the runtime gives
stats of its containers (tests/cluster/cmd/fakecri: zeros).
"""

from __future__ import annotations

import json
import os
import re
import ssl
import urllib.error
import urllib.request
from pathlib import Path

from tests.cluster.cluster import Cluster
from tests.cluster.kube import eventually

#: The gauges, by their name after ``kubelet_volume_stats_``.
NAMES = ("capacity_bytes", "available_bytes", "used_bytes", "inodes", "inodes_free", "inodes_used")
_SAMPLE = re.compile(r"^kubelet_volume_stats_(\w+)\{([^}]*)\} (\S+)$", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def kubelet_get(cluster: Cluster, path: str) -> str:
    """GET from the kubelet's own port with the admin's token (its webhook authenticates it)."""
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE
    request = urllib.request.Request(
        f"https://127.0.0.1:{cluster.ports['kubelet']}{path}",
        headers={"Authorization": f"Bearer {cluster.token}"},
    )
    with urllib.request.urlopen(request, context=insecure, timeout=20) as reply:
        return str(reply.read().decode())


def gauges(cluster: Cluster, ns: str, claim: str) -> dict[str, int]:
    """The claim's ``kubelet_volume_stats_*`` samples on the kubelet's /metrics, by name."""
    found = {}
    for name, labels, value in _SAMPLE.findall(kubelet_get(cluster, "/metrics")):
        claim_of = dict(_LABEL.findall(labels))
        if name in NAMES and claim_of == {"namespace": ns, "persistentvolumeclaim": claim}:
            found[name] = int(float(value))
    return found


def statvfs(path: Path) -> dict[str, int]:
    """What the gauges of the volume mounted at ``path`` should be (the kubelet's
    pkg/volume/util/fs.Info definitions, which flexhub's NodeGetVolumeStats follows)."""
    st = os.statvfs(path)
    return {
        "capacity_bytes": st.f_blocks * st.f_frsize,
        "available_bytes": st.f_bavail * st.f_frsize,
        "used_bytes": (st.f_blocks - st.f_bfree) * st.f_frsize,
        "inodes": st.f_files,
        "inodes_free": st.f_ffree,
        "inodes_used": st.f_files - st.f_ffree,
    }


def _summary_pods(cluster: Cluster) -> list[str] | str:
    """The pods of the kubelet's stats summary (its stats provider's ListPodStats), or why
    the kubelet could not make one."""
    try:
        summary = json.loads(kubelet_get(cluster, "/stats/summary"))
    except urllib.error.HTTPError as exc:
        return f"{exc.code}: {exc.read().decode(errors='replace')[:500]}"
    return [f"{p['podRef']['namespace']}/{p['podRef']['name']}" for p in summary.get("pods") or []]


def wait_equal(
    cluster: Cluster, ns: str, claim: str, path: Path, timeout: float = 90
) -> dict[str, int]:
    """Wait until the claim's six gauges equal statvfs of ``path`` (bytes within a block,
    inodes within one: read at two moments); return them."""
    block = os.statvfs(path).f_frsize
    last: dict[str, object] = {}

    def equal() -> dict[str, int] | None:
        got, want = gauges(cluster, ns, claim), statvfs(path)
        last.update(gauges=got, statvfs=want)
        if set(got) != set(NAMES):
            return None
        for name in NAMES:
            slack = 1 if name.startswith("inodes") else block
            if abs(got[name] - want[name]) > slack:
                return None
        return got

    try:
        return eventually(f"kubelet_volume_stats_* of {ns}/{claim} equal to statvfs", equal,
                          timeout)  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}\nlast: {last}\npods in the kubelet's /stats/summary: {_summary_pods(cluster)}"
        ) from None
