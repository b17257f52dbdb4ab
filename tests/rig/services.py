"""Guest services for the VM rig: node setup, a kernel NFS server and a
kernel LIO iSCSI target, all driven from host tests through a :class:`VM`.

Everything listens on loopback only (127.0.0.1 and, for a second iSCSI
portal, 127.0.0.2 — all of 127/8 is local on ``lo``).  Backing storage lives
on tmpfs inside the guest.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from tests.rig.image import RIG_DIR
from tests.rig.vm import GUEST_PYTHON, SYSTEM_PYTHON, VM, Result, RigError

GUEST_INITIATOR = "iqn.2026-01.io.flexhub:rig-node"
NFS_ROOT = "/srv"
NFS_EXPORT = "/srv/export"
LUN_DIR = "/var/lib/flexhub-rig/luns"
LIO = str(RIG_DIR / "lio.py")
MiB = 1024 * 1024

NODE_MODULES = ["loop", "sd_mod", "iscsi_tcp"]


def setup_node(vm: VM) -> None:
    """Make the guest look like a Kubernetes node: kernel modules, udevd (for
    /dev/disk/by-path), an initiator name and a running iscsid."""
    vm.run(["modprobe", "-a", *NODE_MODULES])
    vm.run(["/lib/systemd/systemd-udevd", "--daemon"])
    vm.write_file("/etc/iscsi/initiatorname.iscsi", f"InitiatorName={GUEST_INITIATOR}\n")
    vm.run(["iscsid"])


def _pids(vm: VM, name: str) -> list[str]:
    res = vm.run(["pidof", name], check=False)
    return res.stdout.split()


#: TERM to every process of each name, again each poll (a process that appears meanwhile, such
#: as an smbd child forked for a reconnecting client, is signalled too), for up to 5 s.
_KILL_SCRIPT = """
for i in $(seq 50); do
    alive=
    for name; do pids=$(pidof "$name") && { alive=1; kill $pids 2>/dev/null; }; done
    [ -z "$alive" ] && exit 0
    sleep 0.1
done
exit 1
"""


def _kill(vm: VM, *names: str) -> bool:
    """Stop guest daemons by the pids pidof reports; wait up to 5 s for them. Whether none of
    them is left."""
    return vm.run(["/bin/sh", "-c", _KILL_SCRIPT, "kill", *names], check=False).rc == 0


# --------------------------------------------------------------------------
# NFS


@dataclass
class NfsServer:
    """A running guest NFS server.  v4 clients mount ``{host}:{v4_path}``,
    v3 clients ``{host}:{v3_path}``; ``local_dir`` is the exported directory as
    seen on the server side."""

    host: str = "127.0.0.1"
    v4_path: str = "/export"
    v3_path: str = NFS_EXPORT
    local_dir: str = NFS_EXPORT

    def source(self, version: str = "4.2") -> str:
        """The mount source for NFS version ``version`` ("3", "4", "4.1", "4.2")."""
        path = self.v3_path if version.startswith("3") else self.v4_path
        return f"{self.host}:{path}"


def start_nfs_server(vm: VM, size: str = "256m", threads: int = 8) -> NfsServer:
    """Start the kernel NFS server exporting a tmpfs (v3 and v4, pseudo-root /srv)."""
    vm.run(["modprobe", "nfsd"])
    vm.run(["mkdir", "-p", NFS_ROOT])
    if vm.run(["mountpoint", "-q", NFS_ROOT], check=False).rc != 0:
        vm.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "rig-nfs", NFS_ROOT])
    vm.run(["mkdir", "-p", NFS_EXPORT])
    vm.run(["chmod", "0777", NFS_EXPORT])
    if vm.run(["mountpoint", "-q", "/proc/fs/nfsd"], check=False).rc != 0:
        vm.run(["mount", "-t", "nfsd", "nfsd", "/proc/fs/nfsd"])
    opts = "rw,sync,no_subtree_check,no_root_squash,insecure"
    vm.write_file(
        "/etc/exports",
        f"{NFS_ROOT} 127.0.0.0/8({opts},fsid=0,crossmnt)\n"
        f"{NFS_EXPORT} 127.0.0.0/8({opts},fsid=1)\n",
    )
    vm.run(["mkdir", "-p", "/run/rpcbind"])
    if not _pids(vm, "rpcbind"):
        vm.run(["rpcbind", "-w"])
    if not _pids(vm, "rpc.statd"):
        vm.run(["rpc.statd", "--no-notify"])
    vm.run(["exportfs", "-ra"])
    if not _pids(vm, "rpc.mountd"):
        vm.run(["rpc.mountd"])
    vm.run(["rpc.nfsd", str(threads)])
    return NfsServer()


def stop_nfs_server(vm: VM) -> None:
    """Stop the NFS server and drop its exports (client mounts must be gone)."""
    vm.run(["rpc.nfsd", "0"], check=False)
    vm.run(["exportfs", "-ua"], check=False)
    _kill(vm, "rpc.mountd", "rpc.statd", "rpcbind")
    vm.run(["umount", "/proc/fs/nfsd"], check=False)
    vm.run(["umount", NFS_ROOT], check=False)


# --------------------------------------------------------------------------
# iSCSI (kernel LIO target via rtslib-fb)


@dataclass
class Chap:
    userid: str
    password: str

    def as_dict(self) -> dict[str, str]:
        return {"userid": self.userid, "password": self.password}


@dataclass
class IscsiTarget:
    """A guest LIO target: one TPG with LUNs 0..n-1 on every portal."""

    iqn: str
    portals: list[str]
    lun_paths: list[str]
    lun_sizes: list[int]
    session_chap: Chap | None = None
    discovery_chap: Chap | None = None
    initiators: list[str] | None = None
    down: set[str] = field(default_factory=set)

    @property
    def portal(self) -> str:
        return self.portals[0]


def _lio(vm: VM, action: str, spec: dict[str, object]) -> dict[str, object]:
    """Run a lio.py action: in the agent when it runs under a python with
    rtslib (fast), else as ``/usr/bin/python3 lio.py`` (about 2 s more)."""
    resp = vm.request({"op": "lio", "action": action, "spec": spec}, 60)
    if resp["rc"] == 0:
        result: dict[str, object] = resp["result"]
        return result
    if resp["rc"] != 126:
        raise RigError(f"lio.py {action} {spec!r} failed:\n{resp.get('stderr', '')}")
    res = vm.run([SYSTEM_PYTHON, LIO, action, json.dumps(spec)], timeout=60)
    answer: dict[str, object] = json.loads(res.stdout.strip().splitlines()[-1])
    return answer


def _ensure_lio(vm: VM) -> None:
    vm.run(["modprobe", "-a", "target_core_mod", "target_core_file", "iscsi_target_mod"])
    # LIO writes its persistent-reservation metadata under <dbroot>/pr (rtslib sets the
    # dbroot to /etc/rtslib-fb-target) on every PR OUT; without that directory REGISTER
    # answers NOT READY (after registering).
    vm.run(["mkdir", "-p", LUN_DIR, "/etc/rtslib-fb-target/pr"])
    if vm.run(["mountpoint", "-q", LUN_DIR], check=False).rc != 0:
        vm.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "rig-luns", LUN_DIR])


def iscsi_target(
    vm: VM,
    lun_sizes: list[int] | None = None,
    portals: list[str] | None = None,
    session_chap: Chap | None = None,
    discovery_chap: Chap | None = None,
    initiators: list[str] | None = None,
    iqn: str | None = None,
    persistent_reservations: bool = True,
) -> IscsiTarget:
    """Create an LIO target with fileio LUNs (sparse files on tmpfs) of the
    given sizes (default one 64 MiB LUN) on the given portals (default
    127.0.0.1:3260).  ``initiators=None`` accepts any initiator; otherwise only
    the listed IQNs (use :data:`GUEST_INITIATOR` for the guest's own).
    ``persistent_reservations=False`` makes LUNs without SCSI-3 PR (``emulate_pr=0``)."""
    _ensure_lio(vm)
    sizes = lun_sizes or [64 * MiB]
    iqn = iqn or f"iqn.2026-01.io.flexhub:rig-{uuid.uuid4().hex[:8]}"
    short = iqn.rsplit(":", 1)[-1]
    paths = [f"{LUN_DIR}/{short}-lun{i}.img" for i in range(len(sizes))]
    for path, size in zip(paths, sizes, strict=True):
        vm.run(["truncate", "-s", str(size), path])
    target = IscsiTarget(
        iqn=iqn,
        portals=portals or ["127.0.0.1:3260"],
        lun_paths=paths,
        lun_sizes=list(sizes),
        session_chap=session_chap,
        discovery_chap=discovery_chap,
        initiators=initiators,
    )
    _lio(
        vm,
        "create",
        {
            "iqn": iqn,
            "portals": target.portals,
            "luns": [
                {"path": p, "size": s, "pr": persistent_reservations}
                for p, s in zip(paths, sizes, strict=True)
            ],
            "session_chap": session_chap.as_dict() if session_chap else None,
            "discovery_chap": discovery_chap.as_dict() if discovery_chap else None,
            "initiators": initiators,
        },
    )
    return target


def delete_iscsi_target(vm: VM, target: IscsiTarget) -> None:
    """Delete the target, its LUNs and backing files (initiators should have
    logged out first)."""
    _lio(vm, "delete", {"iqn": target.iqn})
    vm.run(["rm", "-f", *target.lun_paths])


def grow_lun(vm: VM, target: IscsiTarget, lun: int, new_size: int) -> None:
    """Grow LUN ``lun`` to ``new_size`` bytes on the target side.  The
    initiator sees it after a rescan (``iscsiadm -m session -R``)."""
    vm.run(["truncate", "-s", str(new_size), target.lun_paths[lun]])
    _lio(vm, "resize", {"iqn": target.iqn, "lun": lun, "size": new_size})
    target.lun_sizes[lun] = new_size


def portal_down(vm: VM, target: IscsiTarget, portal: str) -> None:
    """Stop serving ``portal`` and reset established connections to it."""
    _lio(vm, "portal_down", {"iqn": target.iqn, "portal": portal})
    target.down.add(portal)


def portal_up(vm: VM, target: IscsiTarget, portal: str) -> None:
    """Serve ``portal`` again."""
    _lio(vm, "portal_up", {"iqn": target.iqn, "portal": portal})
    target.down.discard(portal)


def lun_mkfs(
    vm: VM, target: IscsiTarget, lun: int, fstype: str = "ext4", extra: list[str] | None = None
) -> Result:
    """Make a filesystem directly on a LUN's backing file (target side)."""
    force = {"xfs": "-f", "btrfs": "-f"}.get(fstype, "-F")
    return vm.run([f"mkfs.{fstype}", force, *(extra or []), target.lun_paths[lun]], timeout=120)


def lun_write(vm: VM, target: IscsiTarget, lun: int, data: bytes, offset: int = 0) -> None:
    """Write raw bytes at ``offset`` into a LUN's backing file (target side)."""
    tmp = f"/tmp/rig-lun-write-{uuid.uuid4().hex[:8]}"
    vm.write_file(tmp, data)
    vm.run(
        [
            "dd",
            f"if={tmp}",
            f"of={target.lun_paths[lun]}",
            "bs=64k",
            f"seek={offset}",
            "oflag=seek_bytes",
            "conv=notrunc",
            "status=none",
        ]
    )
    vm.run(["rm", "-f", tmp])


def reset_iscsi(vm: VM) -> None:
    """Log out every initiator session, forget all nodes/discovery records and
    delete every LIO target: a clean slate between tests.

    A test that failed half-way may have left a LUN mounted (staged and bound into a pod
    directory): those mounts go first, lazily, then any multipath map, so that a later test
    never walks into a filesystem whose disk is gone."""
    table = vm.run(["findmnt", "-rn", "-o", "TARGET,SOURCE"], check=False).stdout
    stale = [
        line.split(" ", 1)[0]
        for line in table.splitlines()
        if line.split(" ", 1)[-1].startswith(("/dev/sd", "/dev/dm-", "/dev/mapper/"))
    ]
    for target in sorted(stale, key=len, reverse=True):
        vm.run(["umount", "-l", target.encode().decode("unicode_escape")], check=False)
    vm.run(["multipath", "-F"], check=False, timeout=60)
    vm.run(["iscsiadm", "-m", "node", "--logoutall=all"], check=False, timeout=60)
    vm.run(["iscsiadm", "-m", "node", "-o", "delete"], check=False)
    vm.run(["iscsiadm", "-m", "discoverydb", "-o", "delete"], check=False)
    vm.run(["rm", "-rf", "/etc/iscsi/nodes", "/etc/iscsi/send_targets"], check=False)
    if vm.run(["test", "-d", "/sys/kernel/config/target/iscsi"], check=False).rc == 0:
        _lio(vm, "delete", {})
    vm.run(["/bin/sh", "-c", f"rm -f {LUN_DIR}/*.img"], check=False)


# --------------------------------------------------------------------------
# initiator side (open-iscsi in the guest), for rig tests and test set-up


def discover(vm: VM, portal: str, chap: Chap | None = None, check: bool = True) -> Result:
    """SendTargets discovery against ``portal``, with discovery CHAP if given."""
    base = ["iscsiadm", "-m", "discoverydb", "-t", "sendtargets", "-p", portal]
    vm.run([*base, "-o", "delete"], check=False)
    vm.run([*base, "-o", "new"])
    if chap:
        for name, value in (
            ("authmethod", "CHAP"),
            ("username", chap.userid),
            ("password", chap.password),
        ):
            vm.run([*base, "-o", "update", "-n", f"discovery.sendtargets.auth.{name}", "-v", value])
    return vm.run([*base, "--discover"], check=check, timeout=60)


def login(vm: VM, iqn: str, portal: str, chap: Chap | None = None, check: bool = True) -> Result:
    """Create the node record (if discovery did not) and log in."""
    base = ["iscsiadm", "-m", "node", "-T", iqn, "-p", portal]
    if vm.run([*base], check=False).rc != 0:
        vm.run([*base, "-o", "new"])
    settings = (
        [("authmethod", "CHAP"), ("username", chap.userid), ("password", chap.password)]
        if chap
        else [("authmethod", "None")]
    )
    for name, value in settings:
        vm.run([*base, "-o", "update", "-n", f"node.session.auth.{name}", "-v", value])
    return vm.run([*base, "--login"], check=check, timeout=90)


def logout(vm: VM, iqn: str, portal: str | None = None, check: bool = True) -> Result:
    """Log out of ``iqn`` (on one portal, or all)."""
    argv = ["iscsiadm", "-m", "node", "-T", iqn]
    if portal:
        argv += ["-p", portal]
    return vm.run([*argv, "--logout"], check=check, timeout=60)


def session_disks(vm: VM, iqn: str | None = None) -> list[str]:
    """/dev names of the SCSI disks of the current iSCSI sessions (of ``iqn``),
    found through sysfs, sorted by name; waits for udev first."""
    vm.run(["udevadm", "settle", "--timeout=30"], check=False)
    script = (
        "for s in /sys/class/iscsi_session/session*; do "
        '[ -n "$1" ] && [ "$(cat $s/targetname)" != "$1" ] && continue; '
        'for b in $s/device/target*/*/block/*; do [ -e "$b" ] && echo /dev/${b##*/}; done; '
        "done; true"
    )
    res = vm.run(["/bin/sh", "-c", script, "sh", iqn or ""])
    return sorted(res.stdout.split())


# --------------------------------------------------------------------------
# multipath (device-mapper multipath over the two-portal target)

MULTIPATH_CONF = "defaults {\n    user_friendly_names no\n    find_multipaths no\n}\n"


def start_multipathd(vm: VM, conf: str = MULTIPATH_CONF) -> None:
    """Start multipathd with ``conf`` as /etc/multipath.conf (by default every
    path is multipathed, maps named by WWID under /dev/mapper)."""
    vm.run(["modprobe", "dm_multipath"])
    vm.write_file("/etc/multipath.conf", conf)
    if not _pids(vm, "multipathd"):
        vm.run(["multipathd"])


def stop_multipathd(vm: VM) -> None:
    """Stop multipathd and flush unused maps."""
    vm.run(["multipathd", "shutdown"], check=False)
    _kill(vm, "multipathd")
    vm.run(["multipath", "-F"], check=False)


# --------------------------------------------------------------------------
# SMB (Samba's smbd with a private configuration)

SMB_DIR = "/run/flexhub-rig-smb"
SMB_CONF = f"{SMB_DIR}/smb.conf"
SMB_ROOT = "/srv/smb"


@dataclass
class SmbServer:
    """A running guest Samba server on 127.0.0.1:445 serving ``share`` (the directory
    ``local_dir`` on the server side) to ``username`` / ``password``."""

    host: str = "127.0.0.1"
    share: str = "rig"
    local_dir: str = f"{SMB_ROOT}/rig"
    username: str = "flexsmb"
    password: str = ""
    shares: dict[str, str] = field(default_factory=dict)


def _smb_conf(shares: dict[str, str], username: str) -> str:
    lines = [
        "[global]",
        "  interfaces = 127.0.0.1",
        "  bind interfaces only = yes",
        "  smb ports = 445",
        "  disable netbios = yes",
        "  server role = standalone server",
        "  workgroup = RIG",
        "  server min protocol = SMB2_10",
        f"  passdb backend = tdbsam:{SMB_DIR}/passdb.tdb",
        f"  private dir = {SMB_DIR}/private",
        f"  lock directory = {SMB_DIR}/lock",
        f"  state directory = {SMB_DIR}/state",
        f"  cache directory = {SMB_DIR}/cache",
        f"  pid directory = {SMB_DIR}",
        f"  ncalrpc dir = {SMB_DIR}/ncalrpc",
        f"  log file = {SMB_DIR}/log.%m",
        "  log level = 1",
        "  load printers = no",
        "  printing = bsd",
        "  printcap name = /dev/null",
        "  disable spoolss = yes",
        "  map to guest = never",
    ]
    for name, path in shares.items():
        lines += [
            f"[{name}]",
            f"  path = {path}",
            "  read only = no",
            f"  valid users = {username}",
            "  create mask = 0666",
            "  directory mask = 0777",
        ]
    return "\n".join(lines) + "\n"


def start_smb_server(
    vm: VM, password: str, username: str = "flexsmb", shares: tuple[str, ...] = ("rig",)
) -> SmbServer:
    """Start smbd with a private configuration, a Unix and Samba user ``username`` whose
    password goes in through stdin (never an argv), and one share per name in ``shares``
    (directories on tmpfs under :data:`SMB_ROOT`, mode 0777). A running smbd (of an earlier
    test module) is restarted with the new configuration; the user's password is replaced."""
    vm.run(["modprobe", "cifs"])
    vm.run(["mkdir", "-p", SMB_ROOT, *(f"{SMB_DIR}/{d}" for d in _SMB_DIRS)])
    if vm.run(["mountpoint", "-q", SMB_ROOT], check=False).rc != 0:
        vm.run(["mount", "-t", "tmpfs", "-o", "size=128m,mode=0755", "rig-smb", SMB_ROOT])
    paths = {name: f"{SMB_ROOT}/{name}" for name in shares}
    for path in paths.values():
        vm.run(["mkdir", "-p", path])
        vm.run(["chmod", "0777", path])
    vm.write_file(SMB_CONF, _smb_conf(paths, username))
    if vm.run(["id", username], check=False).rc != 0:
        vm.run(["useradd", "-M", "-d", "/nonexistent", "-s", "/usr/sbin/nologin", username])
    vm.run(["smbpasswd", "-c", SMB_CONF, "-a", "-s", username], input=f"{password}\n{password}\n")
    stop_smbd(vm)
    start_smbd(vm)
    first = shares[0]
    return SmbServer(
        share=first,
        local_dir=paths[first],
        username=username,
        password=password,
        shares=paths,
    )


_SMB_DIRS = ("private", "lock", "state", "cache", "ncalrpc")


#: Sent to smbd until it answers (``SMB_READY_SECONDS`` at most): an SMB2 NEGOTIATE (dialects
#: 2.1, 3.0, 3.0.2) in its NetBIOS session frame. A listening port is not a server that answers
#: (smbd serves each connection from a child it forks): after a wait for the port alone, the
#: first mount of a fresh-machine CI run took longer than a CIFS test's 8 s mount bound.
SMB_READY_SECONDS = 60
SMB_NEGOTIATE_PROBE = """
import socket, struct, sys, time
dialects = (0x0210, 0x0300, 0x0302)
header = b"\\xfeSMB" + struct.pack("<HHIHHIIQIIQ16s", 64, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, b"")
body = struct.pack("<HHHHI16sQ", 36, len(dialects), 1, 0, 0, b"flexhub-rig-prob", 0)
body += struct.pack(f"<{len(dialects)}H", *dialects)
frame = struct.pack(">I", len(header) + len(body)) + header + body
deadline = time.monotonic() + float(sys.argv[1])
last = "no attempt"
while time.monotonic() < deadline:
    try:
        with socket.create_connection(("127.0.0.1", 445), timeout=5) as conn:
            conn.sendall(frame)
            reply = b""
            while len(reply) < 16:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                reply += chunk
        status = struct.unpack_from("<I", reply, 12)[0] if len(reply) >= 16 else None
        if reply[4:8] == b"\\xfeSMB" and status == 0:
            sys.exit(0)
        last = f"answer {reply[:16].hex()}"
    except OSError as exc:
        last = str(exc)
    time.sleep(0.2)
sys.exit(f"smbd did not answer an SMB2 NEGOTIATE within {sys.argv[1]}s: {last}")
"""


def start_smbd(vm: VM) -> None:
    """Start smbd (daemonised) with the rig's configuration; wait until it answers an SMB2
    NEGOTIATE on 127.0.0.1:445 (its log is the error when it does not)."""
    if not _pids(vm, "smbd"):
        vm.run(["smbd", "-D", "-s", SMB_CONF])
    probe = vm.run(
        [GUEST_PYTHON, "-I", "-c", SMB_NEGOTIATE_PROBE, str(SMB_READY_SECONDS)],
        check=False,
        timeout=SMB_READY_SECONDS + 30,
    )
    if probe.rc != 0:
        log = vm.run(["cat", f"{SMB_DIR}/log.smbd"], check=False).stdout
        raise RigError(f"{probe.stderr.strip()}\nlog.smbd:\n{log}")


def stop_smbd(vm: VM) -> None:
    """Stop every smbd process (client mounts see the connection reset); an smbd that
    survives is an error (a probe would otherwise find the old server ready)."""
    if not _kill(vm, "smbd"):
        raise RigError(f"smbd {' '.join(_pids(vm, 'smbd'))} still running 5 s after SIGTERM")


# --------------------------------------------------------------------------
# SSH (OpenSSH's sshd with a private configuration, for the provisioner's target host)

SSH_DIR = "/run/flexhub-rig-ssh"

#: root's ~/.bashrc in the guest: what a stock Debian host has (comments only).
STOCK_BASHRC = "# ~/.bashrc: executed by bash(1) for non-login shells.\n"


@dataclass
class SshServer:
    """A guest sshd on ``host:port`` that lets root in with ``private_key`` only;
    ``known_hosts`` is its host key line as ``ssh-keyscan`` would print it."""

    host: str
    port: int
    private_key: str
    known_hosts: str


def start_sshd(vm: VM, port: int = 2222) -> SshServer:
    """Start (once per VM) sshd on 127.0.0.1:``port`` with fresh host and client keys under
    :data:`SSH_DIR` (0700): public-key login for root only, no passwords, no PAM."""
    # sshd runs every command through the account's shell, and Debian's bash reads ~/.bashrc
    # when sshd starts it. The guest's /root is this machine's, whose .bashrc runs
    # `pyenv init`: 3.8 of the 4.5 s each ssh call took under emulation. A target host's
    # root has a stock one: so has the guest's (its overlay only; the host's is untouched).
    vm.write_file("/root/.bashrc", STOCK_BASHRC, mode=0o644)
    if _pids(vm, "sshd"):
        key = vm.read_file(f"{SSH_DIR}/client").decode()
        host_key = vm.read_file(f"{SSH_DIR}/host.pub").decode().split()
        return SshServer(
            "127.0.0.1", port, key, f"[127.0.0.1]:{port} {host_key[0]} {host_key[1]}\n"
        )
    vm.run(["mkdir", "-p", "-m", "0700", SSH_DIR])
    vm.run(["mkdir", "-p", "-m", "0755", "/run/sshd"])  # sshd's privilege separation dir
    vm.run(["rm", "-f", f"{SSH_DIR}/host", f"{SSH_DIR}/host.pub", f"{SSH_DIR}/client"])
    vm.run(["rm", "-f", f"{SSH_DIR}/client.pub"])
    for name in ("host", "client"):
        vm.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", f"{SSH_DIR}/{name}"]
        )
    vm.run(["cp", f"{SSH_DIR}/client.pub", f"{SSH_DIR}/authorized_keys"])
    vm.run(["chmod", "0600", f"{SSH_DIR}/authorized_keys"])
    config = "\n".join(
        [
            f"ListenAddress 127.0.0.1:{port}",
            f"HostKey {SSH_DIR}/host",
            f"AuthorizedKeysFile {SSH_DIR}/authorized_keys",
            f"PidFile {SSH_DIR}/sshd.pid",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "AllowUsers root",
            # Speed under emulation only (about 2.5 s a connection): the client's default
            # key exchange (sntrup761x25519, post-quantum hybrid) is left to real hosts.
            "KexAlgorithms curve25519-sha256",
            "LogLevel ERROR",
            "",
        ]
    )
    vm.write_file(f"{SSH_DIR}/sshd_config", config, mode=0o600)
    vm.run(["/usr/sbin/sshd", "-f", f"{SSH_DIR}/sshd_config", "-E", f"{SSH_DIR}/sshd.log"])
    vm.sh(
        f"for i in $(seq 100); do ss -ltn | grep -q '127.0.0.1:{port} ' && exit 0; sleep 0.1;"
        f" done; cat {SSH_DIR}/sshd.log >&2; exit 1"
    )
    key = vm.read_file(f"{SSH_DIR}/client").decode()
    host_key = vm.read_file(f"{SSH_DIR}/host.pub").decode().split()
    return SshServer("127.0.0.1", port, key, f"[127.0.0.1]:{port} {host_key[0]} {host_key[1]}\n")
