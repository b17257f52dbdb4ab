"""Fixtures for the iscsi backend unit tests: a fake sysfs tree and a fake iscsiadm.

The fake runner plays open-iscsi: ``--login`` makes a session in the fake sysfs, ``--logout``
removes it, and a scan of an exported LUN makes its disk. Every argv is recorded twice: as the
runner would log it (masked) and raw (to check what reached the command).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from flexhub_iscsi import IscsiBackend
from flexhub_iscsi._records import RecordFiles
from flexhub_iscsi._sysfs import Session, Sysfs

from flexhub.config import NodeConfig
from flexhub.node import Node
from flexhub.node.runner import Result, command_error, mask

IQN = "iqn.2024-01.org.example:store"
MiB = 1024 * 1024


class FakeSysfs(Sysfs):
    """A sysfs tree under ``tmp``: sessions, hosts, disks, multipath maps."""

    def __init__(self, root: Path, dev: Path) -> None:
        super().__init__(root, dev)
        self.exported: dict[str, dict[int, int]] = {}  # iqn -> {lun: size}
        self.next_sid = 1
        self.next_disk = 0
        self.scans: list[tuple[int, int]] = []  # (sid, lun)
        self.deleted: list[str] = []
        self.fail_scan = False
        for sub in ("class/iscsi_session", "class/iscsi_connection", "class/block", "dev/block"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        dev.mkdir(parents=True, exist_ok=True)

    # -- building ------------------------------------------------------------------------------

    def add_session(self, iqn: str, portal: str, iface: str = "default") -> Session:
        sid = host = self.next_sid
        self.next_sid += 1
        address, _, port = portal.rpartition(":")
        address = address.strip("[]")
        device = self.root / "devices" / "platform" / f"host{host}" / f"session{sid}"
        device.mkdir(parents=True)
        entry = self.root / "class" / "iscsi_session" / f"session{sid}"
        entry.mkdir()
        (entry / "targetname").write_text(iqn + "\n")
        (entry / "ifacename").write_text(iface + "\n")
        (entry / "state").write_text("LOGGED_IN\n")
        (entry / "target_id").write_text("0\n")
        (entry / "initiatorname").write_text(fake_initiator(self.root.parent) + "\n")
        os.symlink(device, entry / "device")
        conn = self.root / "class" / "iscsi_connection" / f"connection{sid}:0"
        conn.mkdir()
        (conn / "persistent_address").write_text(address + "\n")
        (conn / "persistent_port").write_text(port + "\n")
        scsi_host = self.root / "class" / "scsi_host" / f"host{host}"
        scsi_host.mkdir(parents=True)
        (scsi_host / "scan").write_text("")
        return next(s for s in self.sessions() if s.sid == sid)

    def remove_session(self, sid: int) -> None:
        for disk in [d for s in self.sessions() if s.sid == sid for d in self._disks_of(s)]:
            self._remove_disk(disk)
        shutil.rmtree(self.root / "devices" / "platform" / f"host{sid}")
        shutil.rmtree(self.root / "class" / "iscsi_session" / f"session{sid}")
        shutil.rmtree(self.root / "class" / "iscsi_connection" / f"connection{sid}:0")
        shutil.rmtree(self.root / "class" / "scsi_host" / f"host{sid}")

    def _disks_of(self, session: Session) -> list[str]:
        return [d for disks in self.luns_in_use(session).values() for d in disks]

    def add_disk(self, session: Session, lun: int, size: int = 64 * MiB) -> str:
        name = "sd" + "abcdefghijklmnopqrstuvwxyz"[self.next_disk]
        self.next_disk += 1
        unit = session.path / f"target{session.host}:0:0" / f"{session.host}:0:0:{lun}"
        (unit / "block" / name).mkdir(parents=True)
        block = self.root / "class" / "block" / name
        (block / "holders").mkdir(parents=True)
        (block / "device").mkdir()
        (block / "device" / "delete").write_text("")
        (block / "device" / "rescan").write_text("")
        (block / "device" / "state").write_text("running\n")
        (block / "size").write_text(f"{size // 512}\n")
        (self.dev / name).write_text("")
        return name

    def _remove_disk(self, name: str) -> None:
        for unit in (self.root / "devices").glob(f"platform/host*/session*/target*/*/block/{name}"):
            shutil.rmtree(unit.parent.parent)
        shutil.rmtree(self.root / "class" / "block" / name, ignore_errors=True)
        (self.dev / name).unlink(missing_ok=True)

    def add_map(self, name: str, disks: Sequence[str], dm: str = "dm-0") -> str:
        block = self.root / "class" / "block" / dm
        (block / "dm").mkdir(parents=True)
        (block / "dm" / "name").write_text(name + "\n")
        (block / "dm" / "uuid").write_text(f"mpath-{name}\n")
        (block / "slaves").mkdir()
        (block / "holders").mkdir()
        size = (self.root / "class" / "block" / disks[0] / "size").read_text()
        (block / "size").write_text(size)
        for disk in disks:
            (block / "slaves" / disk).write_text("")
            (self.root / "class" / "block" / disk / "holders" / dm).write_text("")
        (self.dev / dm).write_text("")
        return dm

    def remove_map(self, name: str) -> None:
        dm = self.find_map(name)
        assert dm is not None
        for disk in self.slaves(dm):
            (self.root / "class" / "block" / disk / "holders" / dm).unlink(missing_ok=True)
        shutil.rmtree(self.root / "class" / "block" / dm)
        (self.dev / dm).unlink()

    def set_size(self, name: str, size: int) -> None:
        (self.root / "class" / "block" / name / "size").write_text(f"{size // 512}\n")

    # -- what the kernel would do --------------------------------------------------------------

    def scan(self, session: Session, lun: int) -> None:
        self.scans.append((session.sid, lun))
        if self.fail_scan:
            raise OSError("scan refused")
        if lun in self.exported.get(session.target, {}) and not self.lun_disks(session, lun):
            self.add_disk(session, lun, self.exported[session.target][lun])

    def delete(self, name: str) -> None:
        self.deleted.append(name)
        self._remove_disk(name)

    def rescan(self, name: str) -> None:
        for session in self.sessions():
            for lun, disks in self.luns_in_use(session).items():
                if name in disks:
                    self.set_size(name, self.exported[session.target][lun])


Answer = Result | Callable[[tuple[str, ...]], Result]


def fake_initiator(base: Path) -> str:
    """The initiator name of the fake node whose sysfs and /dev live under ``base``."""
    return f"iqn.2024-01.test.fake:{base.name}"


@dataclass
class FakePR:
    """The persistent-reservation state of one LUN, as ``sg_persist`` sees it (each device
    path is its own I_T nexus, of the initiator of the fake node whose /dev holds it), for a
    type 5 target like LIO; ``supported=False`` plays a target without persistent
    reservations. The PR generation moves as LIO's does (seen in the VM rig): up by one on
    every registration (also of a key already registered) and preemption, not on a
    reservation or an unregistration."""

    registered: dict[str, int] = field(default_factory=dict)  # device -> key
    holder: tuple[str, int] | None = None  # (device, key)
    supported: bool = True
    generation: int = 0
    full_status: bool = True  # whether READ FULL STATUS is implemented
    #: plays a Linux LIO target whose ``<dbroot>/pr`` is missing: every PR OUT takes effect,
    #: then is answered NOT READY (LIO cannot write its reservation state file)
    no_pr_dir: bool = False

    @staticmethod
    def initiator(device: str) -> str:
        return fake_initiator(Path(device).parent.parent)

    def __call__(self, args: tuple[str, ...]) -> Result:
        device = args[-1]
        if not self.supported:
            return Result(args, 5, "", "PR in (Read reservation): Illegal request")
        opt = {a.split("=")[0]: int(a.split("=")[1], 16) for a in args if "=" in a}
        mine = self.registered.get(device)
        gen = f"  PR generation={self.generation:#x}"
        if "--read-reservation" in args:
            if self.holder is None:
                return Result(args, 0, f"{gen}, there is NO reservation held\n", "")
            return Result(
                args,
                0,
                f"{gen}, Reservation follows:\n    Key={self.holder[1]:#x}\n"
                "    scope: LU_SCOPE,  type: Write Exclusive, registrants only\n",
                "",
            )
        if "--read-keys" in args:
            keys = [f"    {k:#x}" for _, k in sorted(self.registered.items())]
            if not keys:
                return Result(args, 0, f"{gen}, there are NO registered reservation keys\n", "")
            head = f"{gen}, {len(keys)} registered reservation keys follow:"
            return Result(args, 0, "\n".join([head, *keys]) + "\n", "")
        if "--read-full-status" in args:
            if not self.full_status:
                return Result(args, 5, "", "PR in (Read full status): Illegal request")
            if not self.registered:
                return Result(args, 0, f"{gen}\n  No full status descriptors\n", "")
            lines = [gen]
            for path, key in sorted(self.registered.items()):
                lines += [f"    Key={key:#x}", "      All target ports bit clear"]
                if self.holder == (path, key):
                    lines += [
                        "      << Reservation holder >>",
                        "      scope: LU_SCOPE,  type: Write Exclusive, registrants only",
                    ]
                lines += [
                    "      Transport Id of initiator:",
                    f"        iSCSI world wide unique port id: {self.initiator(path)},i,"
                    "0x00023d000001",
                ]
            return Result(args, 0, "\n".join(lines) + "\n", "")
        conflict = Result(args, 24, "", "PR out: Reservation conflict")
        if "--register-ignore" in args:
            if opt["--param-sark"]:
                self.registered[device] = opt["--param-sark"]
                self.generation += 1
            else:
                self.registered.pop(device, None)
                if self.holder and self.holder[0] == device:
                    self.holder = None
        elif "--reserve" in args:
            if mine is None or mine != opt["--param-rk"]:
                return conflict
            if self.holder and self.holder[0] != device:
                return conflict
            self.holder = (device, mine)
        elif "--preempt" in args:
            if mine is None or mine != opt["--param-rk"]:
                return conflict
            victim = opt["--param-sark"]
            self.registered = {d: k for d, k in self.registered.items() if k != victim}
            if self.holder and self.holder[1] == victim:
                self.holder = (device, mine)
            self.generation += 1
        if self.no_pr_dir:
            return Result(args, 2, "", "PR out: device not ready\nsg_persist failed: Not ready")
        return Result(args, 0, "", "")


@dataclass
class FakeIscsi:
    """A runner that plays iscsiadm/multipath against a :class:`FakeSysfs`."""

    sysfs: FakeSysfs
    calls: list[list[str]] = field(default_factory=list)
    raw: list[tuple[str, ...]] = field(default_factory=list)
    secrets_seen: list[list[str]] = field(default_factory=list)
    answers: list[tuple[tuple[str, ...], Answer]] = field(default_factory=list)
    multipathd: bool = False
    pr: FakePR = field(default_factory=FakePR)
    #: open-iscsi's database directory: ``-o show`` of a node or discovery record makes its
    #: file there when missing and prints it (passwords masked), like iscsiadm.
    etc: Path | None = None

    def answer(self, *words: str, rc: int = 0, stdout: str = "", stderr: str = "") -> None:
        """Answer every argv that contains all of ``words`` (in any place) like this."""
        self.answers.append((words, Result(words, rc, stdout, stderr)))

    def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        check: bool = True,
        secrets: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> Result:
        args = tuple(str(a) for a in argv)
        self.calls.append(mask(args, secrets))
        self.raw.append(args)
        self.secrets_seen.append(list(secrets))
        result = self._answer(args)
        if check and result.returncode != 0:
            raise command_error(result, secrets)
        return result

    def _answer(self, args: tuple[str, ...]) -> Result:
        for words, answer in reversed(self.answers):
            if all(w in args for w in words):
                if callable(answer):
                    return answer(args)
                return Result(args, answer.returncode, answer.stdout, answer.stderr)
        ok = Result(args, 0, "", "")
        if args[:1] == ("multipathd",):
            if "daemon" in args:
                return ok if self.multipathd else Result(args, 1, "", "can't connect")
            return ok
        if args[:1] == ("sg_persist",):
            return self.pr(args)
        if args[:2] == ("multipath", "-f"):
            self.sysfs.remove_map(args[2])
            return ok
        if args[:1] != ("iscsiadm",):
            return ok
        iqn = args[args.index("-T") + 1] if "-T" in args else ""
        portal = args[args.index("-p") + 1] if "-p" in args else ""
        iface = args[args.index("-I") + 1] if "-I" in args else "default"
        show = "--login" not in args and "--logout" not in args and "--discover" not in args
        if show and self.etc is not None and portal and ("-o" not in args or "show" in args):
            if "node" in args and iqn:
                return self._show(args, self._node_file(iqn, portal, iface))
            if "discoverydb" in args:
                return self._show(args, self._discovery_file(portal))
        if args[1:3] == ("-m", "node") and args[-2:] == ("-o", "delete") and self.etc:
            self._delete_node_files(iqn, portal, iface)
        if "--login" in args:
            if any(s.portal == portal for s in self.sysfs.sessions_of(iqn, iface)):
                return Result(args, 15, "", "iscsiadm: default: 1 session requested")
            self.sysfs.add_session(iqn, portal, iface)
        elif "--logout" in args:
            found = [s for s in self.sysfs.sessions_of(iqn, iface) if s.portal == portal]
            if not found:
                return Result(args, 21, "", "iscsiadm: No matching sessions found")
            for session in found:
                self.sysfs.remove_session(session.sid)
        return ok

    def _delete_node_files(self, iqn: str, portal: str, iface: str) -> None:
        """``-m node -T IQN [-p PORTAL] -I IFACE -o delete``: remove those record files."""
        assert self.etc is not None
        where = self.etc / "nodes" / iqn
        if portal:
            address, _, port = portal.rpartition(":")
            address = address.strip("[]")
            name = f"{address},{port}"  # "PORT,TPGT" names one directory exactly
            dirs = [d for d in where.glob("*") if d.name == name or d.name.startswith(name + ",")]
        else:
            dirs = list(where.glob("*"))
        for directory in dirs:
            (directory / iface).unlink(missing_ok=True)
            if not any(directory.iterdir()):
                directory.rmdir()
        if where.is_dir() and not any(where.iterdir()):
            where.rmdir()

    def node_files(self, iqn: str) -> list[str]:
        """The node record files of ``iqn`` (``portal-dir/iface``), sorted."""
        assert self.etc is not None
        return sorted(
            str(p.relative_to(self.etc / "nodes" / iqn))
            for p in (self.etc / "nodes" / iqn).glob("*/*")
        )

    def _node_file(self, iqn: str, portal: str, iface: str) -> Path:
        assert self.etc is not None
        address, _, port = portal.rpartition(":")
        path = self.etc / "nodes" / iqn / f"{address.strip('[]')},{port},1" / iface
        header = f"node.name = {iqn}\nnode.tpgt = 1\n"
        header += f"node.conn[0].address = {address.strip('[]')}\nnode.conn[0].port = {port}\n"
        return self._make(path, header)

    def _discovery_file(self, portal: str) -> Path:
        assert self.etc is not None
        address, _, port = portal.rpartition(":")
        path = self.etc / "send_targets" / f"{address.strip('[]')},{port}" / "st_config"
        header = f"discovery.sendtargets.address = {address.strip('[]')}\n"
        return self._make(path, header + f"discovery.sendtargets.port = {port}\n")

    @staticmethod
    def _make(path: Path, body: str) -> Path:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            path.write_text(f"# BEGIN RECORD 2.1.8\n{body}# END RECORD\n")
            path.chmod(0o600)
        return path

    @staticmethod
    def _show(args: tuple[str, ...], path: Path) -> Result:
        lines = []
        for line in path.read_text().splitlines():
            name, sep, value = line.partition(" = ")
            if sep and name.endswith(("password", "password_in")) and value:
                value = "********"
            if sep:
                lines.append(f"{name} = {value}")
        return Result(args, 0, "\n".join(lines) + "\n", "")

    def iscsiadm_calls(self) -> list[list[str]]:
        return [c for c in self.calls if c[:1] == ["iscsiadm"]]


@pytest.fixture
def sysfs(tmp_path: Path) -> FakeSysfs:
    fake = FakeSysfs(tmp_path / "sys", tmp_path / "dev")
    fake.exported[IQN] = {0: 64 * MiB, 1: 32 * MiB}
    return fake


@pytest.fixture
def runner(sysfs: FakeSysfs, tmp_path: Path) -> FakeIscsi:
    return FakeIscsi(sysfs, etc=tmp_path / "etc-iscsi")


@pytest.fixture
def node(tmp_path: Path, runner: FakeIscsi) -> Node:
    config = NodeConfig(
        state_dir=tmp_path / "state",
        log_dir=tmp_path / "log",
        lock_timeout=5,
        backends={"iscsi": {"device_timeout": 0.5, "multipath_timeout": 0.3}},
    )
    return Node(config, backend="iscsi", runner=runner)


@pytest.fixture
def backend(node: Node, sysfs: FakeSysfs) -> IscsiBackend:
    instance = IscsiBackend(node)
    instance.sysfs = sysfs
    assert isinstance(node.runner, FakeIscsi) and node.runner.etc is not None
    instance._records = RecordFiles(node.runner.etc)
    return instance
