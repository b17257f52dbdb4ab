"""kubernetes-csi's csi-sanity against ``flexhub csi --mode both`` with the NFS, cifs and iSCSI
backends, in the VM rig: the kernel NFS server and client of the guest, Samba's smbd and the
kernel's cifs client, the kernel LIO target (made and deleted over SSH by the iSCSI
provisioning, as in tests/vm/test_iscsi_provision.py) and open-iscsi, the plugin as one
long-running process there (through the relocatable runtime, as a node runs it), csi-sanity's
static binary from the host's CI cache (the guest sees the host's files read-only).

Zero failures, and exactly the skips of the backend's list: for NFS and cifs
``tests/csi/sanity-skips-<backend>.tsv``, loopfile's list (capabilities no backend serves)
plus the specs of capabilities the one driver name advertises for loopfile that a share does
not have (snapshots, clones, GetCapacity, raw block), left out with ``--ginkgo.skip`` because
csi-sanity gates them on the driver, not on the volume's backend; for iSCSI, which has every
capability the driver advertises (snapshots and clones of LIO LUNs, GetCapacity of the
target's room, raw block), loopfile's list itself (``tests/csi/sanity-skips.tsv``): nothing
is left out. iSCSI runs twice: the whole suite with every volume raw (``iscsi-block``,
``--csi.testvolumeaccesstype block``, which gates no spec), and the node's specs again with a
file system (ext4) on every volume (``iscsi``: the controller's specs do not depend on it). Credentials (cifs's password; iSCSI's SSH key for the controller and CHAP
for the controller and the node) reach the plugin the way external-provisioner and kubelet
give them, in the requests' ``secrets`` (csi-sanity's ``--csi.secrets`` file, 0600), never on
a command line, and are in no log.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.csi import build_sanity
from tests.csi.sanity import read_report, read_skips
from tests.rig import services
from tests.rig.vm import VM
from tests.vm import csiguest
from tests.vm import test_iscsi_provision as lio_provisioning
from tests.vm.test_nfs import short_nfs_grace

pytestmark = pytest.mark.vm
LOG = logging.getLogger(__name__)

BASE = "/run/flexhub-csi-nfs"
SOCKET = f"{BASE}/csi.sock"
CSI_TESTS = Path(__file__).resolve().parent.parent / "csi"
SMB_PASSWORD = "Pw-" + uuid.uuid4().hex + "-csi"
CHAP_USER = "csi-chap-" + uuid.uuid4().hex[:8]
CHAP_PASSWORD = "Csi-Chap-" + uuid.uuid4().hex[:16]
#: The requests' secrets, by csi-sanity's key: the controller's calls, then the node's.
CONTROLLER_KEYS = ("CreateVolumeSecret", "DeleteVolumeSecret", "ControllerExpandVolumeSecret",
                   "CreateSnapshotSecret", "DeleteSnapshotSecret", "ListSnapshotsSecret")  # fmt: skip
NODE_KEYS = ("NodeStageVolumeSecret", "NodePublishVolumeSecret", "NodeExpandVolumeSecret")
#: Specs of capabilities advertised for the one driver name that NFS volumes do not have:
#: each is INVALID_ARGUMENT for an NFS volume by design (docs/csi.md), not a failure to hide.
NOT_FOR_NFS = r"[Ss]napshot|[Cc]lone|source volume|GetCapacity|[Bb]lock"
#: An iSCSI volume has every capability the one driver name advertises (snapshots, clones,
#: GetCapacity, raw block): no spec is left out beyond those csi-sanity skips itself.
NOT_FOR_ISCSI = ""
ISCSI_PREFIX = "iqn.2026-01.io.flexhub.rig:csi"
#: The node's specs in csi-sanity's texts (its ``Node Service`` container).
NODE_SPECS = "Node Service"
#: A LUN of 64 MiB (ext4), grown to 96 MiB: csi-sanity's default (10 GiB, grown by 1 GiB)
#: would only cost the emulated guest mkfs time.
ISCSI_SIZES = (f"--csi.testvolumesize={64 << 20}", f"--csi.testvolumeexpandsize={96 << 20}")


@dataclass
class Served:
    """A backend's server side for one run: the directory its volumes are made in (empty
    again after the run), csi-sanity's arguments for it, the specs it leaves out, and the
    secret values that must be in no log."""

    directory: str
    args: tuple[str, ...] = ()
    skip: str = NOT_FOR_NFS
    secrets: tuple[str, ...] = ()
    #: A focused run: only the specs whose text holds this (the rest are skipped, unfocused).
    focus: str = ""


def _secrets_file(vm: VM, controller: Mapping[str, str], node: Mapping[str, str]) -> str:
    """csi-sanity's ``--csi.secrets`` (JSON, which is YAML), 0600; its argument."""
    by_key = {key: dict(controller) for key in CONTROLLER_KEYS}
    by_key.update({key: dict(node) for key in NODE_KEYS})
    vm.write_file(f"{BASE}/secrets.yaml", json.dumps(by_key), mode=0o600)
    return f"--csi.secrets={BASE}/secrets.yaml"


def _nfs(vm: VM) -> Served:
    """The NFS server; the class parameters."""
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
    return Served(services.NFS_EXPORT)


def _cifs(vm: VM) -> Served:
    """smbd with its user; the class parameters and every request's secrets (file 0600)."""
    server = services.start_smb_server(vm, SMB_PASSWORD)
    vm.write_file(
        f"{BASE}/parameters.yaml",
        f"backend: cifs\nserver: {server.host}\nshare: {server.share}\n"
        "secretName: smb-csi\nsecretNamespace: flexhub\n",
    )
    credentials = {"username": server.username, "password": SMB_PASSWORD}
    return Served(
        server.local_dir, (_secrets_file(vm, credentials, credentials),), secrets=(SMB_PASSWORD,)
    )


def _iscsi(vm: VM, access: str) -> Served:
    """The target host (sshd and LIO in the guest, a clean slate first) and the class: one
    target per volume, session CHAP, the guest's initiator alone in its ACL. The controller's
    calls get the SSH key and CHAP (the class's Secret), the node's CHAP only."""
    services.reset_iscsi(vm)
    ssh, _ = lio_provisioning.setup(vm)
    luns = f"{services.LUN_DIR}/csi"
    vm.run(["mkdir", "-p", "-m", "0755", luns])
    parameters = lio_provisioning.parameters(ssh, iqnPrefix=ISCSI_PREFIX, fileioDirectory=luns)
    vm.write_file(f"{BASE}/parameters.yaml", json.dumps({"backend": "iscsi", **parameters}))
    chap = {"node.session.auth.username": CHAP_USER, "node.session.auth.password": CHAP_PASSWORD}
    ssh_keys = {"ssh-privatekey": ssh.private_key, "ssh-knownhosts": ssh.known_hosts}
    secrets = _secrets_file(vm, {**ssh_keys, **chap}, chap)
    return Served(
        luns,
        (secrets, *ISCSI_SIZES, f"--csi.testvolumeaccesstype={access}"),
        NOT_FOR_ISCSI,
        (CHAP_USER, CHAP_PASSWORD, ssh.private_key.splitlines()[1]),
        # the whole suite runs with raw volumes; with a file system only the node's specs
        # (stage, publish, expand, stats: what the access type changes) run again
        focus="" if access == "block" else NODE_SPECS,
    )


#: The runs: each a module-scoped plugin (and server) of its own.
RUNS = ("nfs", "cifs", "iscsi-block", "iscsi")


@pytest.fixture(scope="module", params=RUNS)
def plugin(request: pytest.FixtureRequest, vm: VM) -> Iterator[tuple[VM, str, Served]]:
    run: str = request.param
    csiguest.prepare(vm, BASE)
    backend, _, access = run.partition("-")
    if backend == "iscsi":
        served = _iscsi(vm, access or "mount")
    else:
        served = _nfs(vm) if backend == "nfs" else _cifs(vm)
    pid = csiguest.start(vm, BASE)
    try:
        yield vm, run, served
    finally:
        csiguest.stop(vm, BASE, pid)
        if backend == "iscsi":  # what a failed run left (the test checked there was none)
            services.reset_iscsi(vm)


def test_csi_sanity(plugin: tuple[VM, str, Served], tmp_path: Path) -> None:
    vm, run, served = plugin
    binary = build_sanity.build()
    started = time.monotonic()
    done = vm.run(
        [str(binary), f"--csi.endpoint=unix://{SOCKET}", f"--csi.mountdir={BASE}/mnt/m",
         f"--csi.stagingdir={BASE}/stage/s", f"--csi.testvolumeparameters={BASE}/parameters.yaml",
         f"--ginkgo.junit-report={BASE}/junit.xml", "--ginkgo.no-color", "--ginkgo.timeout=25m",
         *([f"--ginkgo.skip={served.skip}"] if served.skip else []),
         *([f"--ginkgo.focus={served.focus}"] if served.focus else []), *served.args],
        timeout=1800, check=False, cwd=BASE,
    )  # fmt: skip
    junit = tmp_path / "junit.xml"
    junit.write_bytes(vm.read_file(f"{BASE}/junit.xml"))
    report = read_report(junit)
    LOG.warning("%s %s; in the guest %.0f s", run, report.summary(), time.monotonic() - started)
    print(f"{run} {report.summary()}")
    plugin_log = vm.read_file(f"{BASE}/plugin.log").decode(errors="replace")
    assert not report.failed, (
        "\n\n".join(f"{k}\n{v}" for k, v in report.failed.items())
        + done.output[-3000:]
        + plugin_log[-3000:]
    )
    backend = run.partition("-")[0]
    skips = read_skips(
        CSI_TESTS / ("sanity-skips.tsv" if backend == "iscsi" else f"sanity-skips-{backend}.tsv")
    )
    expected = {k: m for k, (m, _) in skips.items()}
    if served.focus:  # the focused specs: exactly their skips; the rest unfocused, none run
        assert all(served.focus in k for k in report.passed), report.summary()
        focused = {k: m for k, m in report.skipped.items() if served.focus in k}
        assert focused == {k: m for k, m in expected.items() if served.focus in k}
        assert len(report.passed) >= 20, report.summary()
    else:
        assert report.skipped == expected
        assert len(report.passed) >= (70 if backend == "iscsi" else 50), report.summary()
    if run == "iscsi-block":  # the volumes were really staged raw (no filesystem, no mount)
        assert "(raw block)" in plugin_log
    # every directory or LUN file csi-sanity's volumes made was reclaimed, nothing is mounted
    assert vm.sh(f"ls -A {served.directory}").stdout.strip() == ""
    assert vm.sh(f"grep -c ' {BASE}/' /proc/mounts || true").stdout.strip() == "0"
    # no iSCSI session or LIO target of a volume is left (open-iscsi says so on stderr)
    assert ISCSI_PREFIX not in vm.run(["iscsiadm", "-m", "session"], check=False).stdout
    assert ISCSI_PREFIX not in vm.sh("ls /sys/kernel/config/target/iscsi || true").stdout
    logs = plugin_log + vm.sh(f"cat {BASE}/log/* || true").stdout
    assert not [value for value in served.secrets if value in logs]
