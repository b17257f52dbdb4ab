"""``flexhub provisioner`` killed and raced on an nfs class, for real: the provisioner runs as
processes inside the VM rig (the guest mounts the export and makes the claim's directory, as
a deployed provisioner's pod does), against a real control plane on the host (etcd,
kube-apiserver, kube-controller-manager: tests/cluster/cluster.py without a node), with the
token of its account in the Helm chart and the chart's RBAC (tests/cluster/accounts.py); every
test fails when the API server refused any of its calls (its audit log).

The guest reaches the API server and nothing else: one ``guestfwd`` of qemu's user-mode
network with ``restrict=on`` (tests/rig/net.py), verifying the API server's certificate (its
CA, ``tls-server-name: kubernetes``). The kernel NFS server runs in the guest
(tests/rig/services.py), and Samba's smbd for the one cifs case; the classes bind
``Immediate`` (no kubelet, no scheduler).

One VM and one control plane for the module; each test starts the provisioner processes it
needs, so that a kill and a second instance are real processes too. They run through the
relocatable runtime's full profile (tests/runtime_cache.py), as the chart's image runs them.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from tests.cluster import build
from tests.cluster.accounts import NAMESPACE, Accounts, audited, forbidden
from tests.cluster.accounts import install as install_accounts
from tests.cluster.cluster import Cluster
from tests.cluster.kube import events, eventually, namespace
from tests.rig import net, services
from tests.rig.fixtures import require_rig
from tests.rig.vm import VM, RigError
from tests.runtime_cache import cached_runtime
from tests.vm.test_nfs import short_nfs_grace

pytestmark = pytest.mark.vm
LOG = logging.getLogger(__name__)

BASE = "/run/flexhub-prov"
KUBECONFIG = f"{BASE}/kubeconfig"
CONFIG = f"{BASE}/flexhub.toml"
STATE = f"{BASE}/state"
EXPORT = services.NFS_EXPORT
CLASS = "nfs-now"
PARAMETERS = {"backend": "nfs", "server": "127.0.0.1", "share": "/export", "nfsVersion": "4.2"}
CIFS_CLASS = "cifs-now"
#: The cifs class's Secret (type k8s/flexhub, in the chart's namespace), read by the provisioner.
CIFS_SECRET = "smb-credentials"
CIFS_PASSWORD = "Pw-" + uuid.uuid4().hex + "-prov"
MADE = "provisioner-made"
#: What a claim holds from just before its storage is made until its PV is saved.
HOLD = "flexhub/provisioning"
#: Seconds a guest provisioner may take for a step (python's start-up under TCG is most of it).
SLOW = 300


def _on_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class Kind:
    """A backend's class and where its server keeps what it makes."""

    backend: str
    storage_class: str
    local_dir: str


NFS = Kind("nfs", CLASS, EXPORT)


@dataclass
class Rig:
    vm: VM
    cluster: Cluster
    accounts: Accounts
    cifs: Kind

    def sh(self, script: str, check: bool = True) -> str:
        return self.vm.sh(script, check=check).stdout


@dataclass
class GuestProvisioner:
    """A ``flexhub provisioner`` process in the guest: the leader of its own session."""

    rig: Rig
    name: str
    pid: int

    @property
    def log(self) -> str:
        return self.rig.vm.read_file(f"{BASE}/{self.name}.log").decode(errors="replace")

    @property
    def trace(self) -> list[str]:
        """The checkpoints it reached (FLEXHUB_TEST_TRACE)."""
        found = self.rig.vm.run(["cat", f"{BASE}/{self.name}.trace"], check=False)
        return found.stdout.split()

    def signal(self, name: str) -> None:
        """Signal its process group (the commands it runs are in sessions of their own)."""
        self.rig.vm.run(["kill", "-s", name, "--", f"-{self.pid}"])

    def alive(self) -> bool:
        found = self.rig.vm.run(["cat", f"/proc/{self.pid}/stat"], check=False)
        return found.rc == 0 and found.stdout.rsplit(")", 1)[1].split()[0] not in ("Z", "X")

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self.signal("KILL")
        eventually(f"{self.name} dead", lambda: not self.alive(), timeout=30)

    def stop(self) -> None:
        if self.alive():
            for name in ("TERM", "CONT"):  # a paused one handles its TERM once continued
                self.rig.vm.run(["kill", "-s", name, "--", f"-{self.pid}"], check=False)
            with contextlib.suppress(AssertionError):
                eventually(f"{self.name} stopped", lambda: not self.alive(), timeout=30)
        if self.alive():
            self.kill()


def start_provisioner(
    rig: Rig, name: str, *extra: str, pause_at: str | None = None
) -> GuestProvisioner:
    """``flexhub provisioner`` in the guest, as the chart's Deployment runs it (its account's
    token, its Lease namespace), with its checkpoints traced; paused at ``pause_at``."""
    env = [f"FLEXHUB_TEST_TRACE={BASE}/{name}.trace"]
    if pause_at:
        env.append(f"FLEXHUB_TEST_PAUSE_AT={pause_at}")
    argv = ["env", *env, rig.vm.flexhub_python, "-I", "-m", "flexhub", "provisioner",
            "--kubeconfig", KUBECONFIG, "--config", CONFIG,
            "--lease-namespace", NAMESPACE, *extra]  # fmt: skip
    return GuestProvisioner(rig, name, rig.vm.spawn(argv, log=f"{BASE}/{name}.log"))


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """etcd, kube-apiserver and kube-controller-manager on the host (no node)."""
    require_rig()
    if not build.complete(build.bin_dir()) and shutil.which("go") is None:
        reason = "needs Go to build the control plane (`go` not on PATH)"
        if _on_ci():
            pytest.fail(f"CI=true but {reason}", pytrace=False)
        pytest.skip(reason)
    log = Path(tmp_path_factory.mktemp("cluster-build")) / "go-build.log"
    bin_dir = build.build(log)
    running = Cluster(bin_dir)
    try:
        running.start(node=False)
    except Exception:
        for proc in running.processes.values():
            print(f"----- {proc.name} (tail)\n{proc.tail(40)}")
        running.stop()
        running.remove()
        raise
    try:
        yield running
    finally:
        running.stop()
        running.remove()


def _guest_kubeconfig(cluster: Cluster, accounts: Accounts) -> str:
    """The provisioner's kubeconfig (its chart account's token) for the guest: the API server
    at the forwarded address, its certificate verified against its CA by the name it holds."""
    host = json.loads(accounts.kubeconfig("provisioner").read_text())
    ca = base64.b64encode(cluster.serving_certificate.read_bytes()).decode()
    host["clusters"][0]["cluster"] = {
        "server": f"https://{net.GUEST_ADDRESS}:{net.GUEST_PORT}",
        "certificate-authority-data": ca,
        "tls-server-name": "kubernetes",
    }
    return json.dumps(host)


#: In the guest: the forwarded address answers; the host's own address (the API server's real
#: port, and the port qemu's user network would NAT) does not, nor does the world.
_ONLY_ONE_WAY = """
import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20).close()
for host, port in (("10.0.2.2", int(sys.argv[3])), ("10.0.2.2", 22), ("192.0.2.1", 443)):
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError:
        continue
    sys.exit(f"the guest reached {host}:{port}")
"""


@pytest.fixture(scope="module")
def rig(control_plane: Cluster) -> Iterator[Rig]:
    accounts = install_accounts(control_plane)
    # The provisioner runs through the runtime (its full profile holds the kubernetes client),
    # as the chart's image runs it; built (or found) before the boot, as the session VM's.
    vm = VM(forward_port=control_plane.ports["apiserver"], runtime=str(cached_runtime()))
    try:
        vm.start()
    except RigError as exc:
        pytest.fail(f"VM rig failed to start: {exc}", pytrace=False)
    try:
        port = str(control_plane.ports["apiserver"])
        vm.run(["python3", "-c", _ONLY_ONE_WAY, net.GUEST_ADDRESS, str(net.GUEST_PORT), port])
        short_nfs_grace(vm)
        services.start_nfs_server(vm)
        # The first v4 client of a fresh server waits out its grace period: not ours to time.
        vm.run(["mkdir", "-p", "/mnt/nfs-warmup"])
        vm.run(["mount", "-t", "nfs", "-o", "vers=4.2", "127.0.0.1:/export", "/mnt/nfs-warmup"])
        vm.run(["touch", "/mnt/nfs-warmup/.warm"], timeout=120)
        vm.run(["umount", "/mnt/nfs-warmup"])
        vm.run(["rm", f"{EXPORT}/.warm"])
        vm.write_file(KUBECONFIG, _guest_kubeconfig(control_plane, accounts), mode=0o600)
        vm.write_file(
            CONFIG,
            f'state_dir = "{STATE}"\nlog_dir = "{BASE}/log"\nlog_level = "debug"\n'
            # a fresh smbd under TCG may take more than 8 s to answer a first mount
            "mount_timeout = 20\n",
        )
        control_plane.storage.create_storage_class(
            {
                "apiVersion": "storage.k8s.io/v1",
                "kind": "StorageClass",
                "metadata": {"name": CLASS},
                "provisioner": "flexhub",
                "parameters": PARAMETERS,
                "reclaimPolicy": "Delete",
                "volumeBindingMode": "Immediate",
            }
        )
        smb = services.start_smb_server(vm, CIFS_PASSWORD)
        control_plane.core.create_namespaced_secret(
            NAMESPACE,
            {
                "metadata": {"name": CIFS_SECRET},
                "type": "k8s/flexhub",
                "stringData": {"username": smb.username, "password": CIFS_PASSWORD},
            },
        )
        control_plane.storage.create_storage_class(
            {
                "apiVersion": "storage.k8s.io/v1",
                "kind": "StorageClass",
                "metadata": {"name": CIFS_CLASS},
                "provisioner": "flexhub",
                "parameters": {
                    "backend": "cifs",
                    "server": smb.host,
                    "share": smb.share,
                    "secretName": CIFS_SECRET,
                    "secretNamespace": NAMESPACE,
                },
                "reclaimPolicy": "Delete",
                "volumeBindingMode": "Immediate",
            }
        )
        yield Rig(vm, control_plane, accounts, Kind("cifs", CIFS_CLASS, smb.local_dir))
    finally:
        vm.close()


@pytest.fixture(autouse=True)
def nothing_refused(rig: Rig) -> Iterator[None]:
    """No call of the guest's provisioners was refused by the chart's RBAC (the API server's
    audit log), whatever the process did with the 403."""
    before = len(audited(rig.cluster))
    yield
    calls = audited(rig.cluster)[before:]
    assert calls, "no call of the provisioner's account in the audit log: who called the API?"
    refused = forbidden(calls)
    assert not refused, f"calls the chart's RBAC or policy refused: {refused}"


def _claim(rig: Rig, ns: str, name: str, kind: Kind = NFS) -> str:
    made = rig.cluster.core.create_namespaced_persistent_volume_claim(
        ns,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": kind.storage_class,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    uid: str = made.metadata.uid
    return uid


def _read(call: Any, *args: str) -> Any:
    try:
        return call(*args)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _pv(rig: Rig, uid: str) -> Any:
    """The PV named for the claim ``uid``, or None."""
    return _read(rig.cluster.core.read_persistent_volume, f"pvc-{uid}")


def _pvs_of(rig: Rig, uid: str) -> list[Any]:
    """Every PV bound or made for the claim ``uid`` (whatever its name)."""
    return [
        pv
        for pv in rig.cluster.core.list_persistent_volume().items
        if pv.spec.claim_ref and pv.spec.claim_ref.uid == uid
    ]


def export_tree(rig: Rig, kind: Kind = NFS) -> set[str]:
    """Everything on the export (or share), as the server has it."""
    return set(rig.sh(f"cd {kind.local_dir} && find . -mindepth 1").split())


def no_private_mount_left(rig: Rig, kind: Kind = NFS) -> None:
    """No private mount of the export (or share) left, nor a cifs credentials file."""
    private = f"{STATE}/{kind.backend}-tmp"
    assert rig.sh(f"grep -c ' {private}' /proc/mounts", check=False) == "0\n"
    for directory in (private, f"{STATE}/cifs-creds"):
        assert rig.sh(f"ls -A {directory} 2>/dev/null || true") == "", directory


def _paused_after_made(
    rig: Rig, ns: str, name: str, kind: Kind = NFS
) -> tuple[GuestProvisioner, str, str]:
    """A provisioner paused between the storage and the PV for a new claim ``name``: it,
    the claim's uid and its directory (which exists on the export, with no PV)."""
    before = export_tree(rig, kind)
    paused = start_provisioner(rig, f"paused-{name}", pause_at=MADE)
    uid = _claim(rig, ns, name, kind)
    eventually("paused after the directory was made", lambda: MADE in paused.trace, timeout=SLOW)
    directory = f"{ns}-{name}-pvc-{uid}"
    assert export_tree(rig, kind) - before == {f"./{directory}"}
    assert _pvs_of(rig, uid) == [] and _pv(rig, uid) is None
    assert HOLD in _finalizers(rig, ns, name)
    return paused, uid, directory


def _claim_now(rig: Rig, ns: str, name: str) -> Any:
    return _read(rig.cluster.core.read_namespaced_persistent_volume_claim, name, ns)


def _finalizers(rig: Rig, ns: str, name: str) -> list[str]:
    return list(_claim_now(rig, ns, name).metadata.finalizers or [])


def test_killed_between_storage_and_pv_then_restarted(rig: Rig) -> None:
    """SIGKILL between the directory and the PV, then a restart: exactly one PV for the claim,
    on that same directory, and nothing else made on the export; the claim deleted: the PV is
    released and reclaimed (the directory, then the PV, gone), no private mount left."""
    started = time.monotonic()
    ns = namespace(rig.cluster, "crash")
    before = export_tree(rig)
    paused, uid, directory = _paused_after_made(rig, ns, "a")
    paused.kill()
    again = start_provisioner(rig, "again-a")
    try:
        eventually(
            "bound",
            lambda: (
                rig.cluster.core.read_namespaced_persistent_volume_claim("a", ns).status.phase
                == "Bound"
            ),
            timeout=SLOW,
        )
        ours = _pvs_of(rig, uid)
        assert [pv.metadata.name for pv in ours] == [f"pvc-{uid}"]
        assert ours[0].spec.flex_volume.options == {
            **{k: v for k, v in PARAMETERS.items()},
            "subPath": directory,
        }
        assert export_tree(rig) - before == {f"./{directory}"}
        eventually("the claim let go", lambda: HOLD not in _finalizers(rig, ns, "a"), timeout=60)

        rig.cluster.core.delete_namespaced_persistent_volume_claim("a", ns)
        eventually(
            "the PV reclaimed and gone",
            lambda: _pv(rig, uid) is None,
            timeout=SLOW,
        )
        assert export_tree(rig) == before
        no_private_mount_left(rig)
        assert "Traceback" not in again.log, again.log[-3000:]
    finally:
        again.stop()
    LOG.warning("nfs provisioner killed/restarted: %.1fs", time.monotonic() - started)


@pytest.mark.parametrize("backend", ["nfs", "cifs"])
def test_killed_then_claim_deleted_before_a_retry(rig: Rig, backend: str) -> None:
    """SIGKILL between the directory and the PV, then the claim deleted while no provisioner
    runs: the claim waits (it holds flexhub/provisioning); then a provisioner finds the
    directory again and removes it (ProvisioningUndone; cifs: with the class's Secret), and
    only then lets the claim go; no PV is made, no private mount (nor credentials file) left:
    the storage a crash left does not outlive the claim."""
    started = time.monotonic()
    kind = NFS if backend == "nfs" else rig.cifs
    ns = namespace(rig.cluster, "gone")
    name = f"b-{backend}"
    before = export_tree(rig, kind)
    paused, uid, _ = _paused_after_made(rig, ns, name, kind)
    paused.kill()
    rig.cluster.core.delete_namespaced_persistent_volume_claim(name, ns)
    time.sleep(5)  # the claim protection controller's turn: it lets an unused claim go at once
    waiting = _claim_now(rig, ns, name)
    assert waiting is not None and waiting.metadata.deletion_timestamp is not None
    assert HOLD in (waiting.metadata.finalizers or [])
    again = start_provisioner(rig, f"again-{name}")
    try:
        eventually("the claim gone", lambda: _claim_now(rig, ns, name) is None, timeout=SLOW)
        left = export_tree(rig, kind) - before
        assert not left, f"left on the {backend} server after the claim went: {sorted(left)}"
        assert _pvs_of(rig, uid) == [] and _pv(rig, uid) is None
        shown = events(rig.cluster, ns, name)
        assert any(e.startswith("ProvisioningUndone") for e in shown), shown
        no_private_mount_left(rig, kind)
        assert CIFS_PASSWORD not in again.log
    finally:
        again.stop()
    LOG.warning("%s provisioner killed, claim deleted: %.1fs", backend, time.monotonic() - started)


def test_two_provisioners_race_for_one_claim(rig: Rig) -> None:
    """Two instances without leader election: one paused between the directory and the PV
    while the other makes the directory (again: the same) and the PV; then the paused one
    goes on and finds the PV saved. Both reached that point for the same claim; exactly one
    PV and one directory; the claim deleted: no directory left."""
    started = time.monotonic()
    ns = namespace(rig.cluster, "race")
    before = export_tree(rig)
    first = start_provisioner(rig, "race-first", "--no-leader-elect", pause_at=MADE)
    second = None
    try:
        uid = _claim(rig, ns, "c")
        eventually("the first paused with the directory made", lambda: MADE in first.trace,
                   timeout=SLOW)  # fmt: skip
        directory = f"{ns}-c-pvc-{uid}"
        assert export_tree(rig) - before == {f"./{directory}"}
        second = start_provisioner(rig, "race-second", "--no-leader-elect")
        pv = eventually(
            "the second made the PV",
            lambda: _pv(rig, uid),
            timeout=SLOW,
        )
        assert MADE in second.trace
        assert f"provisioned pvc-{uid} for claim {ns}/c" in second.log
        first.signal("CONT")
        eventually(
            "the first found the PV saved",
            lambda: f"PV pvc-{uid} exists already" in first.log,
            timeout=SLOW,
        )
        assert first.trace.count(MADE) == 1 and second.trace.count(MADE) == 1
        assert [p.metadata.name for p in _pvs_of(rig, uid)] == [f"pvc-{uid}"]
        assert pv.spec.flex_volume.options["subPath"] == directory
        assert export_tree(rig) - before == {f"./{directory}"}
        eventually("the claim let go", lambda: HOLD not in _finalizers(rig, ns, "c"), timeout=60)

        rig.cluster.core.delete_namespaced_persistent_volume_claim("c", ns)
        eventually(
            "the PV reclaimed and gone",
            lambda: _pv(rig, uid) is None,
            timeout=SLOW,
        )
        assert export_tree(rig) == before
        no_private_mount_left(rig)
    finally:
        first.stop()
        if second is not None:
            second.stop()
    LOG.warning("nfs provisioners raced: %.1fs", time.monotonic() - started)
