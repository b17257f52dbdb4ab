"""kubernetes-csi's csi-sanity against ``flexhub csi --mode both`` with the NFS and the cifs
backends, in the VM rig: the kernel NFS server and client of the guest, Samba's smbd and the
kernel's cifs client, the plugin as one long-running process
there (through the relocatable runtime, as a node runs it), csi-sanity's static binary from
the host's CI cache (the guest sees the host's files read-only).

Zero failures, and exactly the skips of ``tests/csi/sanity-skips-<backend>.tsv``: loopfile's
list (capabilities no backend serves) plus the specs of capabilities the one driver name
advertises for loopfile that NFS and cifs do not have (snapshots, clones, GetCapacity, block),
left out with ``--ginkgo.skip`` because csi-sanity gates them on the driver, not on the
volume's backend. cifs's credentials reach the plugin the way external-provisioner and kubelet
give them, in the requests' ``secrets`` (csi-sanity's ``--csi.secrets`` file), never on a
command line.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.csi import build_sanity
from tests.csi.sanity import read_report, read_skips
from tests.rig import services
from tests.rig.vm import VM
from tests.vm.test_nfs import short_nfs_grace

pytestmark = pytest.mark.vm
LOG = logging.getLogger(__name__)

BASE = "/run/flexhub-csi-nfs"
SOCKET = f"{BASE}/csi.sock"
CONFIG = f"{BASE}/flexhub.toml"
CSI_TESTS = Path(__file__).resolve().parent.parent / "csi"
SMB_PASSWORD = "Pw-" + uuid.uuid4().hex + "-csi"
SECRET_KEYS = ("CreateVolumeSecret", "DeleteVolumeSecret", "ControllerExpandVolumeSecret",
               "NodeStageVolumeSecret", "NodePublishVolumeSecret", "NodeExpandVolumeSecret",
               "CreateSnapshotSecret", "DeleteSnapshotSecret", "ListSnapshotsSecret")  # fmt: skip
#: Specs of capabilities advertised for the one driver name that NFS volumes do not have:
#: each is INVALID_ARGUMENT for an NFS volume by design (docs/csi.md), not a failure to hide.
NOT_FOR_NFS = r"[Ss]napshot|[Cc]lone|source volume|GetCapacity|[Bb]lock"


def _nfs(vm: VM) -> str:
    """The NFS server; the class parameters. Returns the export's directory on the server."""
    short_nfs_grace(vm)
    services.start_nfs_server(vm)
    vm.write_file(
        f"{BASE}/parameters.yaml",
        'backend: nfs\nserver: 127.0.0.1\nshare: /export\nnfsVersion: "4.2"\n',
    )
    # the first v4 client of a fresh server waits out its grace period: not flexhub's time
    vm.run(["mkdir", "-p", "/mnt/nfs-warmup"])
    vm.run(["mount", "-t", "nfs", "-o", "vers=4.2", "127.0.0.1:/export", "/mnt/nfs-warmup"])
    vm.run(["touch", "/mnt/nfs-warmup/.warm"], timeout=120)
    vm.run(["umount", "/mnt/nfs-warmup"])
    vm.run(["rm", "-f", f"{services.NFS_EXPORT}/.warm"])
    return services.NFS_EXPORT


def _cifs(vm: VM) -> str:
    """smbd with its user; the class parameters and every request's secrets (file 0600)."""
    server = services.start_smb_server(vm, SMB_PASSWORD)
    vm.write_file(
        f"{BASE}/parameters.yaml",
        f"backend: cifs\nserver: {server.host}\nshare: {server.share}\n"
        "secretName: smb-csi\nsecretNamespace: flexhub\n",
    )
    credentials = f"  username: {server.username}\n  password: {SMB_PASSWORD}\n"
    vm.write_file(
        f"{BASE}/secrets.yaml", "".join(f"{key}:\n{credentials}" for key in SECRET_KEYS), mode=0o600
    )
    return server.local_dir


@pytest.fixture(scope="module", params=["nfs", "cifs"])
def plugin(request: pytest.FixtureRequest, vm: VM) -> Iterator[tuple[VM, str, str]]:
    backend: str = request.param
    vm.run(["rm", "-rf", BASE])
    vm.run(["mkdir", "-p", f"{BASE}/state", f"{BASE}/log", f"{BASE}/mnt", f"{BASE}/stage"])
    vm.run(["chmod", "0700", BASE])
    vm.write_file(
        CONFIG, f'state_dir = "{BASE}/state"\nlog_dir = "{BASE}/log"\nlock_timeout = 20\n'
    )
    served = _nfs(vm) if backend == "nfs" else _cifs(vm)
    pid = vm.spawn(
        [vm.flexhub_python, "-I", "-m", "flexhub", "csi", "--mode", "both", "--node-id", "vm-node",
         "--endpoint", f"unix://{SOCKET}", "--config", CONFIG],
        log=f"{BASE}/plugin.log",
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while vm.run(["test", "-S", SOCKET], check=False).rc != 0:
        if time.monotonic() > deadline:
            pytest.fail(
                f"flexhub csi did not listen: {vm.read_file(f'{BASE}/plugin.log')[-1500:]!r}"
            )
        time.sleep(1)
    try:
        yield vm, backend, served
    finally:
        vm.run(["kill", "-TERM", str(pid)], check=False)
        deadline = time.monotonic() + 30
        while vm.run(["test", "-S", SOCKET], check=False).rc == 0 and time.monotonic() < deadline:
            time.sleep(0.5)  # the plugin removes its socket when it stops


def test_csi_sanity(plugin: tuple[VM, str, str], tmp_path: Path) -> None:
    vm, backend, served = plugin
    binary = build_sanity.build()
    secrets = [f"--csi.secrets={BASE}/secrets.yaml"] if backend == "cifs" else []
    started = time.monotonic()
    done = vm.run(
        [str(binary), f"--csi.endpoint=unix://{SOCKET}", f"--csi.mountdir={BASE}/mnt/m",
         f"--csi.stagingdir={BASE}/stage/s", f"--csi.testvolumeparameters={BASE}/parameters.yaml",
         f"--ginkgo.junit-report={BASE}/junit.xml", "--ginkgo.no-color", "--ginkgo.timeout=25m",
         f"--ginkgo.skip={NOT_FOR_NFS}", *secrets],
        timeout=1800, check=False, cwd=BASE,
    )  # fmt: skip
    junit = tmp_path / "junit.xml"
    junit.write_bytes(vm.read_file(f"{BASE}/junit.xml"))
    report = read_report(junit)
    LOG.warning("%s %s; in the guest %.0f s", backend, report.summary(), time.monotonic() - started)
    print(f"{backend} {report.summary()}")
    plugin_log = vm.read_file(f"{BASE}/plugin.log").decode(errors="replace")
    assert not report.failed, (
        "\n\n".join(f"{k}\n{v}" for k, v in report.failed.items())
        + done.output[-3000:]
        + plugin_log[-3000:]
    )
    skips = read_skips(CSI_TESTS / f"sanity-skips-{backend}.tsv")
    assert report.skipped == {k: m for k, (m, _) in skips.items()}
    assert len(report.passed) >= 50, report.summary()
    # every directory csi-sanity's volumes made on the share was reclaimed, nothing is mounted
    assert vm.sh(f"ls -A {served}").stdout.strip() == ""
    assert vm.sh(f"grep -c ' {BASE}/' /proc/mounts || true").stdout.strip() == "0"
    assert SMB_PASSWORD not in plugin_log + vm.sh(f"cat {BASE}/log/* || true").stdout
