"""The nfs backend for real: the installed driver, called like kubelet, in the VM rig.

The guest runs the kernel NFS server (``tests.rig.services``) on loopback and the installed
flexhub driver mounts its exports into kubelet-style pod directories. Every reply is parsed
strictly (one JSON object, nothing else on stdout or stderr). What each test proves is in its
docstring; the timings they measure are logged (``pytest -s`` or ``-o log_cli=true``).

The server-death test runs last: it stops ``nfsd`` and starts it again.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from flexhub.admin.harness import Kubelet, go_json, parse_reply
from flexhub.node.runner import REAP_TIMEOUT
from tests.rig import services
from tests.rig.vm import GUEST_PYTHON, VM

LOG = logging.getLogger(__name__)

BASE = "/run/flexhub-nfs-test"
PLUGINS = f"{BASE}/plugins"
CONFIG = f"{BASE}/flexhub.toml"
KUBELET_PODS = "/var/lib/kubelet/pods"
EXPORT = services.NFS_EXPORT  # the exported directory, server side

#: Bounds of the node config written for these tests (seconds).
MOUNT_TIMEOUT = 8
UNMOUNT_TIMEOUT = 8
STAT_TIMEOUT = 3
FORCE_TIMEOUT = 5
#: What a driver call costs besides its commands: python start-up under TCG, the agent.
OVERHEAD = 15.0
#: A TCP port on 127.0.0.3 where a listener accepts connections and never answers.
SILENT_HOST = "127.0.0.3"
SILENT_PORT = 20490

NODE_CONFIG = f"""\
state_dir = "{BASE}/state"
log_dir = "{BASE}/log"
log_level = "debug"
lock_timeout = 30

[nfs]
mount_timeout = {MOUNT_TIMEOUT}
unmount_timeout = {UNMOUNT_TIMEOUT}
stat_timeout = {STAT_TIMEOUT}
force_unmount_timeout = {FORCE_TIMEOUT}
"""


def wait_holding(vm: VM, pid: int, path: str, timeout: float = 30) -> None:
    """Wait until process ``pid`` has ``path`` open as its fd 3; fail if it never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        link = vm.run(["readlink", f"/proc/{pid}/fd/3"], check=False)
        if link.rc == 0 and link.stdout.strip() == path:
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} never opened {path}")


def wait_blocked(vm: VM, pid: int, comm: str, timeout: float = 30) -> None:
    """Wait until process ``pid`` runs ``comm`` and sleeps in a system call (state D or S:
    once exec'd, the only sleeping call of the short commands used here is on the dead
    mount); fail if it never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stat = vm.run(["cat", f"/proc/{pid}/stat"], check=False).stdout
        name, _, rest = stat.partition(") ")
        if name.endswith(f"({comm}") and rest[:1] in ("D", "S"):
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} ({comm}) never blocked on the dead mount")


SILENT_SERVER = f"""
import socket
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("{SILENT_HOST}", {SILENT_PORT}))
server.listen(64)
held = []
while True:
    held.append(server.accept()[0])
"""

MOUNT_COMMANDS = {"mount", "mount.nfs", "mount.nfs4", "umount", "umount.nfs", "umount.nfs4"}


@dataclass
class Rig:
    """The guest, the installed driver and the NFS server, for this module."""

    vm: VM
    driver: str
    server: services.NfsServer
    timings: dict[str, list[float]] = field(default_factory=dict)

    # -- kubelet's side ---------------------------------------------------------------------

    def pod_dir(self, pv: str = "pv-nfs") -> str:
        """Create a pod volume directory as kubelet does (``MkdirAll`` 0750)."""
        path = f"{KUBELET_PODS}/{uuid.uuid4()}/volumes/k8s~flexhub/{pv}"
        self.vm.run(["mkdir", "-p", "-m", "0750", path])
        return path

    def call(self, *argv: str, timing: str = "") -> tuple[dict[str, Any], float]:
        """Run the driver exactly like kubelet; return the strictly parsed reply and seconds."""
        started = time.monotonic()
        rc, output = self.vm.call_driver(self.driver, list(argv))
        elapsed = time.monotonic() - started
        if not output.strip():  # the shim hides stderr: show why python said nothing
            raw = self.vm.run(
                [GUEST_PYTHON, "-I", "-m", "flexhub", *argv], check=False, env={"PATH": "/bin"}
            )
            pytest.fail(f"driver printed nothing (exit {rc}); without the shim: {raw.output}")
        reply = parse_reply(output.encode())
        assert rc == (0 if reply["status"] == "Success" else 1), (rc, output)
        if timing:
            self.timings.setdefault(timing, []).append(elapsed)
        LOG.info("%s %s -> %s in %.2fs", argv[0], argv[1][-40:], output.strip(), elapsed)
        return reply, elapsed

    def mount(
        self, target: str, user: dict[str, str], *, read_only: bool = False, **kw: Any
    ) -> tuple[dict[str, Any], float]:
        options = Kubelet.mount_options(
            {"backend": "nfs", **user},
            pv=target.rsplit("/", 1)[-1],
            pod_uid=target.split("/")[-4],
            read_only=read_only,
            **kw,
        )
        return self.call("mount", target, go_json(options), timing="mount")

    def unmount(self, target: str) -> tuple[dict[str, Any], float]:
        reply, elapsed = self.call("unmount", target, timing="unmount")
        if reply["status"] == "Success":
            self.vm.run(["rmdir", target])  # kubelet's os.Remove: fails if not empty
        return reply, elapsed

    # -- the guest's state ----------------------------------------------------------------

    def last_call(self) -> dict[str, Any]:
        """The node log's record of the last driver call (its ``ms`` excludes python's
        start-up, which under TCG on a loaded host is most of a call's wall time)."""
        log = self.vm.read_file(f"{BASE}/log/flexhub.log").decode(errors="replace")
        line = [line for line in log.splitlines() if " flexhub.calls: call {" in line][-1]
        record: dict[str, Any] = json.loads(line.split(" flexhub.calls: call ", 1)[1])
        return record

    def mounts(self, target: str) -> list[list[str]]:
        """The /proc/mounts lines (split) whose mount point is ``target``."""
        text = self.vm.run(["cat", "/proc/mounts"]).stdout
        return [line.split() for line in text.splitlines() if line.split()[1] == target]

    def mount_commands(self) -> list[str]:
        """Every mount/umount process still alive in the guest."""
        out = self.vm.run(["ps", "-eo", "pid=,stat=,comm="]).stdout
        return [line for line in out.splitlines() if line.split()[-1] in MOUNT_COMMANDS]

    def sh(self, script: str, timeout: float = 60, check: bool = True) -> str:
        return self.vm.sh(script, timeout=timeout, check=check).output

    def server_path(self, *parts: str) -> str:
        return "/".join([EXPORT, *parts])


def short_nfs_grace(vm: VM) -> None:
    """Lower nfsd's v4 grace and lease times to 10 s while it is stopped (default 90 s)."""
    vm.run(["modprobe", "nfsd"])
    vm.sh(
        "mountpoint -q /proc/fs/nfsd || mount -t nfsd nfsd /proc/fs/nfsd; "
        'if [ "$(cat /proc/fs/nfsd/threads)" = 0 ]; then '
        "echo 10 > /proc/fs/nfsd/nfsv4gracetime; echo 10 > /proc/fs/nfsd/nfsv4leasetime; fi"
    )


@pytest.fixture(scope="module")
def rig(vm: VM) -> Iterator[Rig]:
    short_nfs_grace(vm)
    server = services.start_nfs_server(vm)
    vm.write_file(CONFIG, NODE_CONFIG)
    driver = vm.install_flexhub(PLUGINS, config=CONFIG)
    rig = Rig(vm, driver, server)
    # The first v4 client of a fresh server pays for its set-up: not a flexhub figure.
    vm.run(["mkdir", "-p", "/mnt/nfs-warmup"])
    vm.run(["mount", "-t", "nfs", "-o", "vers=4.2", rig.server.source("4.2"), "/mnt/nfs-warmup"])
    vm.run(["touch", "/mnt/nfs-warmup/.warm"], timeout=120)  # waits out a grace period
    vm.run(["umount", "/mnt/nfs-warmup"])
    yield rig
    for name, values in sorted(rig.timings.items()):
        LOG.warning(
            "nfs %s latency over %d calls: min %.2fs, median %.2fs, max %.2fs",
            name,
            len(values),
            min(values),
            sorted(values)[len(values) // 2],
            max(values),
        )
    log = vm.read_file(f"{BASE}/log/flexhub.log").decode(errors="replace")
    for line in log.splitlines():
        if " flexhub_nfs: " in line:
            LOG.info("guest: %s", line)


def share(rig: Rig, version: str) -> dict[str, str]:
    """The server/share options for ``version`` (v3 mounts the real path, v4 the pseudo-fs)."""
    path = rig.server.v3_path if version == "3" else rig.server.v4_path
    return {"server": rig.server.host, "share": path}


# -- versions, data, options -------------------------------------------------------------------


@pytest.mark.parametrize("version", ["3", "4.1", "4.2"])
def test_version_mount_write_unmount(rig: Rig, version: str) -> None:
    """Each version mounts with exactly that version, the pod writes to the server, and the
    unmount leaves an empty, unmounted directory kubelet can remove. (A repeated mount and
    unmount: the kit's idempotent check, tests/vm/test_kit_nfs.py.)"""
    target = rig.pod_dir()
    user = {**share(rig, version), "nfsVersion": version}
    reply, _ = rig.mount(target, user)
    assert reply == {"status": "Success"}
    (entry,) = rig.mounts(target)
    assert entry[2] == ("nfs" if version == "3" else "nfs4")
    options = entry[3].split(",")
    assert f"vers={version}" in options and "hard" in options and "rw" in options
    name = f"v{version}-{uuid.uuid4().hex[:6]}"
    rig.vm.write_file(f"{target}/{name}", f"written over NFS {version}\n")
    assert rig.sh(f"cat {rig.server_path(name)}") == f"written over NFS {version}\n"
    reply, _ = rig.unmount(target)
    assert reply == {"status": "Success"}
    assert rig.mounts(target) == []
    assert rig.sh(f"test -e {target} || echo gone") == "gone\n"


def test_mount_options_land_in_proc_mounts(rig: Rig) -> None:
    """The PV's mountOptions reach the kernel: each one shows in /proc/mounts. With fsType
    nfs4 and no nfsVersion the client negotiates the highest v4 (4.2 here)."""
    target = rig.pod_dir()
    opts = "soft,timeo=150,retrans=4,rsize=65536,wsize=65536,noatime,nconnect=2,actimeo=7"
    reply, _ = rig.mount(
        target, {**share(rig, "4"), "mountOptions": f"{opts},lookupcache=pos"}, fs_type="nfs4"
    )
    assert reply["status"] == "Success", reply
    (entry,) = rig.mounts(target)
    assert entry[2] == "nfs4"
    shown = entry[3].split(",")
    for option in [*opts.split(","), "vers=4.2", "lookupcache=pos", "proto=tcp"]:
        if option.startswith("actimeo="):  # the kernel shows actimeo as its four parts
            assert {"acregmin=7", "acregmax=7", "acdirmin=7", "acdirmax=7"} <= set(shown)
        else:
            assert option in shown, (option, shown)
    assert "hard" not in shown
    assert rig.unmount(target)[0]["status"] == "Success"


def test_read_only_and_data_shared_between_pods(rig: Rig) -> None:
    """Two pods on one export: a v3 read-write writer and a v4.2 read-only reader. The
    reader's mount is ro and refuses writes (EROFS); each sees what the other pod's side
    wrote (data written by one pod is read by another, across versions); each unmount
    leaves the other pod's mount alone."""
    reader, writer = rig.pod_dir(), rig.pod_dir()
    reply, _ = rig.mount(reader, {**share(rig, "4.2"), "nfsVersion": "4.2"}, read_only=True)
    assert reply == {"status": "Success"}
    reply, _ = rig.mount(writer, {**share(rig, "3"), "nfsVersion": "3"})
    assert reply == {"status": "Success"}
    (entry,) = rig.mounts(reader)
    assert entry[3].split(",")[0] == "ro"
    refused = rig.vm.run(["touch", f"{reader}/nope"], check=False)
    assert refused.rc != 0 and "Read-only file system" in refused.output
    payload = uuid.uuid4().hex
    rig.vm.write_file(f"{writer}/shared-{payload}", payload)
    assert rig.sh(f"cat {reader}/shared-{payload}") == payload
    assert rig.unmount(writer)[0] == {"status": "Success"}
    assert rig.sh(f"cat {reader}/shared-{payload}") == payload
    assert rig.unmount(reader)[0] == {"status": "Success"}


# -- subPath -------------------------------------------------------------------------------------


def test_sub_path_must_exist_without_create(rig: Rig) -> None:
    """A missing subPath without createSubPath is a Failure that says how to fix it, leaves
    the directory clean and creates nothing on the server; an existing one mounts."""
    name = f"missing-{uuid.uuid4().hex[:6]}"
    target = rig.pod_dir()
    reply, _ = rig.mount(target, {**share(rig, "4.2"), "nfsVersion": "4.2", "subPath": name})
    assert reply["status"] == "Failure"
    assert "does not exist on the server" in reply["message"]
    assert 'createSubPath: "true"' in reply["message"]
    assert rig.mounts(target) == []
    assert rig.sh(f"ls -A {target}") == ""
    assert rig.sh(f"test -e {rig.server_path(name)} || echo absent") == "absent\n"
    rig.sh(f"mkdir -p {rig.server_path(name, 'deep')} && echo here > {rig.server_path(name)}/f")
    reply, _ = rig.mount(target, {**share(rig, "3"), "nfsVersion": "3", "subPath": name})
    assert reply["status"] == "Success", reply
    assert rig.sh(f"cat {target}/f; ls {target}") == "here\ndeep\nf\n"
    assert rig.unmount(target)[0]["status"] == "Success"


def test_create_sub_path_with_mode(rig: Rig) -> None:
    """createSubPath makes the nested sub-directory with subPathMode (exactly, umask or not),
    the pod sees only it, and no temporary mount or directory is left behind."""
    version = "4.1"
    name = f"team-{uuid.uuid4().hex[:6]}/data"
    target = rig.pod_dir()
    user = {
        **share(rig, version),
        "nfsVersion": version,
        "subPath": name,
        "createSubPath": "true",
        "subPathMode": "2770",
    }
    reply, _ = rig.mount(target, user)
    assert reply["status"] == "Success", reply
    assert rig.sh(f"stat -c %a {rig.server_path(name)}") == "2770\n"
    (entry,) = rig.mounts(target)
    assert entry[0].endswith(f":{share(rig, version)['share']}/{name}")
    rig.vm.write_file(f"{target}/inside", "x")
    assert rig.sh(f"ls {rig.server_path(name)}") == "inside\n"
    assert rig.sh(f"ls -A {BASE}/state/nfs-tmp") == ""
    assert rig.sh(f"grep -c ' {BASE}/state/nfs-tmp' /proc/mounts", check=False) == "0\n"
    assert rig.unmount(target)[0]["status"] == "Success"
    # A second pod with the directory already there: mode untouched, mounted again.
    rig.sh(f"chmod 00755 {rig.server_path(name)}")
    again = rig.pod_dir()
    assert rig.mount(again, user)[0]["status"] == "Success"
    assert rig.sh(f"stat -c %a {rig.server_path(name)}; cat {again}/inside") == "755\nx"
    assert rig.unmount(again)[0]["status"] == "Success"


def test_symlinks_in_the_export_are_refused(rig: Rig) -> None:
    """A symlink planted in the export never leads flexhub out of it. With createSubPath, a
    link to /etc and a relative link to ../.. fail the mount and create nothing on the node
    (the old ``mkdir -p`` made the directory there, as root); without createSubPath, a link
    to a directory beside the export that the server also serves is refused, not mounted.
    Every failure leaves the pod directory empty and no temporary mount behind."""
    tag = uuid.uuid4().hex[:6]
    made = f"flexhub-made-{tag}"
    beside = f"{services.NFS_ROOT}/beside-{tag}"
    rig.sh(
        f"ln -s /etc {rig.server_path(f'etc-{tag}')} && "
        f"ln -s ../.. {rig.server_path(f'up-{tag}')} && "
        f"mkdir {beside} && echo secret > {beside}/secret && "
        f"ln -s ../beside-{tag} {rig.server_path(f'beside-{tag}')}"
    )
    # where each link leads on the node: /etc, and two levels above the temporary mount
    escapes = [f"/etc/{made}", f"{BASE}/state/{made}"]
    cases = [
        ("4.2", {"subPath": f"etc-{tag}/{made}", "createSubPath": "true", "subPathMode": "0777"}),
        ("3", {"subPath": f"up-{tag}/{made}", "createSubPath": "true"}),
        ("4.2", {"subPath": f"beside-{tag}"}),
        ("3", {"subPath": f"beside-{tag}"}),
    ]
    for version, user in cases:
        target = rig.pod_dir()
        reply, _ = rig.mount(target, {**share(rig, version), "nfsVersion": version, **user})
        for path in escapes:
            assert rig.sh(f"test -e {path} || echo absent") == "absent\n", (path, reply)
        assert rig.sh(f"ls -A {target}") == "", reply
        assert reply["status"] == "Failure", (user, reply)
        assert "is a symbolic link in the export" in reply["message"], reply
        assert rig.mounts(target) == []
        rig.vm.run(["rmdir", target])
    assert rig.sh(f"ls -A {BASE}/state/nfs-tmp") == ""
    assert rig.sh(f"grep -c ' {BASE}/state/nfs-tmp' /proc/mounts", check=False) == "0\n"


# -- idempotency, stale mounts, bad options -------------------------------------------------------


def test_stale_mount_is_replaced(rig: Rig) -> None:
    """After the server replaces the exported directory (ESTALE on the client), mount on the
    same pod directory cleans the stale mount and mounts again, and the pod can write; the
    unmount of a stale mount is Success too.

    The core detects the stale handle with a ``stat`` of the mount point, which the client
    answers from its attribute cache until it expires (acdirmax, 60 s by default): the test
    mounts with ``actimeo=1`` to see it at once."""
    name = f"stale-{uuid.uuid4().hex[:6]}"
    target = rig.pod_dir()
    user = {
        **share(rig, "4.2"),
        "nfsVersion": "4.2",
        "subPath": name,
        "createSubPath": "true",
        "mountOptions": "actimeo=1",
    }
    assert rig.mount(target, user)[0] == {"status": "Success"}
    try:
        (before,) = rig.mounts(target)
        rig.sh(f"rm -rf {rig.server_path(name)} && mkdir {rig.server_path(name)}")
        probe = rig.vm.run(["stat", "-f", target], check=False, timeout=30)
        assert probe.rc != 0 and "Stale file handle" in probe.output
        time.sleep(1.5)
        reply, elapsed = rig.mount(target, user)
        assert reply == {"status": "Success"}, reply
        (after,) = rig.mounts(target)
        assert after[0] == before[0]
        rig.vm.write_file(f"{target}/fresh", "ok")
        assert rig.sh(f"cat {rig.server_path(name, 'fresh')}") == "ok"
        LOG.info("stale mount replaced in %.2fs", elapsed)
    finally:
        reply, _ = rig.unmount(target)
        assert reply == {"status": "Success"}
        assert rig.mounts(target) == []


# -- dead servers ---------------------------------------------------------------------------------


def test_unreachable_server_fails_within_the_bound(rig: Rig) -> None:
    """A server that accepts TCP and never answers: mount is a Failure within the configured
    mount_timeout (v4.2: the mount hangs in the kernel and is killed at the bound; v3:
    mount.nfs' probe of mountd times out a little earlier), no mount or umount process is
    left, and the directory is left unmounted and empty."""
    pid = rig.vm.spawn([GUEST_PYTHON, "-c", SILENT_SERVER])
    try:
        rig.sh(
            f"for i in $(seq 50); do ss -ltn | grep -q '{SILENT_HOST}:{SILENT_PORT} ' && exit 0;"
            " sleep 0.1; done; exit 1"
        )
        for version in ("4.2", "3"):
            target = rig.pod_dir()
            user = {
                "server": SILENT_HOST,
                "share": "/export",
                "nfsVersion": version,
                "mountOptions": f"port={SILENT_PORT}"
                + (f",mountport={SILENT_PORT},mountproto=tcp" if version == "3" else ""),
            }
            reply, elapsed = rig.mount(target, user)
            inside = rig.last_call()["ms"] / 1000
            LOG.warning(
                "unreachable v%s server: %s after %.2fs (%.2fs in flexhub)",
                version,
                reply,
                elapsed,
                inside,
            )
            assert reply["status"] == "Failure"
            # the bound, then at most the reap of the killed mount (REAP_TIMEOUT) and the
            # clean-up, which an emulated guest beside two other CI sessions runs slowly
            # (15.3 s seen in flexhub at 8 s); never the kernel's own minutes-long retry
            assert inside < MOUNT_TIMEOUT + REAP_TIMEOUT + 6
            assert elapsed < MOUNT_TIMEOUT + REAP_TIMEOUT + OVERHEAD
            if version == "4.2":  # the kernel waits (hard): flexhub's bound kills mount
                assert reply["message"].startswith(
                    f"NFS server {SILENT_HOST} did not answer within {MOUNT_TIMEOUT}s"
                ), reply
                assert inside >= MOUNT_TIMEOUT
            else:  # mount.nfs' own RPC probe of mountd gives up first
                assert reply["message"].startswith(f"mount of NFS export {SILENT_HOST}:")
            assert rig.mount_commands() == []
            assert rig.mounts(target) == []
            assert rig.sh(f"ls -A {target}") == ""
            rig.vm.run(["rmdir", target])
    finally:
        rig.vm.run(["kill", str(pid)], check=False)


def test_server_stopped_while_mounted(rig: Rig) -> None:
    """nfsd stops while v3 and v4.2 pods have it mounted (a pod process held a file open
    and another hung on the dead mount until kubelet killed them): each unmount is Success
    within stat_timeout + force_unmount_timeout and leaves no mount and no process."""
    targets = {version: rig.pod_dir() for version in ("3", "4.2")}
    for version, target in targets.items():
        reply, _ = rig.mount(target, {**share(rig, version), "nfsVersion": version})
        assert reply["status"] == "Success", reply
        rig.vm.write_file(f"{target}/before-{version}", "x")
    holder = rig.vm.spawn(["/bin/sh", "-c", f"exec 3<{targets['4.2']}/before-4.2; sleep 600"])
    wait_holding(rig.vm, holder, f"{targets['4.2']}/before-4.2")
    rig.sh("rpc.nfsd 0")
    try:
        # A pod process touching the dead mount hangs (hard); kubelet kills it first.
        hung = rig.vm.spawn(["ls", "-l", f"{targets['4.2']}/"])
        wait_blocked(rig.vm, hung, "ls")
        rig.vm.run(["kill", "-9", str(holder), str(hung)], check=False)
        bound = STAT_TIMEOUT + FORCE_TIMEOUT + OVERHEAD
        for version, target in targets.items():
            reply, elapsed = rig.unmount(target)
            inside = rig.last_call()["ms"] / 1000
            LOG.warning(
                "v%s unmount with the server stopped: %.2fs (%.2fs in flexhub)",
                version,
                elapsed,
                inside,
            )
            assert reply == {"status": "Success"}, (version, reply)
            assert inside < STAT_TIMEOUT + FORCE_TIMEOUT + 3, (version, inside)
            assert elapsed < bound, (version, elapsed)
            assert rig.mounts(target) == []
        assert rig.mount_commands() == []
    finally:
        short_nfs_grace(rig.vm)
        rig.sh("rpc.nfsd 8")
