"""flexhub's CSI node plugin under the stock kubelet (tests/cluster/csi_node.py): the kubelet
finds it through its plugin watcher, stages and publishes static CSI PVs of loopfile (a file
system and a raw block device) for pods the scheduler placed, keeps them across a plugin
crash, reads their stats and their health; the plugin's own health watcher makes a volume
turned abnormal a Warning Event on its pod. Everything about the node is read from the kernel
(mountinfo, loop devices, the backing files) or from the kubelet and the API server.

The plugin runs with the chart node account's token (tests/cluster/accounts.py: events create
and patch, nothing else) and ``--health-interval`` 5 s.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import csi_node
from tests.cluster.accounts import Accounts
from tests.cluster.cluster import NODE, Cluster, Process
from tests.cluster.kube import IMAGE, delete_pod, eventually, loopfile, namespace, run_pod
from tests.cluster.volume_stats import kubelet_get

pytestmark = [pytest.mark.cluster, pytest.mark.root]

DRIVER = csi_node.DRIVER


@pytest.fixture(scope="module")
def plugin(cluster: Cluster, accounts: Accounts) -> Iterator[Process]:
    created = csi_node.apply_csi_driver(cluster)  # else the chart's, applied with the accounts
    proc = csi_node.node_plugin(cluster, kubeconfig=accounts.kubeconfig("csi-node"))
    try:
        _wait_registered(cluster, proc, 1)
        yield proc
    finally:
        try:
            _unstage_leftovers(cluster)
        finally:
            proc.stop()
            if created:
                cluster.storage.delete_csi_driver(DRIVER)


#: Each static volume made here: (volume handle, pv name, raw block).
_VOLUMES: list[tuple[str, str, bool]] = []


def _unstage_leftovers(cluster: Cluster) -> None:
    """Cleanup, not a check: unstage what the kubelet left staged (a volume whose claim a
    test left in use), by the plugin's own NodeUnstageVolume, so the package's later tests
    find no mount or loop device of this module's."""
    import grpc

    from flexhub.csi.proto import csi_pb2, csi_pb2_grpc

    csi = cluster.kubelet_root / "plugins" / "kubernetes.io" / "csi"
    with grpc.insecure_channel(f"unix://{csi_node.csi_socket(cluster)}") as channel:
        node = csi_pb2_grpc.NodeStub(channel)
        for handle, pv, block in _VOLUMES:
            staging = (
                csi / "volumeDevices" / "staging" / pv
                if block
                else csi_node.staging_path(cluster, handle)
            )
            if staging.exists():
                request = csi_pb2.NodeUnstageVolumeRequest(
                    volume_id=handle, staging_target_path=str(staging)
                )
                try:
                    node.NodeUnstageVolume(request, timeout=60)
                except grpc.RpcError as exc:
                    print(f"cleanup: NodeUnstageVolume {handle}: {exc}")
    _VOLUMES.clear()


def _registrations(proc: Process) -> int:
    """How often the kubelet told this plugin (over its log's lifetime) it registered it."""
    return proc.log.read_text(errors="replace").count(f"kubelet registered {DRIVER}")


def _wait_registered(cluster: Cluster, proc: Process, times: int) -> None:
    def registered() -> bool:
        if proc.popen.poll() is not None:
            raise AssertionError(f"the node plugin exited:\n{proc.tail()}")
        return _registrations(proc) >= times

    eventually(f"the kubelet's registration #{times} of {DRIVER}", registered, timeout=60)


# ------------------------------------------------------------------------------ helpers


def _mounts_at(path: Path) -> list[list[str]]:
    """Every mountinfo entry at ``path`` (field 0 is the mount id)."""
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return [line.split() for line in lines if line.split()[4] == str(path)]


def _mounts_below(path: Path) -> list[str]:
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return [f[4] for f in (line.split() for line in lines) if f[4].startswith(f"{path}/")]


def _loops_of(backing: Path) -> list[str]:
    out = subprocess.run(
        ["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [line for line in out.splitlines() if line.split()[-1:] == [str(backing)]]


def _backing(cluster: Cluster, ns: str, file: str) -> Path:
    return cluster.loopfile_root / "namespaces" / ns / file


def _static_volume(
    cluster: Cluster, ns: str, name: str, block: bool = False, size: str = "64Mi"
) -> tuple[str, str]:
    """A static CSI PV of a loopfile volume (its attributes a FlexVolume PV's options, plus the
    claim's namespace) and a claim bound to it; returns (pv, claim) names."""
    pv, claim = f"{name}-{uuid.uuid4().hex[:6]}", name
    mode = "Block" if block else "Filesystem"
    attributes = {**loopfile(f"{name}.img", size), "flexhub.csi/namespace": ns}
    cluster.core.create_persistent_volume(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "volumeMode": mode,
                "storageClassName": "",
                "claimRef": {"namespace": ns, "name": claim},
                "csi": {
                    "driver": DRIVER,
                    "volumeHandle": f"static:{ns}:{name}",
                    "volumeAttributes": attributes,
                },
                "nodeAffinity": {
                    "required": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": csi_node.TOPOLOGY_KEY,
                                        "operator": "In",
                                        "values": [NODE],
                                    }
                                ]
                            }
                        ]
                    }
                },
            },
        }
    )
    cluster.core.create_namespaced_persistent_volume_claim(
        ns,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "volumeMode": mode,
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": size}},
            },
        },
    )

    def bound() -> bool:
        return bool(cluster.core.read_namespaced_persistent_volume_claim(claim, ns).status.phase
                    == "Bound")  # fmt: skip

    eventually(f"claim {ns}/{claim} Bound", bound)
    _VOLUMES.append((f"static:{ns}:{name}", pv, block))
    return pv, claim


def _claim_pod(name: str, claim: str, block: bool = False) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "app", "image": IMAGE}
    if block:
        container["volumeDevices"] = [{"name": "data", "devicePath": "/dev/xvda"}]
    else:
        container["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}],
        },
    }


def _mount_dir(cluster: Cluster, uid: str, pv: str) -> Path:
    return cluster.kubelet_root / "pods" / uid / "volumes" / "kubernetes.io~csi" / pv / "mount"


def _tcp_peers(pid: int) -> list[str]:
    """The remote ends of ``pid``'s TCP sockets (``ip:port`` in /proc's hex), one per socket."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        match = re.fullmatch(r"socket:\[(\d+)\]", target)
        if match:
            inodes.add(match.group(1))
    peers = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes and fields[2] not in ("00000000:0000", "0" * 32 + ":0000"):
                peers.append(fields[2])
    return peers


# ------------------------------------------------------------------------------ tests


def test_kubelet_registers_the_plugin_through_its_plugin_watcher(
    cluster: Cluster, plugin: Process
) -> None:
    """(a) The kubelet called GetInfo on flexhub's registration socket, then NodeGetInfo on the
    CSI socket it was given: the CSINode lists the driver with its node id and topology key,
    the node carries the topology label, and flexhub's /healthz answers 200."""

    def listed() -> Any:
        # read raw: the client cannot load a CSINode whose drivers are null (after another
        # module's plugin deregistered), which the kubelet writes
        raw = cluster.storage.read_csi_node(NODE, _preload_content=False)
        drivers = json.loads(raw.data)["spec"].get("drivers") or []
        return next((d for d in drivers if d["name"] == DRIVER), None)

    driver = eventually(f"CSINode {NODE} lists {DRIVER}", listed)
    assert driver["nodeID"] == NODE
    assert driver["topologyKeys"] == [csi_node.TOPOLOGY_KEY]
    labels = cluster.core.read_node(NODE).metadata.labels
    assert labels.get(csi_node.TOPOLOGY_KEY) == NODE
    assert csi_node.registration_socket(cluster).is_socket()
    assert (csi_node.registration_socket(cluster).stat().st_mode & 0o777) == 0o600
    port = plugin.health_port  # type: ignore[attr-defined]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as reply:
        assert (reply.status, reply.read()) == (200, b"ok\n")


def test_a_pod_mounts_a_static_csi_pv_and_its_data_survives_it(
    cluster: Cluster, plugin: Process
) -> None:
    """(b) A scheduled pod's claim of a static CSI PV: the kubelet stages (flexhub formats and
    mounts the loopfile) and publishes it (a bind of the staging mount into the pod's volume
    dir); a file written through it is read by a second pod after the first is gone (its
    publish undone). The plugin never opened a TCP connection (a healthy volume makes no API
    call: its only ones are its health Events).
    Once no pod uses it, the kubelet unstages it (NodeUnstageVolume): the kubelet refuses
    UnmountDevice while another mount of the staged filesystem exists whose path does not
    repeat its staging path (operation_generator.go, mount-utils HasMountRefs), so
    flexhub's own staging mount must repeat it; failed while it was ``<state>/staging/<hash>``."""
    ns = namespace(cluster, "csi-fs")
    pv, claim = _static_volume(cluster, ns, "fs")
    first = run_pod(cluster, ns, _claim_pod("writer", claim))
    assert first.spec.node_name == NODE  # the scheduler placed it (by the PV's node affinity)
    target = _mount_dir(cluster, first.metadata.uid, pv)
    entries = _mounts_at(target)
    assert len(entries) == 1, f"{target}: {entries}"
    tail = entries[0][entries[0].index("-") + 1 :]
    assert tail[0] == "ext4" and tail[1].startswith("/dev/loop"), entries
    backing = _backing(cluster, ns, "fs.img")
    assert backing.stat().st_size == 64 * 1024 * 1024
    assert _loops_of(backing), "the backing file is on no loop device"
    staged = _mounts_at(csi_node.staging_path(cluster, f"static:{ns}:fs"))
    assert len(staged) == 1  # NodeStageVolume's mount, which the publish bound
    assert staged[0][2] == entries[0][2]  # the same filesystem (major:minor)
    (target / "hello").write_text("written through a CSI mount\n")
    os.sync()
    assert _tcp_peers(plugin.popen.pid) == [], "the node plugin talks to something over TCP"

    delete_pod(cluster, ns, "writer")
    assert _mounts_at(target) == []  # NodeUnpublishVolume ran before the Pod object went
    second = run_pod(cluster, ns, _claim_pod("reader", claim))
    again = _mount_dir(cluster, second.metadata.uid, pv)
    assert (again / "hello").read_text() == "written through a CSI mount\n"
    delete_pod(cluster, ns, "reader")
    assert _mounts_at(again) == []
    # no pod uses it any more: the kubelet unstages it, flexhub releases it
    eventually(
        "the kubelet's unstage: the loop device detached", lambda: not _loops_of(backing), 120
    )
    assert _mounts_at(csi_node.staging_path(cluster, f"static:{ns}:fs")) == []
    assert _mounts_below(cluster.state_dir.resolve() / "staging") == []


def test_a_raw_block_claim_is_a_device_in_the_pod(cluster: Cluster, plugin: Process) -> None:
    """(c) A volumeMode Block claim used as volumeDevices: the kubelet's pod device path holds
    a block device node, bytes written through it are in the backing file; once the pod is
    gone the kubelet unstages it: its loop device is detached."""
    ns = namespace(cluster, "csi-block")
    pv, claim = _static_volume(cluster, ns, "raw", block=True)
    running = run_pod(cluster, ns, _claim_pod("raw", claim, block=True))
    uid = running.metadata.uid
    device = cluster.kubelet_root / "pods" / uid / "volumeDevices" / "kubernetes.io~csi" / pv
    info = device.stat()
    import stat as stat_module

    assert stat_module.S_ISBLK(info.st_mode), f"{device} is no block device"
    payload = os.urandom(4096)
    fd = os.open(device, os.O_RDWR)
    try:
        assert os.pwrite(fd, payload, 1 << 20) == len(payload)
        os.fsync(fd)
        assert os.pread(fd, len(payload), 1 << 20) == payload
    finally:
        os.close(fd)
    backing = _backing(cluster, ns, "raw.img")
    with open(backing, "rb") as raw:
        raw.seek(1 << 20)
        assert raw.read(len(payload)) == payload
    delete_pod(cluster, ns, "raw")
    # a raw block volume is unstaged by the kubelet (no second mount holds it): released
    staging = cluster.kubelet_root / "plugins/kubernetes.io/csi/volumeDevices/staging" / pv
    eventually("the raw volume's loop device detached", lambda: _loops_of(backing) == [], 60)
    assert _mounts_at(staging) == [] and not staging.exists()


def test_a_plugin_killed_under_a_running_pod_is_registered_again_and_remounts_nothing(
    cluster: Cluster, plugin: Process
) -> None:
    """(d) SIGKILL the plugin under a pod: restarted, the kubelet registers it again (a new
    GetInfo and NotifyRegistrationStatus on the new process); the pod's mount is the same
    mount (same mount id, one entry) and takes writes; deleting the pod then unpublishes it
    through the new process. (Unstage: see test (b)'s note.)"""
    ns = namespace(cluster, "csi-kill")
    pv, claim = _static_volume(cluster, ns, "kill")
    running = run_pod(cluster, ns, _claim_pod("app", claim))
    target = _mount_dir(cluster, running.metadata.uid, pv)
    before = _mounts_at(target)
    assert len(before) == 1
    registered = _registrations(plugin)

    plugin.kill()
    assert csi_node.registration_socket(cluster).exists()  # a crash leaves it
    plugin.restart()
    _wait_registered(cluster, plugin, registered + 1)
    time.sleep(12)  # the kubelet's reconciler runs (syncFrequency 10 s): give it its chance
    after = _mounts_at(target)
    assert [e[0] for e in after] == [before[0][0]], f"{before} -> {after}"
    (target / "still").write_text("ok")

    delete_pod(cluster, ns, "app")
    assert _mounts_at(target) == []  # unpublished through the restarted plugin


def test_the_kubelet_polls_volume_stats_over_csi(cluster: Cluster, plugin: Process) -> None:
    """(e) The kubelet's volume stats poll (volumeStatsAggPeriod 5 s in the tier's kubelet
    config) calls NodeGetVolumeStats of a mounted claim and gets OK, again and again: its own
    ``csi_operations_seconds_count`` for the method, driver and status OK grows.
    The ``kubelet_volume_stats_*`` series it makes of them: test (g)."""
    ns = namespace(cluster, "csi-stats")
    _, claim = _static_volume(cluster, ns, "stats")
    run_pod(cluster, ns, _claim_pod("app", claim))
    pattern = re.compile(r"^csi_operations_seconds_count\{([^}]*)\} (\S+)$", re.MULTILINE)

    def calls() -> float:
        total = 0.0
        for labels, value in pattern.findall(kubelet_get(cluster, "/metrics")):
            if (
                f'driver_name="{DRIVER}"' in labels
                and 'method_name="/csi.v1.Node/NodeGetVolumeStats"' in labels
                and 'grpc_status_code="OK"' in labels
            ):
                total += float(value)
        return total

    first = eventually("an OK NodeGetVolumeStats call of the kubelet", calls, 60)
    eventually("another one", lambda: calls() > first, 30)
    delete_pod(cluster, ns, "app")


def test_an_unmounted_staging_path_becomes_the_pod_s_volume_health(
    cluster: Cluster, plugin: Process
) -> None:
    """(f) kubelet v1.37.2 turns NodeGetVolumeHealth into pod status ``volumeHealth`` (feature
    gate CSIVolumeHealth, on in the tier) and makes no Event (its stats code no longer reads
    volume_condition or records one): flexhub's node plugin does (issue #34). The staging
    mount unmounted behind the plugin's back becomes an Inaccessible/NotMounted condition of
    the pod's volume, and one Warning Event VolumeConditionAbnormal on the pod (its uid)
    within two health intervals; while the volume was healthy, none, and no other pod of
    this module (all healthy) has one. Fails with FLEXHUB_CSI_BREAK=health-events (the
    watcher off) and with FLEXHUB_CSI_BREAK=pod-identity (as podInfoOnMount false)."""
    ns = namespace(cluster, "csi-health")
    pv, claim = _static_volume(cluster, ns, "health")
    running = run_pod(cluster, ns, _claim_pod("app", claim))

    def health() -> list[dict[str, Any]]:
        raw = cluster.core.read_namespaced_pod("app", ns, _preload_content=False)
        return list(json.loads(raw.data).get("status", {}).get("volumeHealth") or [])

    def events() -> list[Any]:
        return list(
            cluster.core.list_event_for_all_namespaces(
                field_selector="reason=VolumeConditionAbnormal"
            ).items
        )

    time.sleep(12)  # two health polls of a healthy volume: no condition
    assert health() == [] or all(not v.get("healthConditions") for v in health()), health()
    assert events() == []  # two rounds of the watcher too (every 5 s): no Event
    staged = csi_node.staging_path(cluster, f"static:{ns}:health")
    assert len(_mounts_at(staged)) == 1
    subprocess.run(["umount", str(staged)], check=True, timeout=60)
    started = time.monotonic()

    def on_the_pod() -> list[Any]:
        return [e for e in events() if e.involved_object.uid == running.metadata.uid]

    (event,) = eventually("a VolumeConditionAbnormal Event on the pod", on_the_pod, 60)
    seen = time.monotonic()
    took = seen - started
    assert took < 2 * csi_node.HEALTH_INTERVAL + 5, took  # two rounds, and the API's time
    assert (event.type, event.metadata.namespace) == ("Warning", ns)
    assert (event.involved_object.kind, event.involved_object.name) == ("Pod", "app")
    assert event.involved_object.namespace == ns
    assert event.message == f"Volume {pv}: NotMounted: {staged} holds no mount of the volume"
    assert (event.source.component, event.source.host) == ("flexhub-csi-node", NODE)
    assert event.count == 1 and event.first_timestamp and event.last_timestamp
    assert [e.involved_object.uid for e in events()] == [running.metadata.uid]  # no other pod

    def unhealthy() -> list[dict[str, Any]]:
        return [v for v in health() if v.get("name") == "data" and v.get("healthConditions")]

    entry = eventually("the pod's volumeHealth of data", unhealthy, 90)[0]
    conditions = entry["healthConditions"]
    assert [(c["status"], c["reason"]) for c in conditions] == [("Inaccessible", "NotMounted")]
    assert str(staged) in conditions[0]["message"]
    # still abnormal a round after the Event: no second Event, no count (CI's critical path:
    # one round here; the dedupe's every case is tests/csi/test_health_events.py's)
    time.sleep(max(0.0, seen + csi_node.HEALTH_INTERVAL + 1 - time.monotonic()))
    assert [(e.metadata.name, e.count) for e in on_the_pod()] == [(event.metadata.name, 1)]
    kubeconfig = json.loads(cluster.service_kubeconfigs["csi-node"].read_text())
    token = kubeconfig["users"][0]["user"]["token"]
    log = plugin.log.read_text(errors="replace")
    assert f"health events: {ns}/app: Volume {pv}: NotMounted" in log
    assert token[-40:] not in log  # the token is never logged
    delete_pod(cluster, ns, "app")


# ------------------------------------------------------------------------------ volume stats


def test_the_kubelet_s_volume_stats_of_a_csi_claim_are_its_statvfs(
    cluster: Cluster, plugin: Process
) -> None:
    """(g) issue #34: what NodeGetVolumeStats answers reaches the kubelet's own
    ``kubelet_volume_stats_{capacity,available,used}_bytes`` and ``_inodes{,_free,_used}`` of
    the pod's claim: equal to statvfs of the pod's mount, and following it when a write uses
    8 MiB more (the kubelet polls every 5 s)."""
    from tests.cluster import volume_stats

    ns = namespace(cluster, "csi-volstats")
    pv, claim = _static_volume(cluster, ns, "volstats")
    running = run_pod(cluster, ns, _claim_pod("app", claim))
    target = _mount_dir(cluster, running.metadata.uid, pv)
    assert len(_mounts_at(target)) == 1
    before = volume_stats.wait_equal(cluster, ns, claim, target)
    assert before["capacity_bytes"] > 50 * 1024 * 1024  # an ext4 of the 64 MiB loopfile
    assert before["inodes"] > before["inodes_used"] > 0

    (target / "payload").write_bytes(os.urandom(8 * 1024 * 1024))
    os.sync()
    after = volume_stats.wait_equal(cluster, ns, claim, target)
    assert after["used_bytes"] - before["used_bytes"] >= 8 * 1024 * 1024
    assert after["inodes_used"] == before["inodes_used"] + 1
    delete_pod(cluster, ns, "app")
