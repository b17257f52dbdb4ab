"""Fencing of iSCSI LUNs with SCSI-3 persistent reservations (``sg_persist``).

flexhub answers ``init`` with ``attach: false``, so Kubernetes' Multi-Attach check never runs
for its volumes: flexhub keeps two nodes from writing one LUN itself.

* Every node has a **reservation key**: ``[iscsi] reservation_key`` of the node config, or
  else 8 bytes of ``sha256("flexhub", /etc/machine-id, the node's initiator name from
  /etc/iscsi/initiatorname.iscsi, realpath(state_dir))``. Two flexhub installations on one
  machine (two state directories) therefore have two keys, and so do two machines cloned
  from one image once their initiator names differ. A machine id that tells no machine apart
  (empty, systemd's ``uninitialized``, all zeros) derives no key: set ``reservation_key``.
* A **read-write** attach registers the key on every path (each I_T nexus) of the LUN and
  takes a *Write Exclusive - Registrants Only* (type 5) reservation. Only registered nexuses
  may write; flexhub registers a node only after it saw no other key holding the LUN, and
  read-only users never register, so in practice only the holder's node writes, through all
  of its paths (multipath keeps working), and every other node can still read.
* Whatever stops an acquire after it registered (a refusal, a failed or hung command, an
  interrupt) unregisters the key again, unless that key already held the LUN before (another
  staged mount of it). The connector journals the key (``record_progress(reservation=...)``)
  before registering, so an attach killed there is undone by ``release`` with its key.
* After reserving, the holder is read back with ``--read-full-status``: the reservation must
  be held by this node's key *through one of this node's initiators*. The same key held
  through another initiator is another machine deriving the same key (a cloned machine id):
  the attach unregisters and fails, naming both initiators.
* A read-write attach that finds the LUN reserved by another key fails with a one-line
  message naming the holder's key, the reservation's generation and the way to release it.
* The last release on the node (``detach``) unregisters the key on every path, which also
  releases the reservation.
* A holder that died: ``flexhub fence preempt --volume iscsi:<iqn>:<lun> --key <holder>
  --generation <G>`` on the node that should take over writes a one-shot authorization under
  ``<state_dir>/fence/`` (0600, no secret in it). It is bound to the **PR generation** (the
  target's counter of registration changes, shown by ``sg_persist --read-keys`` and in the
  refused mount's message; read from the LUN itself when this node has a path to it) and
  **expires** (15 minutes unless ``--ttl``). The next read-write attach of that LUN on that
  node that finds exactly that key holding it at exactly that generation preempts it (the
  old holder's registrations are removed, so it can no longer write even if it comes back)
  and deletes the authorization once it verified that it holds the LUN. An expired one, or
  one whose generation has moved on (the holder registered again: it is alive), is refused
  and deleted. Never automatic.
  ``flexhub fence list`` shows the pending ones, ``flexhub fence cancel`` removes them.
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
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flexhub.backend import CommandError, CommandRunner, FlexhubError, Result, VolumeError

__all__ = [
    "DEFAULT_TTL",
    "PR_TYPE",
    "Authorization",
    "Fence",
    "FenceConflict",
    "NoReservations",
    "Registration",
    "authorize_preempt",
    "cancel_preempt",
    "foreign_registrations",
    "format_key",
    "machine_id_problem",
    "node_key",
    "parse_key",
    "pending_preempt",
    "pending_preempts",
]

LOG = logging.getLogger(__name__)

#: Write Exclusive - Registrants Only.
PR_TYPE = 5
MACHINE_ID = Path("/etc/machine-id")
#: open-iscsi's default initiator name (``InitiatorName=...``).
INITIATOR_FILE = Path("/etc/iscsi/initiatorname.iscsi")
#: How long a ``fence preempt`` authorization lasts unless told (seconds), and at most.
DEFAULT_TTL = 15 * 60
MAX_TTL = 24 * 3600
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
_GENERATION_RE = re.compile(r"PR generation\s*=\s*(0x[0-9a-fA-F]+)")
#: An iSCSI TransportID in ``--read-full-status``: the initiator name, then ``,i,0x<ISID>``
#: (format 1) or nothing (format 0).
_TRANSPORT_RE = re.compile(r"iSCSI (?:world wide unique port id|name(?: and session id)?):\s*(\S+)")
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


#: ``/etc/machine-id`` values that tell no machine apart: systemd's placeholder of an image
#: prepared for its first boot, and an id of zeros; an empty file is refused as well.
_PLACEHOLDER_IDS = frozenset({"uninitialized", "0" * 32})


def machine_id_problem(machine_id: Path = MACHINE_ID) -> str:
    """Why ``machine_id`` cannot tell this machine apart from its clones ("" when it can)."""
    try:
        ident = machine_id.read_text("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot read {machine_id} ({exc})"
    if not ident:
        return f"{machine_id} is empty"
    if ident.lower() in _PLACEHOLDER_IDS:
        return f"{machine_id} is {ident!r}, the placeholder of an image not yet booted"
    return ""


def initiator_name(path: Path = INITIATOR_FILE) -> str:
    """The node's default iSCSI initiator name (``InitiatorName=`` of ``path``; "" if none)."""
    try:
        text = path.read_text("utf-8", "replace")
    except OSError:
        return ""
    for line in text.split("\n"):
        name, sep, value = line.strip().partition("=")
        if sep and name.strip() == "InitiatorName":
            return value.strip()
    return ""


def node_key(
    state_dir: Path,
    override: str = "",
    machine_id: Path = MACHINE_ID,
    initiator_file: Path = INITIATOR_FILE,
) -> int:
    """This node's reservation key: ``override`` if set, else derived from the machine id,
    the node's initiator name and the state directory (stable across reboots, different for
    two installations, and for clones of one image once their initiator names differ).

    :raises FlexhubError: the override is invalid, or the machine id cannot tell this
        machine apart (unreadable, empty, a placeholder).
    """
    if override:
        return parse_key(override)
    problem = machine_id_problem(machine_id)
    if problem:
        raise FlexhubError(
            f"{problem}: it cannot derive a reservation key of this node; "
            "set [iscsi] reservation_key in the node config"
        )
    ident = machine_id.read_text("ascii").strip()
    initiator = initiator_name(initiator_file)
    seed = f"flexhub\0{ident}\0{initiator}\0{os.path.realpath(state_dir)}".encode()
    key = int.from_bytes(hashlib.sha256(seed).digest()[:8], "big")
    return key or 1


# -- the operator's one-shot preemption --------------------------------------------------------


@dataclass(frozen=True)
class Authorization:
    """An operator's permission for this node to preempt ``key`` on ``volume`` once, while
    the reservation is still at ``generation`` and before ``expires`` (a Unix time)."""

    volume: str
    key: int
    generation: int
    granted: float
    expires: float

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires

    def to_json(self) -> dict[str, object]:
        return {
            "volume": self.volume,
            "key": format_key(self.key),
            "generation": f"{self.generation:#x}",
            "granted": self.granted,
            "expires": self.expires,
        }

    @classmethod
    def from_json(cls, data: object) -> Authorization:
        """:raises ValueError: not an authorization record."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        try:
            return cls(
                volume=str(data["volume"]),
                key=parse_key(str(data["key"])),
                generation=parse_generation(str(data["generation"])),
                granted=float(data["granted"]),
                expires=float(data["expires"]),
            )
        except (KeyError, TypeError, FlexhubError) as exc:
            raise ValueError(f"not an authorization record ({exc})") from None


def parse_generation(text: str) -> int:
    """A PR generation as ``sg_persist`` prints it (``0x1c``) or as a decimal number.

    :raises FlexhubError: it is not one.
    """
    value = text.strip().lower()
    try:
        number = int(value, 16) if value.startswith("0x") else int(value, 10)
    except ValueError:
        number = -1
    if not 0 <= number < 2**32:
        raise FlexhubError(f"PR generation {text!r} is not a number from 0 to 0xffffffff")
    return number


def _preempt_dir(state_dir: Path) -> Path:
    return Path(state_dir) / _PREEMPT_DIR


def _preempt_file(state_dir: Path, volume_id: str) -> Path:
    digest = hashlib.sha256(volume_id.encode()).hexdigest()[:32]
    return _preempt_dir(state_dir) / digest


def authorize_preempt(
    state_dir: Path,
    volume_id: str,
    key: int,
    generation: int,
    ttl: float = DEFAULT_TTL,
    now: float | None = None,
) -> Authorization:
    """Let the next read-write attach of ``volume_id`` on this node preempt ``key``, while
    the reservation is at ``generation`` and for ``ttl`` seconds; replaces an earlier one."""
    granted = time.time() if now is None else now
    grant = Authorization(volume_id, key, generation, granted, granted + ttl)
    path = _preempt_file(state_dir, volume_id)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, flags, 0o600)
        try:
            os.write(fd, (json.dumps(grant.to_json(), sort_keys=True) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise FlexhubError(
            f"cannot record the permission in {path.parent}: {exc.strerror}"
        ) from None
    return grant


def _read_grant(path: Path) -> Authorization | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as handle:
            return Authorization.from_json(json.loads(handle.read(64 * 1024)))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        LOG.warning("iscsi: ignoring the unreadable preemption record %s: %s", path, exc)
        return None


def pending_preempt(state_dir: Path, volume_id: str) -> Authorization | None:
    """The operator's permission to preempt a key of ``volume_id`` here, expired or not."""
    grant = _read_grant(_preempt_file(state_dir, volume_id))
    return grant if grant is not None and grant.volume == volume_id else None


def pending_preempts(state_dir: Path) -> list[Authorization]:
    """Every permission recorded on this node (expired ones too), by volume."""
    try:
        names = sorted(os.listdir(_preempt_dir(state_dir)))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise FlexhubError(f"cannot read {_preempt_dir(state_dir)}: {exc.strerror}") from None
    found = []
    for name in names:
        if name.startswith("."):
            continue
        grant = _read_grant(_preempt_dir(state_dir) / name)
        if grant is not None and _preempt_file(state_dir, grant.volume).name == name:
            found.append(grant)
    return sorted(found, key=lambda g: g.volume)


def cancel_preempt(state_dir: Path, volume_id: str) -> Authorization | None:
    """Remove the permission of ``volume_id``; returns what it was (``None``: there was none)."""
    grant = pending_preempt(state_dir, volume_id)
    _consume_preempt(state_dir, volume_id)
    return grant


def _consume_preempt(state_dir: Path, volume_id: str) -> None:
    path = _preempt_file(state_dir, volume_id)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise FlexhubError(f"cannot remove the permission {path}: {exc.strerror}") from None


def _forget_preempt(state_dir: Path, volume_id: str, why: str) -> None:
    """Delete a permission that is used up or void; one that cannot be deleted stays void
    anyway (the preemption, or the change it missed, moved the generation on)."""
    try:
        _consume_preempt(state_dir, volume_id)
    except FlexhubError as exc:
        LOG.error("iscsi: %s: the preemption permission (%s) stays: %s", volume_id, why, exc)
    else:
        LOG.warning("iscsi: %s: preemption permission deleted (%s)", volume_id, why)


def _when(moment: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(moment))


def _refusal(grant: Authorization | None, holder: int, generation: int, now: float) -> str:
    """Why ``grant`` does not allow preempting ``holder`` at ``generation`` ("" if it does)."""
    if grant is None:
        return "no preemption allowed on this node"
    if grant.key != holder:
        return f"the preemption allowed on this node is for key {format_key(grant.key)}"
    if grant.expired(now):
        return (
            f"the preemption of key {format_key(holder)} allowed on this node expired at "
            f"{_when(grant.expires)}"
        )
    if grant.generation != generation:
        return (
            f"the reservation changed since the preemption was allowed (PR generation "
            f"{grant.generation:#x} then, {generation:#x} now: the holder registered again, "
            "so it may be alive)"
        )
    return ""


# -- sg_persist ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Registration:
    """One registration in ``--read-full-status``: its key, whether it holds the
    reservation, and the initiator name of its I_T nexus ("" when not shown)."""

    key: int
    holder: bool
    initiator: str


def parse_full_status(text: str) -> tuple[int | None, list[Registration]]:
    """``sg_persist --read-full-status`` output as (generation, registrations)."""
    found = _GENERATION_RE.search(text)
    generation = int(found.group(1), 16) if found else None
    registrations: list[Registration] = []
    block: list[str] = []
    for line in [*text.split("\n"), "    Key=0x0"]:  # a sentinel ends the last block
        if re.match(r"^\s*Key\s*=", line):
            if block:
                key = _HOLDER_RE.search(block[0])
                transport = _TRANSPORT_RE.search("\n".join(block))
                if key is not None:
                    registrations.append(
                        Registration(
                            int(key.group(1), 16),
                            any("<< Reservation holder >>" in b for b in block),
                            transport.group(1).partition(",i,")[0] if transport else "",
                        )
                    )
            block = [line]
        elif block:
            block.append(line)
    return generation, registrations


def foreign_registrations(
    registrations: Sequence[Registration], key: int, initiators: Sequence[str]
) -> list[Registration]:
    """The registrations of ``key`` through an initiator that is none of ``initiators``:
    another machine that derives (or was given) the same key."""
    return [r for r in registrations if r.key == key and r.initiator not in ("", *initiators)]


@dataclass
class Fence:
    """Persistent-reservation commands on the SCSI disks (paths) of one LUN.

    :param devices: the ``/dev/sdX`` of every path; PR is per I_T nexus, so registration is
        done on each (a multipath map's device would send it down one path only).
    :param initiators: the initiator names of this mount's sessions to the LUN: the
        reservation is this node's only when held through one of them (empty: not checked).
    """

    runner: CommandRunner
    timeout: float
    key: int
    devices: Sequence[str]
    initiators: Sequence[str] = field(default=())

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

    def reservation(self, device: str | None = None) -> tuple[int | None, int]:
        """(the key holding the reservation or ``None``, the PR generation).

        :raises NoReservations: the target answers PR IN with an illegal request.
        """
        device = device or self.devices[0]
        try:
            out = self._sg(device, ["--in", "--read-reservation"], "read the reservation")
        except _SgError as exc:
            if exc.returncode in _UNSUPPORTED:
                raise NoReservations(exc.message) from None
            raise VolumeError(f"iscsi: {exc.message}") from None
        generation = _GENERATION_RE.search(out.stdout)
        found = _HOLDER_RE.search(out.stdout)
        if generation is None or (found is None and "NO reservation held" not in out.stdout):
            raise VolumeError(
                f"iscsi: cannot read the reservation of {device}: sg_persist printed "
                f"{' '.join(out.stdout.split())[:200]!r}"
            )
        return (int(found.group(1), 16) if found else None), int(generation.group(1), 16)

    def holder(self, device: str | None = None) -> int | None:
        """The key holding the reservation (``None``: no reservation)."""
        return self.reservation(device)[0]

    def full_status(self) -> list[Registration] | None:
        """Every registration with its nexus's initiator (``None``: the target does not
        answer READ FULL STATUS, an optional command)."""
        device = self.devices[0]
        try:
            out = self._sg(device, ["--in", "--read-full-status"], "read the full status")
        except _SgError as exc:
            if exc.returncode in _UNSUPPORTED:
                return None
            raise VolumeError(f"iscsi: {exc.message}") from None
        return parse_full_status(out.stdout)[1]

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
        :raises FenceConflict: another key holds the LUN (and no valid operator preemption
            for it: the authorization must name that key, be unexpired and be bound to the
            reservation's current generation), or this node's key holds it through another
            machine's initiator.
        """
        holder, generation = self.reservation()
        preempting = holder is not None and holder != self.key
        if holder is not None and holder != self.key:
            grant = pending_preempt(state_dir, volume_id)
            refusal = _refusal(grant, holder, generation, time.time())
            if refusal:
                if grant is not None and grant.key == holder:
                    _forget_preempt(state_dir, volume_id, refusal)  # void: expired or stale
                raise self._conflict(volume_id, holder, generation, refusal)
        try:
            self._register(self.key)
            if holder is not None and holder != self.key:
                self._preempt(holder)
            elif holder is None:
                self._reserve()
            self._verify_holder(volume_id)
        except BaseException:
            # Whatever stops it (a refusal, a command that fails or hangs, an interrupt),
            # this node's key does not stay registered: it would hold, or may write, the LUN
            # with nobody knowing. A key that already held the LUN before this call (another
            # staged mount of it) is left as it was, unless _verify_holder refused it.
            if holder != self.key:
                self._unregister_quietly()
            raise
        if preempting:
            # Consumed only once this node is verified to hold the LUN: a preemption that
            # fails leaves the operator's permission (void anyway if the generation moved).
            _forget_preempt(state_dir, volume_id, "used")
            LOG.warning(
                "iscsi: %s: preempted the reservation of key %s (PR generation %#x) as the "
                "operator allowed; this node (key %s) holds it now",
                volume_id,
                format_key(holder or 0),
                generation,
                format_key(self.key),
            )
        LOG.info("iscsi: %s is reserved for this node (key %s)", volume_id, format_key(self.key))

    def _reserve(self) -> None:
        """RESERVE (type 5) through the first path; a conflict is left to ``_verify_holder``
        (another nexus of this node, or another node, may hold it)."""
        try:
            self._sg(
                self.devices[0],
                ["--out", "--reserve", f"--param-rk={self.key:#x}", f"--prout-type={PR_TYPE}"],
                "reserve the LUN",
            )
        except _SgError as exc:
            if exc.returncode != _SG_RES_CONFLICT:
                raise VolumeError(f"iscsi: {exc.message}") from None

    def _verify_holder(self, volume_id: str) -> None:
        """The reservation must now be this node's key, held through this node's initiator;
        else unregister this node's paths and fail."""
        registrations = self.full_status()
        if registrations is None:  # no READ FULL STATUS: the key alone
            now, generation = self.reservation()
            holders = [Registration(now, True, "")] if now is not None else []
        else:
            generation = None
            holders = [r for r in registrations if r.holder]
        if not holders:
            self._unregister_quietly()
            raise VolumeError(
                f"iscsi: {volume_id}: the reservation of key {format_key(self.key)} "
                "did not hold (nobody holds the LUN): retry"
            )
        held = holders[0]
        if held.key != self.key:
            self._unregister_quietly()
            if generation is None:
                generation = self.reservation()[1]
            raise self._conflict(volume_id, held.key, generation, "")
        if self.initiators and held.initiator and held.initiator not in self.initiators:
            self._unregister_quietly()
            raise FenceConflict(
                f"iscsi: {volume_id} is reserved by this node's key {format_key(self.key)} "
                f"through initiator {held.initiator}, which is not this node's "
                f"({', '.join(sorted(set(self.initiators)))}): another machine derives the "
                "same key (a machine cloned with its /etc/machine-id and initiator name?), or "
                "this node holds it through another initiator name; read-write mount "
                "refused: give each node its own initiator name or [iscsi] reservation_key"
            )

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
            raise VolumeError(f"iscsi: {exc.message}") from None

    def _conflict(
        self, volume_id: str, holder: int, generation: int, refusal: str
    ) -> FenceConflict:
        why = f" ({refusal})" if refusal and not refusal.startswith("no preemption") else ""
        return FenceConflict(
            f"iscsi: {volume_id} is reserved for writing by key {format_key(holder)} "
            f"(another node; this node is {format_key(self.key)}; PR generation "
            f"{generation:#x}){why}: unmount it there, or if that node is dead run "
            f"'flexhub fence preempt --volume {volume_id} --key {format_key(holder)} "
            f"--generation {generation:#x}' on this node"
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
