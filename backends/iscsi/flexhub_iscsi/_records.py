"""open-iscsi's record files, written without putting a CHAP value on any command line.

``iscsiadm`` takes values only as ``-v VALUE`` arguments, which every local user can read in
``/proc/<pid>/cmdline``. open-iscsi reads its records from files at every login and
discovery, in its own ``name = value`` format (one setting a line, between ``# BEGIN
RECORD`` and ``# END RECORD``), so flexhub writes the CHAP lines into the record file itself:
a new file (0600, same filesystem) renamed over the old one, then read back with
``iscsiadm -o show`` (which masks passwords) to check that open-iscsi sees them.

Where the files are: ``<root>/nodes/<iqn>/<address>,<port>,<tpgt>/<iface>`` (or the old
``<root>/nodes/<iqn>/<address>,<port>`` file) and ``<root>/send_targets/<address>,<port>/
st_config``; ``<root>`` is ``/etc/iscsi`` (Debian, Ubuntu, RHEL) or ``/var/lib/iscsi``.
The address, port and tpgt come from ``iscsiadm -o show`` of the record (so a host name
resolves as open-iscsi resolved it).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping
from functools import total_ordering
from pathlib import Path

from flexhub.backend import Frozen, VolumeError

__all__ = ["NodeRecord", "RecordFiles", "shown"]

_END = "# END RECORD"


def shown(text: str) -> dict[str, str]:
    """``iscsiadm -o show`` output as ``{name: value}`` (``<empty>`` is ``""``)."""
    values: dict[str, str] = {}
    for line in text.split("\n"):
        name, sep, value = line.partition(" = ")
        if sep and not name.startswith("#"):
            value = value.strip()
            values[name.strip()] = "" if value == "<empty>" else value
    return values


@total_ordering
class NodeRecord(Frozen):
    """One node record file: target, ``address,port,tpgt`` directory and iface."""

    __slots__ = ("iqn", "portal_dir", "iface")  # noqa: RUF023 - the fields, in order
    iqn: str
    portal_dir: str
    iface: str

    def __init__(self, iqn: str, portal_dir: str, iface: str) -> None:
        self._set(iqn=iqn, portal_dir=portal_dir, iface=iface)

    def __lt__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, NodeRecord)
        return (self.iqn, self.portal_dir, self.iface) < (other.iqn, other.portal_dir, other.iface)

    @property
    def portal(self) -> str:
        """``address:port,tpgt`` as ``iscsiadm -p`` takes it (IPv6 in brackets)."""
        address, port, tpgt = ([*self.portal_dir.split(","), "", ""])[:3]
        host = f"[{address}]" if ":" in address else address
        return f"{host}:{port},{tpgt}" if tpgt else f"{host}:{port}"


class RecordFiles:
    """open-iscsi's database directory (``/etc/iscsi`` unless told or absent)."""

    def __init__(self, root: Path | None = None) -> None:
        if root is None:
            root = Path("/etc/iscsi")
            if not (root / "nodes").is_dir() and Path("/var/lib/iscsi/nodes").is_dir():
                root = Path("/var/lib/iscsi")
        self.root = root

    # -- finding ------------------------------------------------------------------------------

    def node_file(self, iqn: str, iface: str, show: Mapping[str, str]) -> Path:
        """The file of the node record that ``iscsiadm -o show`` printed as ``show``."""
        address = show.get("node.conn[0].address", "")
        port = show.get("node.conn[0].port", "")
        tpgt = show.get("node.tpgt", "")
        _check_names(iqn, iface, address, port, tpgt)
        base = self.root / "nodes" / iqn
        candidates = [base / f"{address},{port},{tpgt}" / iface, base / f"{address},{port}"]
        for path in candidates:
            if address and port and path.is_file() and not path.is_symlink():
                return path
        raise VolumeError(
            f"iscsi: cannot find open-iscsi's record file of {iqn} on {address}:{port} "
            f"({iface}) under {self.root / 'nodes'}"
        )

    def discovery_file(self, show: Mapping[str, str]) -> Path:
        """The file of the SendTargets record that ``iscsiadm -o show`` printed."""
        address = show.get("discovery.sendtargets.address", "")
        port = show.get("discovery.sendtargets.port", "")
        _check_names(address, port)
        path = self.root / "send_targets" / f"{address},{port}" / "st_config"
        if not (address and port and path.is_file()) or path.is_symlink():
            raise VolumeError(
                f"iscsi: cannot find open-iscsi's discovery record of {address}:{port} "
                f"under {self.root / 'send_targets'}"
            )
        return path

    def node_records(self) -> set[NodeRecord]:
        """Every node record file now present (any target, portal and iface)."""
        found: set[NodeRecord] = set()
        nodes = self.root / "nodes"
        with contextlib.suppress(OSError):
            for target in os.scandir(nodes):
                if not target.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(OSError):
                    for portal in os.scandir(target.path):
                        if portal.is_file(follow_symlinks=False):
                            found.add(NodeRecord(target.name, portal.name, ""))
                        elif portal.is_dir(follow_symlinks=False):
                            for iface in os.listdir(portal.path):
                                found.add(NodeRecord(target.name, portal.name, iface))
        return found

    # -- writing ------------------------------------------------------------------------------

    def set_values(self, path: Path, values: Mapping[str, str]) -> None:
        """Set (or, with ``""``, remove) settings in a record file, atomically, 0600.

        The caller checked that no value holds a control character. The file is split at
        ``\n`` only, as open-iscsi reads it (``str.splitlines()`` would also break at
        U+2028, U+0085, a form feed, ... inside a value and turn its tail into a setting).
        """
        # The temporary file goes where open-iscsi never reads a record: a name without a
        # comma in the target's directory (node records) or in send_targets (discovery).
        nodes = self.root / "nodes"
        tmp_dir = path.parent if path.parent.parent == nodes else path.parent.parent
        try:
            text = path.read_bytes().decode("utf-8", "surrogateescape")
        except OSError as exc:
            raise VolumeError(f"iscsi: cannot read {path}: {exc.strerror}") from None
        lines = text.removesuffix("\n").split("\n") if text else []
        kept = [line for line in lines if line.partition("=")[0].strip() not in values]
        new = [f"{name} = {value}" for name, value in values.items() if value]
        end = next((i for i, line in enumerate(kept) if line.strip() == _END), len(kept))
        text = "\n".join([*kept[:end], *new, *kept[end:]]) + "\n"
        _replace(path, text, tmp_dir / f".flexhub-record-{os.getpid()}-{threading.get_ident()}")


def _check_names(*names: str) -> None:
    """Refuse a path component that could leave the record directory."""
    for name in names:
        if "/" in name or "\0" in name or name in (".", ".."):
            raise VolumeError(f"iscsi: {name!r} cannot name an open-iscsi record")


def _replace(path: Path, text: str, tmp: Path) -> None:
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, text.encode("utf-8", "surrogateescape"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise VolumeError(f"iscsi: cannot write {path}: {exc.strerror}") from None
