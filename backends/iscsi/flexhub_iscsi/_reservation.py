"""Fencing of iSCSI LUNs with SCSI-3 persistent reservations (``sg_persist``).

flexhub answers ``init`` with ``attach: false``, so Kubernetes' Multi-Attach check never runs
for its volumes: flexhub keeps two nodes from writing one LUN itself.

* Every node has a **reservation key**: ``[iscsi] reservation_key`` of the node config, or
  else 8 bytes of ``sha256("flexhub", /etc/machine-id, realpath(state_dir))``. Two flexhub
  installations on one machine (two state directories) therefore have two keys.
* A **read-write** attach registers the key on every path (each I_T nexus) of the LUN and
  takes a *Write Exclusive - Registrants Only* (type 5) reservation. Only registered nexuses
  may write; flexhub registers a node only after it saw no other key holding the LUN, and
  read-only users never register, so in practice only the holder's node writes, through all
  of its paths (multipath keeps working), and every other node can still read.
* A read-write attach that finds the LUN reserved by another key fails with a one-line
  message naming the holder's key and the way to release it.
* The last release on the node (``detach``) unregisters the key on every path, which also
  releases the reservation.
* A holder that died: ``flexhub fence preempt --volume iscsi:<iqn>:<lun> --key <holder>``
  on the node that should take over writes a one-shot authorization under
  ``<state_dir>/fence/``; the next read-write attach of that LUN on that node that finds
  exactly that key holding it preempts it (the old holder's registrations are removed, so it
  can no longer write even if it comes back) and deletes the authorization. Never automatic.
* A target without persistent reservations (PR IN answered with an illegal request):
  read-write attaches are refused unless the PV sets ``fencing: "none"``.

``sg_persist`` runs through the node's runner, bounded, never through a shell.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flexhub.backend import CommandError, CommandRunner, FlexhubError, Result, VolumeError

__all__ = [
    "PR_TYPE",
    "Fence",
    "FenceConflict",
    "NoReservations",
    "authorize_preempt",
    "format_key",
    "node_key",
    "parse_key",
    "pending_preempt",
]

LOG = logging.getLogger(__name__)

#: Write Exclusive - Registrants Only.
PR_TYPE = 5
MACHINE_ID = Path("/etc/machine-id")
#: sg3_utils exit codes (sg3_utils(8)).
_SG_NOT_READY = 2
_SG_ILLEGAL_REQUEST = 5
_SG_UNIT_ATTENTION = 6
_SG_INVALID_OP = 9
_SG_RES_CONFLICT = 24
_UNSUPPORTED = (_SG_ILLEGAL_REQUEST, _SG_INVALID_OP)
#: Unit attentions (after a login, a preemption) are reported once per nexus: retry.
_ATTEMPTS = 3
_KEY_RE = re.compile(r"^(0x)?[0-9a-fA-F]{1,16}$")
_HOLDER_RE = re.compile(r"^\s*Key\s*=\s*(0x[0-9a-fA-F]+)", re.M)
_PREEMPT_DIR = "fence"


class NoReservations(VolumeError):
    """The target does not implement persistent reservations."""


class FenceConflict(VolumeError):
    """Another node's key holds the LUN."""


def parse_key(text: str) -> int:
    """A reservation key written as hex (``0x`` optional, 1-16 digits, not zero).

    :raises FlexhubError: it is not one.
    """
    value = text.strip()
    if not _KEY_RE.fullmatch(value) or int(value, 16) == 0:
        raise FlexhubError(
            f"reservation key {text!r} is not 1 to 16 hex digits (0x optional), or is zero"
        )
    return int(value, 16)


def format_key(key: int) -> str:
    return f"0x{key:016x}"


def node_key(state_dir: Path, override: str = "", machine_id: Path = MACHINE_ID) -> int:
    """This node's reservation key: ``override`` if set, else derived from the machine id
    and the state directory (stable across reboots, different for two installations).

    :raises FlexhubError: the override is invalid, or there is no machine id to derive from.
    """
    if override:
        return parse_key(override)
    try:
        ident = machine_id.read_text("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise FlexhubError(
            f"cannot read {machine_id} to derive the node's reservation key ({exc}): "
            "set [iscsi] reservation_key in the node config"
        ) from None
    if not ident:
        raise FlexhubError(f"{machine_id} is empty: set [iscsi] reservation_key in the node config")
    seed = f"flexhub\0{ident}\0{os.path.realpath(state_dir)}".encode()
    key = int.from_bytes(hashlib.sha256(seed).digest()[:8], "big")
    return key or 1


# -- the operator's one-shot preemption --------------------------------------------------------


def _preempt_file(state_dir: Path, volume_id: str) -> Path:
    digest = hashlib.sha256(volume_id.encode()).hexdigest()[:32]
    return Path(state_dir) / _PREEMPT_DIR / digest


def authorize_preempt(state_dir: Path, volume_id: str, key: int) -> Path:
    """Let the next read-write attach of ``volume_id`` on this node preempt ``key``."""
    path = _preempt_file(state_dir, volume_id)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"volume": volume_id, "key": format_key(key)}) + "\n")
    os.replace(tmp, path)
    return path


def pending_preempt(state_dir: Path, volume_id: str) -> int | None:
    """The key an operator allowed this node to preempt for ``volume_id``, if any."""
    path = _preempt_file(state_dir, volume_id)
    try:
        data = json.loads(path.read_text())
        if data.get("volume") != volume_id:
            return None
        return parse_key(str(data.get("key", "")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError, FlexhubError) as exc:
        LOG.warning("iscsi: ignoring the unreadable preemption record %s: %s", path, exc)
        return None


def _consume_preempt(state_dir: Path, volume_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _preempt_file(state_dir, volume_id).unlink()


# -- sg_persist ------------------------------------------------------------------------------


@dataclass
class Fence:
    """Persistent-reservation commands on the SCSI disks (paths) of one LUN.

    :param devices: the ``/dev/sdX`` of every path; PR is per I_T nexus, so registration is
        done on each (a multipath map's device would send it down one path only).
    """

    runner: CommandRunner
    timeout: float
    key: int
    devices: Sequence[str]

    def _sg(self, device: str, args: Sequence[str], what: str, ok: Sequence[int] = (0,)) -> Result:
        argv = ["sg_persist", "--no-inquiry", *args, device]
        result: Result | None = None
        for _ in range(_ATTEMPTS):
            try:
                result = self.runner(argv, timeout=self.timeout, check=False)
            except CommandError as exc:
                hint = " (install sg3-utils)" if "could not start" in exc.message else ""
                raise VolumeError(
                    f"iscsi: cannot {what} on {device}: {exc.message}{hint}"
                ) from None
            if result.returncode != _SG_UNIT_ATTENTION:
                break
        assert result is not None
        if result.returncode not in ok:
            detail = " ".join((result.stderr or result.stdout).split())[:200]
            raise _SgError(result.returncode, f"cannot {what} on {device}: {detail}")
        return result

    def holder(self, device: str | None = None) -> int | None:
        """The key holding the reservation (``None``: no reservation).

        :raises NoReservations: the target answers PR IN with an illegal request.
        """
        device = device or self.devices[0]
        try:
            out = self._sg(device, ["--in", "--read-reservation"], "read the reservation")
        except _SgError as exc:
            if exc.returncode in _UNSUPPORTED:
                raise NoReservations(exc.message) from None
            raise VolumeError(f"iscsi: {exc.message}") from None
        if "NO reservation held" in out.stdout:
            return None
        found = _HOLDER_RE.search(out.stdout)
        if found is None:
            raise VolumeError(
                f"iscsi: cannot read the reservation of {device}: sg_persist printed "
                f"{' '.join(out.stdout.split())[:200]!r}"
            )
        return int(found.group(1), 16)

    def _register(self, sark: int) -> None:
        """REGISTER AND IGNORE EXISTING KEY on every path (``sark`` 0: unregister)."""
        for device in self.devices:
            try:
                self._sg(
                    device,
                    ["--out", "--register-ignore", f"--param-sark={sark:#x}"],
                    "register the reservation key" if sark else "unregister the reservation key",
                )
            except _SgError as exc:
                raise VolumeError(f"iscsi: {exc.message}") from None

    def acquire(self, volume_id: str, state_dir: Path) -> None:
        """Register on every path and hold the LUN for writing (type 5), or fail.

        :raises NoReservations: the target has no persistent reservations.
        :raises FenceConflict: another key holds the LUN (no operator preemption for it).
        """
        holder = self.holder()
        if holder is not None and holder != self.key:
            allowed = pending_preempt(state_dir, volume_id)
            if allowed != holder:
                raise self._conflict(volume_id, holder, allowed)
            self._register(self.key)
            self._preempt(holder)
            _consume_preempt(state_dir, volume_id)
            LOG.warning(
                "iscsi: %s: preempted the reservation of key %s as the operator allowed; "
                "this node (key %s) holds it now",
                volume_id,
                format_key(holder),
                format_key(self.key),
            )
        else:
            self._register(self.key)
        if holder is None:
            try:
                self._sg(
                    self.devices[0],
                    ["--out", "--reserve", f"--param-rk={self.key:#x}", f"--prout-type={PR_TYPE}"],
                    "reserve the LUN",
                )
            except _SgError as exc:
                if exc.returncode != _SG_RES_CONFLICT:
                    self._unregister_quietly()
                    raise VolumeError(f"iscsi: {exc.message}") from None
        now = self.holder()
        if now != self.key:
            self._unregister_quietly()
            if now is None:
                raise VolumeError(
                    f"iscsi: {volume_id}: the reservation of key {format_key(self.key)} "
                    "did not hold (nobody holds the LUN): retry"
                )
            raise self._conflict(volume_id, now, None)
        LOG.info("iscsi: %s is reserved for this node (key %s)", volume_id, format_key(self.key))

    def _preempt(self, holder: int) -> None:
        try:
            self._sg(
                self.devices[0],
                [
                    "--out",
                    "--preempt",
                    f"--param-rk={self.key:#x}",
                    f"--param-sark={holder:#x}",
                    f"--prout-type={PR_TYPE}",
                ],
                f"preempt key {format_key(holder)}",
            )
        except _SgError as exc:
            self._unregister_quietly()
            raise VolumeError(f"iscsi: {exc.message}") from None

    def _conflict(self, volume_id: str, holder: int, allowed: int | None) -> FenceConflict:
        stale = (
            f" (the preemption allowed on this node is for key {format_key(allowed)})"
            if allowed is not None
            else ""
        )
        return FenceConflict(
            f"iscsi: {volume_id} is reserved for writing by key {format_key(holder)} "
            f"(another node; this node is {format_key(self.key)}){stale}: unmount it there, "
            f"or if that node is dead run 'flexhub fence preempt --volume {volume_id} "
            f"--key {format_key(holder)}' on this node"
        )

    def release(self, volume_id: str) -> None:
        """Unregister this node's key on every path; that also ends its reservation.

        :raises VolumeError: a path refused (the caller decides whether that is fatal).
        """
        self._register(0)
        if self.holder() == self.key:
            # The holding nexus is not among the paths left (one that is gone): only the
            # target (or a preemption by another node) can end it now.
            LOG.warning(
                "iscsi: %s stays reserved by this node's key %s through a path that is gone",
                volume_id,
                format_key(self.key),
            )
        else:
            LOG.info("iscsi: %s: released key %s", volume_id, format_key(self.key))

    def _unregister_quietly(self) -> None:
        try:
            self._register(0)
        except VolumeError as exc:
            LOG.warning("iscsi: could not unregister key %s: %s", format_key(self.key), exc)


class _SgError(Exception):
    def __init__(self, returncode: int, message: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.message = message
