"""A real control plane and node on 127.0.0.1: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, a stock kubelet and a fake CRI runtime, all unmodified release code.

Only the containers are fake (the CRI server keeps sandboxes and containers in memory and runs
nothing). Everything about volumes is real: the kubelet's volume manager execs the flexhub
driver that ``flexhub install`` put into its ``--volume-plugin-dir``, with real mounts under
its root directory. Every process runs in a session of its own with its log in
``<root>/logs``; :meth:`Cluster.stop` kills them all and unmounts whatever is left under the
root, also after a failure.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

NODE = "flexhub-node"
DRIVER = "k8s/flexhub"
#: The controllers a cluster's storage depends on (and what the scheduler needs of a node).
CONTROLLERS = (
    "persistentvolume-binder-controller",
    "persistentvolume-expander-controller",
    "persistentvolume-attach-detach-controller",
    "persistentvolumeclaim-protection-controller",
    "persistentvolume-protection-controller",
    "serviceaccount-controller",
    "namespace-controller",
    "node-lifecycle-controller",
    "validatingadmissionpolicy-status-controller",
)

#: What the API server's audit log records: every request of a service account of the
#: namespace flexhub's chart is installed in (metadata only: who, verb, object, answer).
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "userGroups": ["system:serviceaccounts:flexhub-system"]},
        {"level": "None"},
    ],
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for(
    what: str,
    check: Callable[[], bool],
    timeout: float,
    proc: Process | None = None,
    interval: float = 0.5,
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except Exception:
            pass
        if proc is not None and proc.popen.poll() is not None:
            raise RuntimeError(
                f"{what}: {proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}"
            )
        if time.monotonic() > deadline:
            tail = f"\n{proc.tail()}" if proc else ""
            raise TimeoutError(f"{what} not ready after {timeout:.0f} s{tail}")
        time.sleep(interval)


class Process:
    """One component: its command, its log, its process (a session of its own)."""

    def __init__(self, name: str, argv: list[str], log: Path, env: Mapping[str, str] | None = None):
        self.name, self.argv, self.log = name, argv, log
        self.env = dict(env) if env is not None else None
        self.popen: subprocess.Popen[bytes] = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        with open(self.log, "ab") as out:
            return subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self.env,
            )

    def restart(self) -> None:
        self.stop()
        self.popen = self._start()

    def kill(self) -> None:
        """SIGKILL, as a crash would: its whole process group (a driver call it runs too)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()

    def stop(self, timeout: float = 15) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout)
        self.kill()

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class Cluster:
    """The running cluster; :attr:`api` is an official ``kubernetes`` client ApiClient."""

    def __init__(self, bin_dir: Path, root: Path | None = None, python: str = sys.executable):
        self.bin = bin_dir
        self.python = python
        if root is None:
            # Not under /tmp: the plugin directory must be root's alone up to / (flexhub's
            # install refuses a directory others may write to, and /tmp is one).
            root = Path(tempfile.mkdtemp(prefix="flexhub-cluster.", dir="/var/lib"))
        self.root = root
        self.logs = root / "logs"
        self.kubelet_root = root / "kubelet"
        self.plugin_dir = root / "volume-plugins"
        self.config = root / "flexhub.toml"
        self.state_dir = root / "flexhub-state"
        self.loopfile_root = root / "loopfiles"
        self.driver_log_dir = root / "flexhub-log"
        #: The API server's audit log: every request of flexhub's service accounts
        #: (tests/cluster/accounts.py), so that a refused call is seen whoever made it.
        self.audit_log = self.logs / "audit.log"
        #: A kubeconfig with the token of each flexhub process's account in the chart, once
        #: tests/cluster/accounts.py installed them (the ``accounts`` fixture).
        self.service_kubeconfigs: dict[str, Path] = {}
        self.token = secrets.token_hex(16)
        self.processes: dict[str, Process] = {}
        self.api: Any = None
        self.ports: dict[str, int] = {}

    # ----------------------------------------------------------------------------- start

    def start(self, node: bool = True) -> None:
        """Start the control plane and, unless ``node`` is false, flexhub's driver on the
        host, the scheduler and the node (fake runtime, kubelet)."""
        for directory in (self.logs, self.kubelet_root, self.plugin_dir):
            directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        if node:
            self._flexhub()
            if os.environ.get("FLEXHUB_CLUSTER_BREAK"):
                self.break_driver(os.environ["FLEXHUB_CLUSTER_BREAK"])
        self._etcd()
        self._apiserver()
        self._client()
        self.processes["kube-controller-manager"] = Process(
            "kube-controller-manager",
            self._controller_manager_argv(),
            self.logs / "kube-controller-manager.log",
        )
        if node:
            self._node()

    def _node(self) -> None:
        self.processes["kube-scheduler"] = Process(
            "kube-scheduler",
            [
                str(self.bin / "kube-scheduler"),
                f"--kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                "--v=2",
            ],
            self.logs / "kube-scheduler.log",
        )
        self._fakecri()
        self._kubelet()

    def _flexhub(self) -> None:
        self.config.write_text(
            f'state_dir = "{self.state_dir}"\nlog_dir = "{self.driver_log_dir}"\n'
            f'log_level = "debug"\n\n[loopfile]\nroot = "{self.loopfile_root}"\n'
        )
        subprocess.run(
            [
                self.python,
                "-m",
                "flexhub",
                "install",
                "--plugin-dir",
                str(self.plugin_dir),
                "--config",
                str(self.config),
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def break_driver(self, operation: str) -> None:
        """Test the tests: the installed driver answers ``operation`` with Success and does
        nothing (``FLEXHUB_CLUSTER_BREAK``); every other call reaches flexhub."""
        from flexhub.admin.install import driver_path

        driver = driver_path(self.plugin_dir)
        real = self.root / "real-driver"
        driver.rename(real)
        driver.write_text(
            f"#!{self.python}\nimport os, sys\n"
            f"if sys.argv[1:2] == [{operation!r}]:\n"
            '    print(\'{"status": "Success"}\')\n    sys.exit(0)\n'
            f"os.execv({str(real)!r}, [{str(real)!r}, *sys.argv[1:]])\n"
        )
        driver.chmod(0o755)

    def _etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.ports["etcd"] = client
        url = f"http://127.0.0.1:{client}"
        proc = self.processes["etcd"] = Process(
            "etcd",
            [
                str(self.bin / "etcd"),
                f"--data-dir={self.root / 'etcd'}",
                f"--listen-client-urls={url}",
                f"--advertise-client-urls={url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=default=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
            self.logs / "etcd.log",
        )
        wait_for(
            "etcd",
            lambda: b"true" in urllib.request.urlopen(f"{url}/health", timeout=2).read(),
            60,
            proc,
        )

    def _apiserver(self) -> None:
        pki = self.root / "pki"
        pki.mkdir(mode=0o700)
        subprocess.run(
            ["openssl", "genrsa", "-out", str(pki / "sa.key"), "2048"],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            ["openssl", "rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub")],
            check=True,
            capture_output=True,
        )
        tokens = pki / "tokens.csv"
        tokens.write_text(f"{self.token},admin,admin-uid,system:masters\n")
        audit_policy = pki / "audit-policy.json"
        audit_policy.write_text(json.dumps(AUDIT_POLICY))
        port = self.ports["apiserver"] = free_port()
        self.server = f"https://127.0.0.1:{port}"
        proc = self.processes["kube-apiserver"] = Process(
            "kube-apiserver",
            [
                str(self.bin / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
                f"--cert-dir={pki}",
                f"--secure-port={port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                "--endpoint-reconciler-type=none",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--authorization-mode=Node,RBAC",
                f"--token-auth-file={tokens}",
                f"--service-account-issuer={self.server}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--allow-privileged=true",
                f"--audit-policy-file={audit_policy}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
                # pod status volumeHealth (the CSI node plugin's NodeGetVolumeHealth, through
                # the kubelet): dropped by the API server unless the gate is on here too
                "--feature-gates=CSIVolumeHealth=true",
                "--v=1",
            ],
            self.logs / "kube-apiserver.log",
        )
        self.kubeconfig = self.root / "admin.kubeconfig"
        self.kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "admin",
                    "clusters": [
                        {
                            "name": "local",
                            "cluster": {"server": self.server, "insecure-skip-tls-verify": True},
                        }
                    ],
                    "users": [{"name": "admin", "user": {"token": self.token}}],
                    "contexts": [
                        {"name": "admin", "context": {"cluster": "local", "user": "admin"}}
                    ],
                }
            )
        )
        self.kubeconfig.chmod(0o600)
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE

        def ready() -> bool:
            request = urllib.request.Request(
                f"{self.server}/readyz", headers={"Authorization": f"Bearer {self.token}"}
            )
            return urllib.request.urlopen(request, context=insecure, timeout=5).read() == b"ok"

        wait_for("kube-apiserver", ready, 180, proc)

    def _client(self) -> None:
        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = self.server
        configuration.verify_ssl = False
        configuration.api_key = {"authorization": f"Bearer {self.token}"}
        self.api = client.ApiClient(configuration)
        self.core = client.CoreV1Api(self.api)
        self.storage = client.StorageV1Api(self.api)
        import urllib3

        urllib3.disable_warnings()

    def _controller_manager_argv(self) -> list[str]:
        return [
            str(self.bin / "kube-controller-manager"),
            f"--kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            f"--controllers={','.join(CONTROLLERS)}",
            f"--flex-volume-plugin-dir={self.plugin_dir}",
            "--use-service-account-credentials=false",
            "--v=2",
        ]

    def _fakecri(self) -> None:
        self.cri_socket = self.root / "fakecri.sock"
        proc = self.processes["fakecri"] = Process(
            "fakecri",
            [str(self.bin / "fakecri"), f"unix://{self.cri_socket}"],
            self.logs / "fakecri.log",
        )
        wait_for("fakecri", self.cri_socket.exists, 30, proc)

    def _kubelet(self) -> None:
        config = self.root / "kubelet-config.json"
        healthz = free_port()
        port = self.ports["kubelet"] = free_port()
        config.write_text(
            json.dumps(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    "failCgroupV1": False,
                    "cgroupsPerQOS": False,
                    "enforceNodeAllocatable": [],
                    "cgroupDriver": "cgroupfs",
                    "failSwapOn": False,
                    # true: the kubelet's cadvisor then collects disk usage, without which its
                    # RootFsInfo fails and so ListPodStats, and kubelet_volume_stats_* is empty
                    # (pkg/kubelet/cadvisor/cadvisor_linux.go:111, cri_stats_provider.go:142)
                    "localStorageCapacityIsolation": True,
                    "protectKernelDefaults": False,
                    "address": "127.0.0.1",
                    "port": port,
                    "readOnlyPort": 0,
                    "healthzBindAddress": "127.0.0.1",
                    "healthzPort": healthz,
                    # a bearer token (the admin's) is checked by a TokenReview: /metrics is
                    # read with it (tests/cluster/test_csi_node.py); anonymous stays off
                    "authentication": {
                        "anonymous": {"enabled": False},
                        "webhook": {"enabled": True},
                    },
                    "authorization": {"mode": "AlwaysAllow"},
                    "containerRuntimeEndpoint": f"unix://{self.cri_socket}",
                    "imageServiceEndpoint": f"unix://{self.cri_socket}",
                    "volumePluginDir": str(self.plugin_dir),
                    "syncFrequency": "10s",
                    "nodeStatusUpdateFrequency": "5s",
                    "imageGCHighThresholdPercent": 100,
                    "evictionHard": {"memory.available": "1Mi"},
                    "serializeImagePulls": False,
                    # CSI volume stats (kubelet_volume_stats_*) and volume health are polled
                    # at this period (default 1m): short, so a test sees them within seconds
                    "volumeStatsAggPeriod": "5s",
                    # the kubelet calls NodeGetVolumeHealth (alpha, off by default)
                    "featureGates": {"CSIVolumeHealth": True},
                }
            )
        )
        self.processes["kubelet"] = Process(
            "kubelet",
            [
                str(self.bin / "kubelet"),
                f"--config={config}",
                f"--kubeconfig={self.kubeconfig}",
                f"--root-dir={self.kubelet_root}",
                f"--hostname-override={NODE}",
                "--v=2",
            ],
            self.logs / "kubelet.log",
        )
        self.wait_node_ready()

    def wait_node_ready(self, timeout: float = 180) -> None:
        def ready() -> bool:
            node = self.core.read_node(NODE)
            return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions)

        wait_for("node", ready, timeout, self.processes["kubelet"])

    # ----------------------------------------------------------------------------- use

    @property
    def serving_certificate(self) -> Path:
        """The API server's self-signed serving certificate, then its CA (kube-apiserver writes
        both into its ``--cert-dir``): valid for its address and the names it gives itself
        (``kubernetes`` among them)."""
        return self.root / "pki" / "apiserver.crt"

    def kubelet_restart(self) -> None:
        self.processes["kubelet"].restart()

    def driver_log(self) -> str:
        """Everything the flexhub driver logged so far (its log directory)."""
        parts = []
        for path in sorted(self.driver_log_dir.glob("*")):
            if path.is_file():
                parts.append(path.read_text(errors="replace"))
        return "".join(parts)

    def driver_calls(self, operation: str | None = None) -> list[dict[str, Any]]:
        """The driver's call summaries (one JSON line per call), oldest first."""
        calls = []
        for line in self.driver_log().splitlines():
            _, marker, payload = line.partition(": call {")
            if marker:
                call = json.loads("{" + payload)
                if operation is None or call["op"] == operation:
                    calls.append(call)
        return calls

    def logs_text(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    # ----------------------------------------------------------------------------- stop

    def stop(self) -> None:
        order = (
            "kubelet",
            "kube-scheduler",
            "kube-controller-manager",
            "fakecri",
            "kube-apiserver",
            "etcd",
        )
        for name in order:
            if name in self.processes:
                self.processes[name].stop()
        unmount_below(self.root)
        detach_loops_below(self.root)

    def remove(self) -> None:
        if not any(e.startswith(str(self.root)) for e in _mount_points()):
            shutil.rmtree(self.root, ignore_errors=True)


def _mount_points() -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        points.append(point)
    return points


def unmount_below(root: Path) -> None:
    """Unmount everything at or below ``root``, deepest first (the kubelet's root directory is
    a bind mount of itself; pod volumes and flexhub's staging mounts are below it)."""
    for _ in range(5):
        below = [p for p in _mount_points() if p == str(root) or p.startswith(f"{root}/")]
        if not below:
            return
        for point in sorted(set(below), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=60)


def detach_loops_below(root: Path) -> None:
    """Detach every loop device whose backing file lies below ``root``."""
    out = subprocess.run(
        ["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    for line in out.splitlines():
        name, _, back = line.strip().partition(" ")
        if back.strip().startswith(f"{root}/"):
            subprocess.run(["losetup", "-d", name], capture_output=True, timeout=30)


def b64(value: str) -> str:
    return base64.b64encode(value.encode()).decode()


@contextlib.contextmanager
def running(bin_dir: Path) -> Iterator[Cluster]:
    cluster = Cluster(bin_dir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        cluster.remove()
