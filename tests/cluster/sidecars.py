"""flexhub's CSI controller on the test cluster, beside the kubernetes-csi sidecars, as a
cluster runs them: ``flexhub csi --mode controller`` on a unix socket, and csi-provisioner,
csi-resizer and csi-snapshotter (tests/cluster/build_sidecars.py builds them at the pinned
releases) calling it, with the cluster's snapshot-controller and the snapshot CRDs.

Every process runs on the host as a tier :class:`~tests.cluster.cluster.Process` with its log
under the cluster's logs. The sidecars call the API server with a token of the chart's
``flexhub-csi-controller`` account and its rules (tests/cluster/accounts.py renders and applies
them), with leader election in flexhub's namespace as the chart's Deployment runs them, never
the admin's rights; the snapshot controller, the cluster's, has its own account
(``snapshot-controller-rbac.yaml``, upstream's rules).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import accounts, build_sidecars
from tests.cluster.accounts import NAMESPACE, mint_token, write_kubeconfig
from tests.cluster.cluster import NODE, Cluster, Process, wait_for
from tests.cluster.csi_breaks import flexhub_argv
from tests.cluster.kube import eventually
from tests.cluster.manifests import apply, documents
from tests.conftest import REPO

HERE = Path(__file__).resolve().parent
DRIVER = "flexhub.csi.k8s.io"
#: The snapshot controller's account (the cluster's component, not the chart's).
SNAPSHOT_CONTROLLER_RBAC = HERE / "snapshot-controller-rbac.yaml"
#: The account of each process, in flexhub's namespace (whose accounts the audit log records):
#: the sidecars share the controller pod's account, as in the chart; the snapshot controller
#: is the cluster's, with its own.
ACCOUNTS = {
    "csi-controller": "flexhub-csi-controller",
    "snapshot-controller": "flexhub-test-snapshot-controller",
}
#: Leader election as the chart's Deployment runs the sidecars (its Lease Role names them).
LEADER = ["--leader-election", f"--leader-election-namespace={NAMESPACE}"]
#: The VolumeSnapshot API (group, version) of the snapshot CRDs.
SNAPSHOTS = ("snapshot.storage.k8s.io", "v1")
#: A CSI call's bound in the sidecars: loopfile's CreateVolume and CreateSnapshot take a few
#: seconds on a loaded host; the sidecars' default (10 s) would retry calls that are running.
CSI_TIMEOUT = "120s"


def username(component: str) -> str:
    return f"system:serviceaccount:{NAMESPACE}:{ACCOUNTS[component]}"


@dataclass
class Csi:
    """The CSI controller and its sidecars on a cluster."""

    socket: Path
    config: Path
    state_dir: Path
    loopfile_root: Path
    kubeconfigs: dict[str, Path]
    processes: dict[str, Process]
    #: The audit log's size when they started (:func:`audited` reads from there).
    audit_from: int = 0

    def stop(self) -> None:
        for proc in reversed(list(self.processes.values())):
            proc.stop()


def snapshot_controller_account(cluster: Cluster) -> Path:
    """Apply the snapshot controller's RBAC (strict field validation), mint a token, write its
    kubeconfig; flexhub's namespace must exist (the ``accounts`` fixture makes it)."""
    for doc in documents(SNAPSHOT_CONTROLLER_RBAC.read_text()):
        apply(cluster, doc)
    account = ACCOUNTS["snapshot-controller"]
    path = cluster.root / "snapshot-controller.kubeconfig"
    write_kubeconfig(path, cluster.server, mint_token(cluster, account), account)
    return path


def apply_crds(cluster: Cluster, bin_dir: Path) -> list[str]:
    """Apply the snapshot CRDs the sidecars were built with (strict field validation) and
    wait until the API server serves them; return their names."""
    from kubernetes import client

    names = []
    for name in build_sidecars.CRDS:
        for doc in documents((bin_dir / "crd" / name).read_text()):
            apply(cluster, doc)
            names.append(doc["metadata"]["name"])
    extensions = client.ApiextensionsV1Api(cluster.api)

    def established() -> bool:
        for name in names:
            conditions = extensions.read_custom_resource_definition(name).status.conditions or []
            if not any(c.type == "Established" and c.status == "True" for c in conditions):
                return False
        return True

    wait_for("the snapshot CRDs established", established, 60)
    return names


def controller_config(cluster: Cluster) -> tuple[Path, Path, Path]:
    """A flexhub config for the CSI controller: its state, log and loopfile root in a
    directory of the cluster's root that is root's alone. Return (config, state, root)."""
    top = cluster.root / "csi"
    top.mkdir(mode=0o700, exist_ok=True)
    for name in ("state", "log", "loopfiles"):
        (top / name).mkdir(mode=0o700, exist_ok=True)
    config = top / "flexhub.toml"
    config.write_text(
        f'state_dir = "{top / "state"}"\nlog_dir = "{top / "log"}"\n'
        f'log_level = "debug"\nlock_timeout = 20\n\n[loopfile]\nroot = "{top / "loopfiles"}"\n'
    )
    return config, top / "state", top / "loopfiles"


def flexhub_controller(
    cluster: Cluster, config: Path, socket: Path, kubeconfig: Path | None = None
) -> Process:
    """``flexhub csi --mode controller`` on ``socket`` as the node ``flexhub-node``, returned
    once it answers Probe; with ``kubeconfig`` (the chart's controller account, as the
    chart's pod has its token) it reads converted volumes' records in flexhub's namespace."""
    if socket.exists():
        socket.unlink()
    argv = flexhub_argv("csi", "--mode", "controller",
            "--endpoint", f"unix://{socket}", "--node-id", NODE, "--config", str(config),
            "--log-level", "debug", "--namespace", NAMESPACE,
            *(["--kubeconfig", str(kubeconfig)] if kubeconfig else []))  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = Process("flexhub-csi-controller", argv, cluster.logs / "flexhub-csi-controller.log",
                   env=env)  # fmt: skip
    wait_for("flexhub csi's socket", socket.is_socket, 60, proc)
    import grpc

    from flexhub.csi.proto import csi_pb2, csi_pb2_grpc

    with grpc.insecure_channel(f"unix://{socket}") as channel:
        identity = csi_pb2_grpc.IdentityStub(channel)
        identity.Probe(csi_pb2.ProbeRequest(), wait_for_ready=True, timeout=60)
    return proc


def _sidecar(cluster: Cluster, name: str, argv: list[str]) -> Process:
    return Process(name, argv, cluster.logs / f"{name}.log", env=dict(os.environ))


def provisioner(cluster: Cluster, bin_dir: Path, socket: Path, kubeconfig: Path) -> Process:
    """csi-provisioner. Its Topology gate is GA and on at v5.3.0 (not passed: setting a GA
    gate only warns); no leader election (one replica), metadata of the claim passed to
    CreateVolume (flexhub's loopfile namespaces its files by the claim's namespace)."""
    return _sidecar(cluster, "csi-provisioner", [
        str(bin_dir / "csi-provisioner"), f"--csi-address={socket}",
        f"--kubeconfig={kubeconfig}", *LEADER, "--extra-create-metadata",
        f"--timeout={CSI_TIMEOUT}", "--retry-interval-max=10s", "--v=4",
    ])  # fmt: skip


def resizer(cluster: Cluster, bin_dir: Path, socket: Path, kubeconfig: Path) -> Process:
    return _sidecar(cluster, "csi-resizer", [
        str(bin_dir / "csi-resizer"), f"--csi-address={socket}", f"--kubeconfig={kubeconfig}",
        *LEADER, f"--timeout={CSI_TIMEOUT}", "--retry-interval-max=10s",
        "--v=4",
    ])  # fmt: skip


def snapshotter(cluster: Cluster, bin_dir: Path, socket: Path, kubeconfig: Path) -> Process:
    return _sidecar(cluster, "csi-snapshotter", [
        str(bin_dir / "csi-snapshotter"), f"--csi-address={socket}",
        f"--kubeconfig={kubeconfig}", *LEADER, "--extra-create-metadata",
        f"--timeout={CSI_TIMEOUT}", "--retry-interval-max=10s", "--v=4",
    ])  # fmt: skip


def snapshot_controller(cluster: Cluster, bin_dir: Path, kubeconfig: Path) -> Process:
    return _sidecar(cluster, "snapshot-controller", [
        str(bin_dir / "snapshot-controller"), f"--kubeconfig={kubeconfig}",
        "--leader-election=false", "--retry-interval-max=10s", "--v=4",
    ])  # fmt: skip


def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sidecars' directory, built now if the cache has none: a test without Go skips
    (fails with ``CI=true``), a failed build fails with the tail of its log."""
    if not build_sidecars.complete(build_sidecars.bin_dir()) and shutil.which("go") is None:
        reason = "needs Go to build the kubernetes-csi sidecars (`go` not on PATH)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but the CSI sidecar tests {reason}", pytrace=False)
        pytest.skip(reason)
    log = Path(tmp_path_factory.mktemp("sidecars-build")) / "go-build.log"
    try:
        return build_sidecars.build(log)
    except Exception as exc:
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
        pytest.fail(f"building the sidecars failed: {exc}\n{tail}", pytrace=False)


def start(cluster: Cluster, bin_dir: Path, controller: Path, on_node: bool = False) -> Csi:
    """Everything above, in order: accounts, CRDs, flexhub's controller, the sidecars (with
    ``controller``, the kubeconfig of the chart's ``flexhub-csi-controller`` account).

    ``on_node``: flexhub's controller runs with the node's config (its state directory and
    loopfile root), as the chart's controller pinned to a node shares that node's
    (``csi.controller.stateDir``), so the node plugin's staged volumes are its to snapshot
    and reclaim; else with a config of its own."""
    kubeconfigs = {"csi-controller": controller,
                   "snapshot-controller": snapshot_controller_account(cluster)}  # fmt: skip
    apply_crds(cluster, bin_dir)
    if on_node:
        config, state_dir, root = cluster.config, cluster.state_dir, cluster.loopfile_root
    else:
        config, state_dir, root = controller_config(cluster)
    socket = cluster.root / "csi" / "csi.sock"
    socket.parent.mkdir(mode=0o700, exist_ok=True)
    csi = Csi(socket, config, state_dir, root, kubeconfigs, {}, accounts.audit_offset(cluster))
    try:
        csi.processes["flexhub"] = flexhub_controller(cluster, config, socket, controller)
        csi.processes["csi-provisioner"] = provisioner(cluster, bin_dir, socket, controller)
        csi.processes["csi-resizer"] = resizer(cluster, bin_dir, socket, controller)
        csi.processes["csi-snapshotter"] = snapshotter(cluster, bin_dir, socket, controller)
        csi.processes["snapshot-controller"] = snapshot_controller(
            cluster, bin_dir, kubeconfigs["snapshot-controller"]
        )
        time.sleep(1)
        for proc in csi.processes.values():
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
    except BaseException:
        csi.stop()
        raise
    return csi


@contextlib.contextmanager
def running(
    cluster: Cluster,
    controller: Path,
    tmp_path_factory: pytest.TempPathFactory,
    on_node: bool = False,
) -> Iterator[Csi]:
    """:func:`start` with the sidecars :func:`built`, until the block ends."""
    csi = start(cluster, built(tmp_path_factory), controller, on_node)
    try:
        yield csi
    finally:
        csi.stop()


def audited(cluster: Cluster, csi: Csi) -> list[dict[str, Any]]:
    """Every request of the CSI accounts since ``csi`` started (another module's deliberate
    403s with the same account, tests/cluster/test_chart_csi.py's, are not theirs)."""
    return accounts.audited(cluster, {username(c) for c in ACCOUNTS}, csi.audit_from)


def claim(name: str, size: str, storage_class: str, snapshot: str | None = None) -> dict[str, Any]:
    """A ReadWriteOnce claim of ``storage_class``, restored from VolumeSnapshot ``snapshot``
    when one is named."""
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": storage_class,
        "resources": {"requests": {"storage": size}},
    }
    if snapshot:
        spec["dataSource"] = {"apiGroup": SNAPSHOTS[0], "kind": "VolumeSnapshot", "name": snapshot}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
            "spec": spec}  # fmt: skip


def bound_pv(cluster: Cluster, csi: Csi, ns: str, name: str, timeout: float = 90) -> Any:
    """The PV of claim ``ns/name`` once the claim is Bound (a process of ``csi`` that exits
    fails at once)."""

    def bound() -> Any:
        for proc in csi.processes.values():
            assert proc.popen.poll() is None, f"{proc.name} exited:\n{proc.tail()}"
        pvc = cluster.core.read_namespaced_persistent_volume_claim(name, ns)
        return pvc if pvc.status.phase == "Bound" else None

    pvc = eventually(f"claim {ns}/{name} bound", bound, timeout=timeout)
    return cluster.core.read_persistent_volume(pvc.spec.volume_name)


def record(csi: Csi, kind: str, handle: str) -> Path:
    """flexhub's controller record of a volume (``kind`` volumes) or snapshot (snapshots)."""
    return csi.state_dir / "csi" / kind / f"{handle.rsplit(':', 1)[1]}.json"


def custom_objects(cluster: Cluster) -> Any:
    from kubernetes import client

    return client.CustomObjectsApi(cluster.api)


def snapshot_ready(
    cluster: Cluster, ns: str, name: str, claim: str, snapshot_class: str, timeout: float
) -> Any:
    """Create VolumeSnapshot ``name`` of ``claim`` in ``snapshot_class`` and return it once
    it is ready to use (an error in its status fails at once)."""
    group, version = SNAPSHOTS
    custom = custom_objects(cluster)
    custom.create_namespaced_custom_object(group, version, ns, "volumesnapshots", {
        "apiVersion": f"{group}/{version}", "kind": "VolumeSnapshot",
        "metadata": {"name": name},
        "spec": {"volumeSnapshotClassName": snapshot_class,
                 "source": {"persistentVolumeClaimName": claim}},
    })  # fmt: skip

    def ready() -> Any:
        snap = custom.get_namespaced_custom_object(group, version, ns, "volumesnapshots", name)
        status = snap.get("status") or {}
        assert not status.get("error"), status
        return snap if status.get("readyToUse") else None

    return eventually(f"the VolumeSnapshot {name} ready to use", ready, timeout=timeout)


def node_affinity(pv: Any) -> list[tuple[str, list[str]]]:
    """The PV's required node affinity as (key, values) pairs (``[]``: none)."""
    affinity = pv.spec.node_affinity
    if affinity is None or affinity.required is None:
        return []
    terms = affinity.required.node_selector_terms
    return [(e.key, e.values) for t in terms for e in t.match_expressions or []]
