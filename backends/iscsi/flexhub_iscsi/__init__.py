"""The ``iscsi`` backend: a LUN of an iSCSI target, through open-iscsi (and multipath).

Options follow the in-tree Kubernetes iSCSI plugin, so existing PVs translate directly::

    options: {backend: iscsi, targetPortal: "10.0.0.5", portals: "10.0.1.5:3260",
              iqn: "iqn.2001-05.com.example:storage.db", lun: "0",
              chapAuthSession: "true"}

CHAP credentials come from the PV's ``secretRef`` under the in-tree key names
(``node.session.auth.username``, ``discovery.sendtargets.auth.password``, ...).

Life cycle (the core holds the volume lock, formats safely, stages, binds and counts pods):

* :meth:`IscsiBackend.attach`: per portal, SendTargets discovery (with discovery CHAP when
  asked; the node records it made for anything else are deleted), the node record set to
  ``node.startup=manual`` and ``node.session.scan=manual`` (plus session CHAP) and a login (a
  subset may fail when one path works; an existing session is reused); then a scan of the
  one requested LUN on every session, a bounded wait for its disks in sysfs (udev not
  needed), and the multipath map when there are several paths and multipathd runs (else the
  first path).
* :meth:`IscsiBackend.detach`: flush (and remove) the multipath map and flush the LUN's SCSI
  disks, then unregister the node's key (ending its reservation), then delete the disks; log
  out and delete the target's node records only when no other LUN of the target is still in
  use on the node (live disks in the target's sessions, and flexhub's journal of staged
  volumes); finally delete the dedicated iface flexhub made for ``initiatorName`` when
  nothing uses it any more.
* :meth:`IscsiBackend.expand`: rescan the LUN's disks (and resize the multipath map), then
  check that the device reached the new size.

Secrets: CHAP values never reach a command line: they are written into open-iscsi's record
files (:mod:`flexhub_iscsi._records`), checked first (:mod:`flexhub_iscsi._chap`), and
scrubbed from every message built from iscsiadm's output; attachment details (journaled)
never hold one. open-iscsi keeps the session credentials in its node record (root-only), as
it must to log in again after a reconnect; discovery credentials are wiped after discovery.

Sharing: :meth:`IscsiBackend.access` is the volume's connection identity (the core shares a
staged LUN only with the same); a volume of another LUN reuses the target's session only
with the same iface and session CHAP as the staged volumes using it.

Locks: an attach holds the target's *use* lock shared (attaches of a target run side by side,
each portal on its own thread; SendTargets discoveries of the node take turns under one
lock, which also covers the discovery record);
a release takes the target lock and logs out only if it can take the use lock exclusively at
once, so an unmount never waits for a mount in flight. The target's *owner* lock covers an
attach's check of who owns the sessions (and its taking of the use lock), and a detach from
the deletion of its disks through its logout decision: a volume being detached owns the
session until it logged out, and an attach of another identity never slips in between.

Layout: this module is the connector (:class:`IscsiBackend`: check, attach, detach, release,
expand); its helpers are private modules beside it, each one job, mixed into the class:
:mod:`~flexhub_iscsi._sessions` (who owns a target's sessions, their locks, login, logout),
:mod:`~flexhub_iscsi._discovery` (SendTargets discovery, node records),
:mod:`~flexhub_iscsi._ifaces` (ifaces, the dedicated one of ``initiatorName``),
:mod:`~flexhub_iscsi._devices` (LUN scan, multipath, flush, removal, an unreachable target)
and :mod:`~flexhub_iscsi._fencing` (the reservation glue around
:mod:`~flexhub_iscsi._reservation`, which uses :mod:`~flexhub_iscsi._keys` and
:mod:`~flexhub_iscsi._preempt`), and, for the provisioner and the CSI controller only,
:mod:`~flexhub_iscsi._provisioning` (LUNs made on a LIO target host, their snapshots and
clones); below them :mod:`~flexhub_iscsi._options`,
:mod:`~flexhub_iscsi._chap`, :mod:`~flexhub_iscsi._records`, :mod:`~flexhub_iscsi._iscsiadm`
and :mod:`~flexhub_iscsi._sysfs`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from flexhub.backend import (
    Attachment,
    CommandError,
    FlexhubError,
    NodeConfig,
    NodeRequirements,
    Volume,
    VolumeError,
    VolumeTrouble,
)
from flexhub_iscsi._chap import access, check_chap
from flexhub_iscsi._chap import node_key as access_key
from flexhub_iscsi._devices import _POLL
from flexhub_iscsi._fencing import _Fencing
from flexhub_iscsi._iscsiadm import Iscsiadm
from flexhub_iscsi._options import (
    DISCOVERY,
    IFACE_PREFIX,
    SESSION,
    SETTINGS_KEYS,
    Chap,
    Settings,
    Target,
    chap_for,
    dedicated_iface,
    parse_target,
)
from flexhub_iscsi._provisioning import _LioProvisioning
from flexhub_iscsi._sessions import _Sessions

__all__ = ["IscsiBackend"]

LOG = logging.getLogger(__name__)

#: Seconds to wait for a rescanned device to show its new size.
_RESIZE_WAIT = 5.0


class IscsiBackend(_Sessions, _Fencing, _LioProvisioning):
    """Block volumes on LUNs of iSCSI targets; provisioned on a Linux LIO target host
    (:mod:`flexhub_iscsi._lio`)."""

    schema_package = "flexhub_iscsi"
    node_requirements = NodeRequirements(
        commands=("iscsiadm", "blkid", "mkfs.ext4", "mkfs.xfs", "fsck", "mount", "umount"),
        kernel_modules=("iscsi_tcp",),
        daemons=("iscsid",),
        hint="install open-iscsi (iscsi-initiator-utils on RHEL) and start iscsid",
    )
    #: A LUN can be logged in from several nodes: read-only staging mounts use
    #: ``norecovery`` and read-write mounts are fenced with a persistent reservation.
    shared_device = True

    # --------------------------------------------------------------------------- helpers

    settings_keys = frozenset(SETTINGS_KEYS)

    @classmethod
    def secret_needed(cls, options: Mapping[str, str]) -> str:
        """CHAP (``chapAuthSession`` or ``chapAuthDiscovery``) takes its credentials from the
        PV's Secret."""
        flags = [f for f in ("chapAuthSession", "chapAuthDiscovery") if options.get(f) == "true"]
        if not flags:
            return ""
        verb = "takes" if len(flags) == 1 else "take"
        return f"{' and '.join(flags)} {verb} the CHAP credentials from a Secret"

    @classmethod
    def check_settings(
        cls, name: str, settings: Mapping[str, Any], config: NodeConfig | None = None
    ) -> None:
        """``[iscsi]``: known keys, positive timeouts, a well-formed ``reservation_key``."""
        super().check_settings(name, settings, config)
        Settings.from_table(settings)

    def _settings(self) -> Settings:
        return Settings.from_table(self.node.settings)

    @staticmethod
    def _credentials(volume: Volume, target: Target) -> tuple[Chap | None, Chap | None]:
        discovery = chap_for(volume, DISCOVERY) if target.chap_discovery else None
        session = chap_for(volume, SESSION) if target.chap_session else None
        for chap in (discovery, session):
            if chap is not None:
                check_chap(chap)
        return discovery, session

    # --------------------------------------------------------------------------- API

    @classmethod
    def check_options(cls, volume: Volume) -> None:
        """Check the target: portals, IQN, LUN (no node, no secrets needed)."""
        parse_target(volume.options)

    def check(self, volume: Volume) -> None:
        """Check the portals and, for ``mount`` (the only call with secrets), the CHAP keys.

        ``expandfs`` and the other calls carry no secrets (kubelet sends them only to
        ``mount``), so their credentials are not required.
        """
        target = parse_target(volume.options)
        if volume.pod is not None:
            self._credentials(volume, target)
        self._settings()

    def access(self, volume: Volume) -> Mapping[str, str]:
        """Portals, iface, initiator name and the CHAP credentials as keyed digests: a
        volume shares a staged LUN only with the same (see :mod:`flexhub_iscsi._chap`)."""
        target = parse_target(volume.options)
        discovery, session = self._credentials(volume, target)
        iface = target.iface
        if target.initiator_name:
            iface = dedicated_iface(target.iface, target.initiator_name)
        return access(target, iface, discovery, session, access_key(self.node.state_dir))

    def volume_id(self, volume: Volume) -> str:
        """``iscsi:<iqn>:<lun>``, whatever the portals: one LUN is one volume."""
        return parse_target(volume.options).volume_id

    def attach(self, volume: Volume) -> Attachment:
        """Log in to the target (reusing sessions), scan the LUN and return its device."""
        target = parse_target(volume.options)
        discovery, session = self._credentials(volume, target)
        settings = self._settings()
        secrets = [
            *(discovery.values() if discovery else ()),
            *(session.values() if session else ()),
        ]
        adm = Iscsiadm(self.node.runner, settings.command_timeout, secrets)
        iface = target.iface
        if target.initiator_name:
            iface = dedicated_iface(target.iface, target.initiator_name)
        identity = self.access(volume)
        started = time.monotonic()
        before = self._lun_disks(target.iqn, iface, target.lun)
        registered = False
        try:
            with contextlib.ExitStack() as in_use:
                with self._owner_lock(target.iqn, iface):
                    # The use lock is taken under the owner lock: a detach holding the owner
                    # lock (its disks deleted, its logout undecided) still owns the session
                    # and sees no attach of ours in flight, so it logs out; this attach then
                    # finds no session and logs in with its own identity.
                    in_use.enter_context(self._in_use(target.iqn, iface))
                    self._check_sessions_owner(target, iface, identity)
                    # Journalled before anything is done: an attach that never returns is
                    # undone by release() from this, without logging in again (secrets are
                    # mount's only); and from here on it owns the sessions it logs in.
                    self.node.record_progress(
                        iqn=target.iqn,
                        lun=str(target.lun),
                        iface=iface,
                        portals=",".join(str(p) for p in target.portals),
                    )
                    registered = True
                if target.initiator_name:
                    with self.node.lock("iscsi-iface", iface):
                        self._ensure_dedicated_iface(
                            adm, target.iface, iface, target.initiator_name
                        )
                else:
                    self._check_iface(adm, iface)
                portals = self._login(adm, settings, target, iface, discovery, session)
                logged_in = time.monotonic()
                disks = self._wait_disks(target, iface, settings.device_timeout)
                device, mpath = self._pick_device(adm, disks, settings.multipath_timeout)
                self.node.record_progress(multipath=mpath)
                reservation = self._fence_for_write(volume, target, disks, settings)
        except BaseException:
            if registered:  # before, it did nothing (a refusal leaves the sessions alone)
                self._cleanup_failed_attach(adm, target, iface, before)
            raise
        LOG.info(
            "iscsi: %s lun %d on %s via %s (%d path(s)%s); login %.2fs, device %.2fs",
            target.iqn,
            target.lun,
            device,
            iface,
            len(disks),
            f", multipath {mpath}" if mpath else "",
            logged_in - started,
            time.monotonic() - logged_in,
        )
        details = {
            "iqn": target.iqn,
            "lun": str(target.lun),
            "iface": iface,
            "portals": ",".join(portals),
            "devices": ",".join(disks),
            "multipath": mpath,
            "iface_created": "true" if iface.startswith(IFACE_PREFIX) else "false",
        }
        if reservation:
            details["reservation"] = reservation
        return Attachment(device, details)

    def health(self, attachment: Attachment) -> list[VolumeTrouble]:
        """The LUN's paths that are down, from sysfs (:mod:`flexhub_iscsi._health`)."""
        from flexhub_iscsi._health import troubles

        return troubles(self.sysfs, attachment.details)

    def detach(self, attachment: Attachment) -> None:
        """Remove the LUN's devices; log out only when no other LUN of the target is used."""
        details = attachment.details
        iqn = details.get("iqn", "")
        lun_text = details.get("lun", "")
        if not iqn or not lun_text.isdigit():
            raise VolumeError(
                f"iscsi: the journal record of {attachment.device} has no target/LUN: "
                "cannot release it"
            )
        lun = int(lun_text)
        iface = details.get("iface") or "default"
        portals = [p for p in details.get("portals", "").split(",") if p]
        settings = self._settings()
        adm = Iscsiadm(self.node.runner, settings.command_timeout)
        mpath = details.get("multipath", "")
        self._defer_if_unreachable(iqn, iface, lun, attachment.device, mpath)
        # The LUN's own devices need no target lock (the core holds the volume's lock).
        # Flushed before the reservation goes: a flush that does not finish defers the
        # release with the LUN still fenced, so no other node writes before this node's
        # queued writes are in or failed. The key is unregistered through the LUN's disks,
        # so they go last.
        disks = self._flush_lun(adm, iqn, iface, lun, mpath)
        self._unfence(details.get("reservation", ""), iqn, iface, lun, settings)
        # The record owns the session until the logout (its disks gone or not): an attach
        # of another identity checks ownership under this lock, never in between.
        with self._owner_lock(iqn, iface):
            self._delete_disks(iqn, iface, lun, disks, attachment.device)
            self._release(adm, iqn, iface, lun, portals, exclude=f"iscsi:{iqn}:{lun}")

    releases_partial = True

    def release(self, partial: Mapping[str, str]) -> None:
        """Undo an attach that never returned, from what it reported: the LUN's disks (and
        multipath map), then, unless another LUN of the target is in use, the sessions on the
        reported portals, the node records and a dedicated iface. Never logs in."""
        if not partial.get("iqn") or not partial.get("lun", "").isdigit():
            return  # it stopped before its first report: it did nothing
        self.detach(Attachment("", partial))

    def expand(self, attachment: Attachment, volume: Volume, new_size: int) -> None:
        """Rescan the LUN on every path (and the multipath map) until it has ``new_size``."""
        details = attachment.details
        iqn = details.get("iqn", "")
        lun = int(details.get("lun", "0") or 0)
        iface = details.get("iface") or "default"
        mpath = details.get("multipath", "")
        settings = self._settings()
        with self._target_locks(iqn, iface):
            disks = self._lun_disks(iqn, iface, lun)
            if not disks:
                raise VolumeError(f"iscsi: LUN {lun} of {iqn} has no device on this node")
            for disk in disks:
                self.sysfs.rescan(disk)
            if mpath:
                self._run(
                    ["multipathd", "resize", "map", mpath],
                    what=f"resize multipath map {mpath}",
                    timeout=settings.command_timeout,
                )
            name = self.sysfs.block_name(attachment.device)
            # The rescan and the map resize are synchronous: wait briefly, not device_timeout.
            deadline = time.monotonic() + min(_RESIZE_WAIT, settings.device_timeout)
            size = self.sysfs.size(name) if name else None
            while (size or 0) < new_size and time.monotonic() < deadline:
                time.sleep(_POLL * 5)
                size = self.sysfs.size(name) if name else None
            if size is None or size < new_size:
                raise VolumeError(
                    f"iscsi: {attachment.device} (LUN {lun} of {iqn}) has {size or 0} bytes "
                    f"after a rescan, {new_size} requested: grow the LUN on the target first"
                )
            LOG.info("iscsi: %s is %d bytes after the rescan", attachment.device, size)

    # --------------------------------------------------------------------------- attach steps

    def _run(self, argv: Sequence[str], *, what: str, timeout: float) -> None:
        try:
            self.node.runner(argv, timeout=timeout)
        except CommandError as exc:
            raise VolumeError(f"iscsi: cannot {what}: {exc.message}") from None

    def _cleanup_failed_attach(
        self, adm: Iscsiadm, target: Target, iface: str, before: list[str]
    ) -> None:
        """After a failed attach: drop the disks it made, log out if nothing else is used."""
        try:
            for disk in self._lun_disks(target.iqn, iface, target.lun):
                if disk not in before:
                    self.sysfs.delete(disk)
            self._release(
                adm,
                target.iqn,
                iface,
                target.lun,
                [str(p) for p in target.portals],
                exclude=target.volume_id,
            )
        except (FlexhubError, OSError) as exc:
            LOG.error(
                "iscsi: cleaning up after the failed attach of %s failed: %s", target.iqn, exc
            )

    def still_attached(self, attachment: Attachment) -> bool | None:
        """Whether the journalled device still is the LUN's: one of its SCSI disks in the
        target's sessions through the iface, or a map holding one of them (only reads
        sysfs). ``None`` when the record names no target/LUN or the device is gone."""
        details = attachment.details
        lun = details.get("lun", "")
        if not details.get("iqn") or not lun.isdigit() or not attachment.device:
            return None
        name = self.sysfs.block_name(attachment.device)
        if name is None:
            return None
        disks = self._lun_disks(details["iqn"], details.get("iface") or "default", int(lun))
        return name in disks or any(name in self.sysfs.holders(disk) for disk in disks)

    def release_waits(self, attachment: Attachment) -> str:
        """The target is unreachable: see :meth:`_defer_if_unreachable` (only reads sysfs)."""
        details = attachment.details
        lun = details.get("lun", "")
        if not details.get("iqn") or not lun.isdigit():
            return ""
        return self._unreachable(
            details["iqn"],
            details.get("iface") or "default",
            int(lun),
            attachment.device,
            details.get("multipath", ""),
        )
