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
  releases the reservation. It is judged by reading the keys back (``--read-keys``), not by
  the commands' answers: the key gone is a release, the key still listed a failure.
* A PR OUT answered NOT READY is not retried: a Linux LIO target whose ``<dbroot>/pr`` is
  missing carries the command out and answers so (each repetition would move the PR
  generation); the error names that cause and its fix.
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

import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path

from flexhub.backend import CommandError, CommandRunner, Frozen, Result, VolumeError
from flexhub_iscsi._keys import (
    INITIATOR_FILE,
    MACHINE_ID,
    format_key,
    initiator_name,
    machine_id_problem,
    node_key,
    parse_key,
)
from flexhub_iscsi._preempt import (
    DEFAULT_TTL,
    MAX_TTL,
    Authorization,
    authorize_preempt,
    cancel_preempt,
    forget_preempt,
    parse_generation,
    pending_preempt,
    pending_preempts,
    preempt_refusal,
)

__all__ = [
    "DEFAULT_TTL",
    "INITIATOR_FILE",
    "MACHINE_ID",
    "MAX_TTL",
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
    "initiator_name",
    "machine_id_problem",
    "node_key",
    "parse_generation",
    "parse_key",
    "pending_preempt",
    "pending_preempts",
]

LOG = logging.getLogger(__name__)

#: Write Exclusive - Registrants Only.
PR_TYPE = 5
#: sg3_utils exit codes (sg3_utils(8)).
_SG_NOT_READY = 2
_SG_ILLEGAL_REQUEST = 5
_SG_UNIT_ATTENTION = 6
_SG_INVALID_OP = 9
_SG_RES_CONFLICT = 24
_UNSUPPORTED = (_SG_ILLEGAL_REQUEST, _SG_INVALID_OP)
#: Unit attentions (after a login, a preemption) are reported once per nexus: retry. Nothing
#: else is retried: a PR OUT answered NOT READY by LIO took effect all the same, and each
#: repetition would move the PR generation again.
_ATTEMPTS = 3
#: What a PR OUT answered NOT READY most likely means, and its fix (one line, in the error).
NOT_READY_HINT = (
    "the target answered NOT READY (not retried): a Linux LIO target does so when it cannot "
    "save its reservation state, most often because the directory <dbroot>/pr is missing; "
    'create it on the target (mkdir -p "$(cat /sys/kernel/config/target/dbroot)/pr")'
)
_KEY_LINE_RE = re.compile(r"^\s+(0x[0-9a-fA-F]+)\s*$", re.M)
_HOLDER_RE = re.compile(r"^\s*Key\s*=\s*(0x[0-9a-fA-F]+)", re.M)
_GENERATION_RE = re.compile(r"PR generation\s*=\s*(0x[0-9a-fA-F]+)")
#: An iSCSI TransportID in ``--read-full-status``: the initiator name, then ``,i,0x<ISID>``
#: (format 1) or nothing (format 0).
_TRANSPORT_RE = re.compile(r"iSCSI (?:world wide unique port id|name(?: and session id)?):\s*(\S+)")


class NoReservations(VolumeError):
    """The target does not implement persistent reservations."""


class FenceConflict(VolumeError):
    """Another node's key holds the LUN."""


# -- sg_persist ------------------------------------------------------------------------------


class Registration(Frozen):
    """One registration in ``--read-full-status``: its key, whether it holds the
    reservation, and the initiator name of its I_T nexus ("" when not shown)."""

    __slots__ = ("key", "holder", "initiator")  # noqa: RUF023 - the fields, in order
    key: int
    holder: bool
    initiator: str

    def __init__(self, key: int, holder: bool, initiator: str) -> None:
        self._set(key=key, holder=holder, initiator=initiator)


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
    initiators: Sequence[str]

    def __init__(
        self,
        runner: CommandRunner,
        timeout: float,
        key: int,
        devices: Sequence[str],
        initiators: Sequence[str] = (),
    ) -> None:
        self.runner = runner
        self.timeout = timeout
        self.key = key
        self.devices = devices
        self.initiators = initiators

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
            if result.returncode == _SG_NOT_READY and "--out" in args:
                detail = f"{NOT_READY_HINT} ({detail})"
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

    def registered_keys(self) -> list[int]:
        """Every key registered on the LUN (through any nexus), from the first path that
        answers ``--read-keys``.

        :raises VolumeError: no path answered.
        """
        problem = ""
        for device in self.devices:
            try:
                out = self._sg(device, ["--in", "--read-keys"], "read the registered keys")
            except _SgError as exc:
                problem = exc.message
                continue
            if _GENERATION_RE.search(out.stdout) is None:
                problem = (
                    f"cannot read the registered keys of {device}: sg_persist printed "
                    f"{' '.join(out.stdout.split())[:200]!r}"
                )
                continue
            return [int(k, 16) for k in _KEY_LINE_RE.findall(out.stdout)]
        raise VolumeError(f"iscsi: {problem or 'no path to read the registered keys from'}")

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
        """REGISTER AND IGNORE EXISTING KEY on every path (unregistering: :meth:`_unregister`)."""
        for device in self.devices:
            try:
                self._sg(
                    device,
                    ["--out", "--register-ignore", f"--param-sark={sark:#x}"],
                    "register the reservation key",
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
            refusal = preempt_refusal(grant, holder, generation, time.time())
            if refusal:
                if grant is not None and grant.key == holder:
                    forget_preempt(state_dir, volume_id, refusal)  # void: expired or stale
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
            forget_preempt(state_dir, volume_id, "used")
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

        :raises VolumeError: the target still lists the key (see :meth:`_unregister`).
        """
        self._unregister()
        LOG.info("iscsi: %s: released key %s", volume_id, format_key(self.key))

    def _unregister(self) -> None:
        """Unregister this node's key on every path, judged by reading the keys back: LIO
        without ``<dbroot>/pr`` answers NOT READY to an unregistration it did carry out, and a
        target may answer success to one that left the key registered.

        :raises VolumeError: the key is still registered (through a path that is gone, or
            the target did not apply it), or nothing could be unregistered nor read back.
        """
        failures: list[str] = []
        for device in self.devices:
            try:
                self._sg(
                    device,
                    ["--out", "--register-ignore", "--param-sark=0x0"],
                    "unregister the reservation key",
                )
            except _SgError as exc:
                failures.append(exc.message)
        try:
            keys = self.registered_keys()
        except VolumeError as exc:
            if failures:
                raise VolumeError(f"iscsi: {failures[0]}") from None
            LOG.warning(
                "iscsi: key %s unregistered, but the keys could not be read back: %s",
                format_key(self.key),
                exc,
            )
            return
        if self.key in keys:
            answered = failures[0] if failures else "the target answered success"
            raise VolumeError(
                f"iscsi: key {format_key(self.key)} is still registered after unregistering "
                f"it on {len(self.devices)} path(s) ({answered}): a path that is gone still "
                "holds it, or the target did not apply the unregistration"
            )
        if failures:
            LOG.warning(
                "iscsi: unregistering key %s answered an error, but the target no longer lists "
                "it: unregistered (%s)",
                format_key(self.key),
                failures[0],
            )

    def _unregister_quietly(self) -> None:
        try:
            self._unregister()
        except VolumeError as exc:
            LOG.warning("iscsi: could not unregister key %s: %s", format_key(self.key), exc)


class _SgError(Exception):
    def __init__(self, returncode: int, message: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.message = message
