"""What the kernel knows about iSCSI sessions, their SCSI disks and multipath maps (sysfs).

sysfs is the truth about live sessions (``iscsiadm -m session`` reads it too), and it works
where udev does not run: the disks of a session are found under its device directory, not
through ``/dev/disk/by-path``. Layout used (kernel 4.x to 6.x)::

    class/iscsi_session/sessionN/{targetname,ifacename,state}
    class/iscsi_session/sessionN/device -> devices/platform/hostH/sessionN
    devices/platform/hostH/sessionN/targetH:C:T/H:C:T:L/block/sdX
    class/iscsi_connection/connectionN:0/{persistent_address,persistent_port}
    class/scsi_host/hostH/scan                  "C T L" scans one LUN
    class/block/sdX/{size,holders/dm-M,device/delete,device/rescan}
    class/block/dm-M/dm/{name,uuid}

The roots are parameters so that tests can build a fake tree.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

from flexhub.backend import Frozen

__all__ = ["Session", "Sysfs"]

LOG = logging.getLogger(__name__)

_TARGET_DIR = re.compile(r"^target(\d+):(\d+):(\d+)$")
_HOST_DIR = re.compile(r"^host(\d+)$")
_SESSION_DIR = re.compile(r"^session(\d+)$")
_SECTOR = 512


class Session(Frozen):
    """One live iSCSI session (a path to a target through one portal and iface)."""

    __slots__ = (  # noqa: RUF023 - the fields, in order
        "sid",
        "target",
        "iface",
        "address",
        "port",
        "state",
        "host",
        "path",
        "initiator",
    )
    sid: int
    target: str
    iface: str
    address: str
    port: int
    state: str
    host: int
    path: Path
    #: the initiator name the session logged in with ("" if the kernel does not show it)
    initiator: str

    def __init__(
        self,
        sid: int,
        target: str,
        iface: str,
        address: str,
        port: int,
        state: str,
        host: int,
        path: Path,
        initiator: str = "",
    ) -> None:
        self._set(
            sid=sid,
            target=target,
            iface=iface,
            address=address,
            port=port,
            state=state,
            host=host,
            path=path,
            initiator=initiator,
        )

    @property
    def logged_in(self) -> bool:
        return self.state in ("LOGGED_IN", "")

    @property
    def portal(self) -> str:
        if ":" in self.address:
            return f"[{self.address}]:{self.port}"
        return f"{self.address}:{self.port}"


def _read(path: Path) -> str:
    try:
        return path.read_text("utf-8", "replace").strip()
    except OSError:
        return ""


class Sysfs:
    """Read and poke sysfs under ``root`` (``/sys``); device nodes live under ``dev``."""

    def __init__(self, root: Path = Path("/sys"), dev: Path = Path("/dev")) -> None:
        self.root = root
        self.dev = dev

    # -- sessions ------------------------------------------------------------------------------

    def sessions(self) -> list[Session]:
        """Every iSCSI session the kernel has, sorted by id."""
        base = self.root / "class" / "iscsi_session"
        try:
            names = os.listdir(base)
        except OSError:
            return []
        found: list[Session] = []
        for name in names:
            match = _SESSION_DIR.match(name)
            if not match:
                continue
            sid = int(match.group(1))
            entry = base / name
            try:
                device = (entry / "device").resolve(strict=True)
            except OSError:
                continue
            host = _HOST_DIR.match(device.parent.name)
            conn = self.root / "class" / "iscsi_connection" / f"connection{sid}:0"
            address = _read(conn / "persistent_address") or _read(conn / "address")
            port_text = _read(conn / "persistent_port") or _read(conn / "port")
            found.append(
                Session(
                    sid=sid,
                    target=_read(entry / "targetname"),
                    iface=_read(entry / "ifacename") or "default",
                    address=address,
                    port=int(port_text) if port_text.isdigit() else 0,
                    state=_read(entry / "state"),
                    host=int(host.group(1)) if host else -1,
                    path=device,
                    initiator=_read(entry / "initiatorname"),
                )
            )
        return sorted(found, key=lambda s: s.sid)

    def device_state(self, name: str) -> str:
        """The SCSI state of disk ``name`` (``running``, ``blocked``, ``offline``,
        ``transport-offline``...); ``""`` when the disk is gone."""
        return _read(self.root / "class" / "block" / name / "device" / "state")

    def sessions_of(self, iqn: str, iface: str) -> list[Session]:
        """The sessions to target ``iqn`` through ``iface``."""
        return [s for s in self.sessions() if s.target == iqn and s.iface == iface]

    # -- disks ---------------------------------------------------------------------------------

    def _lun_dirs(self, session: Session) -> list[tuple[int, Path]]:
        """``(lun, H:C:T:L directory)`` of every SCSI device of ``session``."""
        found: list[tuple[int, Path]] = []
        try:
            targets = sorted(os.listdir(session.path))
        except OSError:
            return found
        for target in targets:
            if not _TARGET_DIR.match(target):
                continue
            try:
                units = sorted(os.listdir(session.path / target))
            except OSError:
                continue
            for unit in units:
                parts = unit.split(":")
                if len(parts) == 4 and all(p.isdigit() for p in parts):
                    found.append((int(parts[3]), session.path / target / unit))
        return found

    def lun_disks(self, session: Session, lun: int) -> list[str]:
        """Block device names (``sdX``) of LUN ``lun`` in ``session``."""
        disks: list[str] = []
        for number, unit in self._lun_dirs(session):
            if number != lun:
                continue
            with contextlib.suppress(OSError):
                disks.extend(sorted(os.listdir(unit / "block")))
        return disks

    def luns_in_use(self, session: Session) -> dict[int, list[str]]:
        """Every LUN of ``session`` that has a block device, with its device names."""
        result: dict[int, list[str]] = {}
        for number, unit in self._lun_dirs(session):
            with contextlib.suppress(OSError):
                names = sorted(os.listdir(unit / "block"))
                if names:
                    result.setdefault(number, []).extend(names)
        return result

    def scan(self, session: Session, lun: int) -> None:
        """Ask the session's SCSI host to scan LUN ``lun`` only (never a wildcard scan)."""
        channel = 0
        target_text = _read(
            self.root / "class" / "iscsi_session" / f"session{session.sid}" / "target_id"
        )
        target_id = int(target_text) if target_text.isdigit() else 0
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(session.path)):
                match = _TARGET_DIR.match(name)
                if match:
                    channel, target_id = int(match.group(2)), int(match.group(3))
                    break
        path = self.root / "class" / "scsi_host" / f"host{session.host}" / "scan"
        path.write_text(f"{channel} {target_id} {lun}")

    def node_exists(self, name: str) -> bool:
        return (self.dev / name).exists()

    # -- block devices -------------------------------------------------------------------------

    def _block(self, name: str) -> Path:
        return self.root / "class" / "block" / name

    def size(self, name: str) -> int | None:
        """Size in bytes of block device ``name``; ``None`` when it is gone."""
        text = _read(self._block(name) / "size")
        return int(text) * _SECTOR if text.isdigit() else None

    def holders(self, name: str) -> list[str]:
        """The devices stacked on ``name`` (``dm-N`` for a multipath map)."""
        try:
            return sorted(os.listdir(self._block(name) / "holders"))
        except OSError:
            return []

    def multipath_map(self, dm: str) -> str | None:
        """The map name of ``dm`` when it is a multipath map, else ``None``."""
        if not _read(self._block(dm) / "dm" / "uuid").startswith("mpath-"):
            return None
        return _read(self._block(dm) / "dm" / "name") or None

    def find_map(self, map_name: str) -> str | None:
        """The ``dm-N`` of the multipath map ``map_name``, if it exists."""
        base = self.root / "class" / "block"
        try:
            names = sorted(os.listdir(base))
        except OSError:
            return None
        for name in names:
            if name.startswith("dm-") and self.multipath_map(name) == map_name:
                return name
        return None

    def slaves(self, dm: str) -> list[str]:
        try:
            return sorted(os.listdir(self._block(dm) / "slaves"))
        except OSError:
            return []

    def delete(self, name: str) -> None:
        """Remove SCSI disk ``name`` from the kernel (``device/delete``); no-op when gone."""
        path = self._block(name) / "device" / "delete"
        try:
            path.write_text("1")
        except FileNotFoundError:
            LOG.debug("%s is already gone", name)

    def rescan(self, name: str) -> None:
        """Make the kernel re-read the capacity of SCSI disk ``name``."""
        (self._block(name) / "device" / "rescan").write_text("1")

    def block_name(self, device: str) -> str | None:
        """The sysfs name (``sdc``, ``dm-3``) of the device node ``device``."""
        real = os.path.realpath(device)
        name = os.path.basename(real)
        if real.startswith(str(self.dev) + "/") and self._block(name).exists():
            return name
        try:
            rdev = os.stat(device).st_rdev
        except OSError:
            return None
        link = self.root / "dev" / "block" / f"{os.major(rdev)}:{os.minor(rdev)}"
        try:
            return link.resolve(strict=True).name
        except OSError:
            return None
