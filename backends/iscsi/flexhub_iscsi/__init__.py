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
once, so an unmount never waits for a mount in flight.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from flexhub.backend import (
    Attachment,
    BlockBackend,
    CommandError,
    CommandTimeout,
    FlexhubError,
    InvalidOptions,
    LockTimeout,
    NodeConfig,
    NodeRequirements,
    ReleaseDeferred,
    Volume,
    VolumeError,
)
from flexhub_iscsi._chap import access, check_chap, session_part
from flexhub_iscsi._chap import node_key as access_key
from flexhub_iscsi._iscsiadm import (
    ERR_NO_OBJS,
    ERR_SESS_EXISTS,
    ERR_SESS_NOT_FOUND,
    Iscsiadm,
    IscsiadmError,
)
from flexhub_iscsi._options import (
    DISCOVERY,
    IFACE_PREFIX,
    SESSION,
    SETTINGS_KEYS,
    Chap,
    Portal,
    Settings,
    Target,
    chap_for,
    dedicated_iface,
    parse_portal,
    parse_target,
)
from flexhub_iscsi._records import NodeRecord, RecordFiles, shown
from flexhub_iscsi._reservation import Fence, NoReservations, format_key, node_key, parse_key
from flexhub_iscsi._sysfs import Session, Sysfs

__all__ = ["IscsiBackend"]

LOG = logging.getLogger(__name__)

_BACKEND = "iscsi"
#: Seconds between two looks at sysfs while waiting for a device.
_POLL = 0.1
#: Seconds between two scans of a LUN that has not appeared yet.
_RESCAN = 2.0
#: Seconds to wait for the kernel to drop deleted disks.
_GONE_TIMEOUT = 10.0
#: Seconds to wait for a rescanned device to show its new size.
_RESIZE_WAIT = 5.0
#: Attempts to flush a multipath map that is still busy.
_FLUSH_ATTEMPTS = 3
#: Seconds a device may take to write its buffers out before its release waits.
_FLUSH_TIMEOUT = 60
#: The settings of the base iface a dedicated iface copies (how it reaches the network).
_IFACE_COPIED = frozenset(
    {
        "iface.transport_name",
        "iface.hwaddress",
        "iface.net_ifacename",
        "iface.ipaddress",
        "iface.prefix_len",
        "iface.vlan_id",
        "iface.mtu",
    }
)


class IscsiBackend(BlockBackend):
    """Block volumes on LUNs of iSCSI targets."""

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

    #: Where sysfs and device nodes are; tests point these at a fake tree.
    sysfs: Sysfs = Sysfs()
    _records: RecordFiles | None = None

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

    @property
    def records(self) -> RecordFiles:
        """open-iscsi's record files (tests point ``_records`` at a fake tree)."""
        if self._records is None:
            self._records = RecordFiles()
        return self._records

    def _check_sessions_owner(
        self, target: Target, iface: str, identity: Mapping[str, str]
    ) -> None:
        """Refuse to reuse the target's sessions through ``iface`` that another volume has
        (or may soon have) with another session identity (iface, session CHAP): reusing
        one skips the login.

        Every journalled volume of the target through ``iface`` counts, whatever its
        stage: an attach in flight or interrupted (an intent: the target only in its
        options or in what the attach reported), a LUN attached but not staged yet, staged,
        or whose release waits. Only a record whose release is over (nothing staged or
        waiting, no disk of its LUN on the node: a crash right after the detach) owns
        nothing. The caller holds the target's owner lock, so that two attaches cannot
        both check before either is journalled.
        """
        mine = session_part(identity)
        waiting = set(self.node.journal.deferred())
        for record in self.node.journal.volumes():
            if record.backend != _BACKEND:
                continue
            details = record.details or record.partial
            iqn = details.get("iqn") or record.partial.get("iqn") or record.options.get("iqn")
            theirs_iface = details.get("iface") or record.access.get("iface") or "default"
            if iqn != target.iqn or theirs_iface != iface:
                continue
            if not (record.pending or record.volume_id in waiting):
                lun = details.get("lun", "")
                attached = lun.isdigit() and self._lun_disks(iqn, iface, int(lun))
                if not (attached or os.path.ismount(record.staging)):
                    continue  # released: a leftover record
            theirs = session_part(record.access)
            differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            if differ:
                raise VolumeError(
                    f"iscsi: {target.iqn} is in use on this node by {record.volume_id} "
                    f"with another identity: {', '.join(differ)} differ(s); refusing to "
                    "share its session"
                )

    @contextlib.contextmanager
    def _owner_lock(self, iqn: str, iface: str) -> Iterator[None]:
        """Held while an attach checks who owns the target's sessions and journals itself as
        one of them: short (no command runs under it)."""
        with self.node.lock("iscsi-session-owner", f"{iqn} {iface}"):
            yield

    @contextlib.contextmanager
    def _target_locks(self, iqn: str, iface: str) -> Iterator[None]:
        # Always target first, then iface: attach and detach take them in this order. Only a
        # dedicated iface (made and deleted by flexhub) needs its own lock.
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.node.lock("iscsi-target", iqn))
            if iface.startswith(IFACE_PREFIX):
                stack.enter_context(self.node.lock("iscsi-iface", iface))
            yield

    @contextlib.contextmanager
    def _in_use(self, iqn: str, iface: str) -> Iterator[None]:
        """Held (shared) by an attach from its first step to its device: while any attach
        holds it, no release logs out of the target or deletes the iface. Attaches of one
        target never wait for each other, nor for a dead portal of another call."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.node.lock("iscsi-target-use", f"{iqn} {iface}", shared=True))
            if iface.startswith(IFACE_PREFIX):
                stack.enter_context(self.node.lock("iscsi-iface-use", iface, shared=True))
            yield

    def _release(
        self, adm: Iscsiadm, iqn: str, iface: str, lun: int, portals: list[str], exclude: str
    ) -> None:
        """Log out (and delete the iface) when nothing uses them and no attach is in flight.

        Releases of one target take turns (each is short and bounded); an attach in flight
        is never waited for: it keeps the session, and logs out itself if it fails.
        """
        with self._target_locks(iqn, iface), contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self.node.lock("iscsi-target-use", f"{iqn} {iface}", 0))
            except LockTimeout:
                LOG.info("iscsi: an attach of %s through %s is in flight: no logout", iqn, iface)
                return
            self._logout_if_unused(adm, iqn, iface, lun, portals)
            if iface.startswith(IFACE_PREFIX):
                try:
                    stack.enter_context(self.node.lock("iscsi-iface-use", iface, 0))
                except LockTimeout:
                    return
                self._delete_iface_if_unused(adm, iface, exclude=exclude)

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
            with self._in_use(target.iqn, iface):
                with self._owner_lock(target.iqn, iface):
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

    # --------------------------------------------------------------------------- fencing

    def _fence_for_write(
        self, volume: Volume, target: Target, disks: list[str], settings: Settings
    ) -> str:
        """Reserve the LUN for this node before a read-write mount (see ``_reservation``).

        :returns: the key now holding it ("" for a read-only volume or ``fencing: none``).
        """
        if volume.read_only:
            return ""
        if volume.options.get("fencing") == "none":
            LOG.warning("iscsi: %s is mounted read-write without fencing", target.volume_id)
            return ""
        key = node_key(self.node.state_dir, settings.reservation_key)
        # the initiator of this mount's sessions: this key held through another is a clone
        iface = target.iface
        if target.initiator_name:
            iface = dedicated_iface(target.iface, target.initiator_name)
        sessions = self.sysfs.sessions_of(target.iqn, iface)
        initiators = [s.initiator for s in sessions if s.initiator]
        fence = Fence(
            self.node.runner, settings.command_timeout, key, self._paths(disks), initiators
        )
        try:
            fence.acquire(target.volume_id, self.node.state_dir)
        except NoReservations as exc:
            raise VolumeError(
                f"iscsi: the target of {target.volume_id} does not support SCSI-3 persistent "
                "reservations, so flexhub cannot keep other nodes from writing to it: read-write "
                'mount refused (set the PV option fencing: "none" to mount it without '
                f"fencing) ({exc.message})"
            ) from None
        return format_key(key)

    def _unfence(self, key_text: str, iqn: str, iface: str, lun: int, settings: Settings) -> None:
        """Unregister the node's key from the LUN's paths (which ends its reservation)."""
        if not key_text:
            return
        disks = self._lun_disks(iqn, iface, lun)
        volume_id = f"iscsi:{iqn}:{lun}"
        if not disks:
            LOG.warning(
                "iscsi: %s has no path left: its reservation (key %s) cannot be released here",
                volume_id,
                key_text,
            )
            return
        try:
            key = parse_key(key_text)
            Fence(self.node.runner, settings.command_timeout, key, self._paths(disks)).release(
                volume_id
            )
        except FlexhubError as exc:
            # The target is unreachable or refuses: the unmount still goes on; the key stays
            # registered there, and this node finds its own key again on its next mount.
            LOG.error("iscsi: %s: releasing the reservation failed: %s", volume_id, exc)

    def _paths(self, disks: list[str]) -> list[str]:
        return [str(self.sysfs.dev / disk) for disk in disks]

    # --------------------------------------------------------------------------- attach steps

    def _run(self, argv: Sequence[str], *, what: str, timeout: float) -> None:
        try:
            self.node.runner(argv, timeout=timeout)
        except CommandError as exc:
            raise VolumeError(f"iscsi: cannot {what}: {exc.message}") from None

    def _check_iface(self, adm: Iscsiadm, iface: str) -> None:
        """Make sure the iface exists (``default`` always does)."""
        if iface == "default":
            return
        try:
            adm.run(["-m", "iface", "-I", iface, "-o", "show"], what=f"read iface {iface}")
        except IscsiadmError as exc:
            raise InvalidOptions(
                f"iscsiInterface {iface!r} does not exist on this node ({exc.message})"
            ) from None

    def _ensure_dedicated_iface(
        self, adm: Iscsiadm, base: str, iface: str, initiator_name: str
    ) -> None:
        """Create ``iface`` as a copy of ``base`` carrying ``initiator_name`` (idempotent)."""
        shown = adm.run(
            ["-m", "iface", "-I", iface, "-o", "show"],
            what=f"read iface {iface}",
            ok=(0, 1, 2, 6, 21),
        )
        if shown.returncode == 0:
            current = _iface_params(shown.stdout).get("iface.initiatorname", "")
            if current == initiator_name:
                return
        else:
            try:
                base_params = _iface_params(
                    adm.run(
                        ["-m", "iface", "-I", base, "-o", "show"], what=f"read iface {base}"
                    ).stdout
                )
            except IscsiadmError as exc:
                raise InvalidOptions(
                    f"iscsiInterface {base!r} does not exist on this node ({exc.message})"
                ) from None
            adm.run(["-m", "iface", "-I", iface, "-o", "new"], what=f"create iface {iface}")
            LOG.info(
                "iscsi: created iface %s (a copy of %s) for initiator %s",
                iface,
                base,
                initiator_name,
            )
            for key, value in sorted(base_params.items()):
                if key not in _IFACE_COPIED or value == "0":
                    continue
                adm.run(
                    ["-m", "iface", "-I", iface, "-o", "update", "-n", key, "-v", value],
                    what=f"set {key} of iface {iface}",
                )
        adm.run(
            [
                "-m",
                "iface",
                "-I",
                iface,
                "-o",
                "update",
                "-n",
                "iface.initiatorname",
                "-v",
                initiator_name,
            ],
            what=f"set the initiator name of iface {iface}",
        )

    def _portal_records(
        self,
        adm: Iscsiadm,
        settings: Settings,
        portal: Portal,
        target: Target,
        iface: str,
        discovery: Chap | None,
        session: Chap | None,
    ) -> None:
        """Discovery on ``portal`` and the target's node record there, one at a time.

        Discovery writes a node record for every target behind the portal: the ones it
        newly made, other than this target on the requested portals, are deleted at once (a
        record made earlier, by flexhub or the operator, is kept).

        One lock for the whole node, not one per portal: open-iscsi opens every SendTargets
        session with the same initiator name and ISID, so a target that sees two of them at
        once (two portals of one target, or two volumes mounted together) takes the second
        for a reinstatement and drops the first ("iSCSI PDU timed out"). The lock also makes
        sure no other flexhub call adds a node record meanwhile. Logins stay parallel: each
        session gets its own ISID.
        """
        bound = settings.login_timeout * (len(target.portals) + 1)
        with self.node.lock("iscsi-discovery", "sendtargets", bound):
            before = self.records.node_records()
            try:
                self._discover(adm, settings, portal, iface, discovery)
            finally:
                self._forget_new_records(adm, before, target, iface)
            self._prepare_node(adm, portal, target.iqn, iface, session)

    def _forget_new_records(
        self, adm: Iscsiadm, before: set[NodeRecord], target: Target, iface: str
    ) -> None:
        """Delete the node records discovery made that this volume did not ask for."""
        wanted = {(p.host, str(p.port)) for p in target.portals}
        for record in sorted(self.records.node_records() - before):
            address, port = ([*record.portal_dir.split(","), ""])[:2]
            if record.iqn == target.iqn and (address, port) in wanted:
                continue
            if record.iface not in ("", iface):
                continue
            try:
                adm.run(
                    [
                        "-m",
                        "node",
                        "-T",
                        record.iqn,
                        "-p",
                        record.portal,
                        "-I",
                        iface,
                        "-o",
                        "delete",
                    ],
                    what=f"delete the node record of {record.iqn} on {record.portal}",
                    ok=(0, ERR_NO_OBJS),
                )
                LOG.info(
                    "iscsi: deleted the node record discovery made for %s on %s",
                    record.iqn,
                    record.portal,
                )
            except IscsiadmError as exc:
                LOG.warning("iscsi: %s", exc.message)

    def _discover(
        self, adm: Iscsiadm, settings: Settings, portal: Portal, iface: str, chap: Chap | None
    ) -> None:
        """SendTargets discovery on ``portal`` (the caller holds the portal's lock)."""
        base = ["-m", "discoverydb", "-t", "sendtargets", "-p", str(portal), "-I", iface]
        if chap is None:
            adm.run(
                [
                    "-m",
                    "discovery",
                    "-t",
                    "sendtargets",
                    "-p",
                    str(portal),
                    "-I",
                    iface,
                    "-o",
                    "new",
                ],
                what=f"discover targets on {portal}",
                timeout=settings.login_timeout,
            )
            return
        # The discovery record is per portal, shared by every target behind it: its
        # credentials go into the record file (never on a command line) and are wiped
        # afterwards, so that open-iscsi's database does not keep them.
        adm.run(
            [*base, "-o", "new"], what=f"create the discovery record of {portal}", ok=(0, 6, 15)
        )
        adm.run(
            [*base, "-o", "update", "-n", DISCOVERY + "authmethod", "-v", "CHAP"],
            what=f"set CHAP for discovery on {portal}",
        )
        path = self.records.discovery_file(
            shown(
                adm.run([*base, "-o", "show"], what=f"read the discovery record of {portal}").stdout
            )
        )
        try:
            self.records.set_values(path, dict(chap.settings()[1:]))
            self._check_written(
                adm, [*base, "-o", "show"], chap, f"the discovery record of {portal}"
            )
            adm.run(
                [*base, "--discover", "-o", "new"],
                what=f"discover targets on {portal}",
                timeout=settings.login_timeout,
            )
        finally:
            self._forget_discovery_chap(adm, base, path, chap)

    def _check_written(self, adm: Iscsiadm, show: list[str], chap: Chap, what: str) -> None:
        """Read a record back (passwords masked) and check open-iscsi sees the CHAP lines."""
        values = shown(adm.run(show, what=f"read {what}").stdout)
        for name, value in chap.settings()[1:]:
            seen = values.get(name, "")
            if not seen or (not name.endswith(("password", "password_in")) and seen != value):
                raise VolumeError(f"iscsi: open-iscsi does not read {name} back from {what}")

    def _forget_discovery_chap(
        self, adm: Iscsiadm, base: list[str], path: Path, chap: Chap
    ) -> None:
        """Blank the credentials of a discovery record (best effort, logged)."""
        try:
            self.records.set_values(path, {name: "" for name, _ in chap.settings()[1:]})
            adm.run(
                [*base, "-o", "update", "-n", DISCOVERY + "authmethod", "-v", "None"],
                what="clear the discovery CHAP method",
            )
        except VolumeError as exc:
            LOG.warning("iscsi: cannot clear the CHAP settings of a discovery record: %s", exc)

    def _prepare_node(
        self, adm: Iscsiadm, portal: Portal, iqn: str, iface: str, chap: Chap | None
    ) -> None:
        """Create or update the node record: manual startup and scan, session CHAP."""
        base = ["-m", "node", "-T", iqn, "-p", str(portal), "-I", iface]
        shown_now = adm.run(
            base, what=f"read the node record of {iqn} on {portal}", ok=(0, ERR_NO_OBJS)
        )
        if shown_now.returncode == ERR_NO_OBJS:
            # The target answered discovery with other addresses (NAT, a name): add ours.
            adm.run([*base, "-o", "new"], what=f"create the node record of {iqn} on {portal}")
        settings: list[tuple[str, str]] = [
            ("node.startup", "manual"),
            ("node.session.scan", "manual"),
            (SESSION + "authmethod", "CHAP" if chap is not None else "None"),
        ]
        for name, value in settings:
            try:
                adm.run(
                    [*base, "-o", "update", "-n", name, "-v", value],
                    what=f"set {name} for {iqn} on {portal}",
                )
            except IscsiadmError:
                if name != "node.session.scan":
                    raise
                LOG.warning("iscsi: this iscsiadm has no node.session.scan: sessions scan all LUNs")
        if chap is None:
            return
        show = [*base, "-o", "show"]
        what = f"the node record of {iqn} on {portal}"
        path = self.records.node_file(iqn, iface, shown(adm.run(show, what=f"read {what}").stdout))
        values = dict.fromkeys(
            (SESSION + n for n in ("username", "password", "username_in", "password_in")), ""
        )
        values.update(chap.settings()[1:])
        self.records.set_values(path, values)
        self._check_written(adm, show, chap, what)

    def _login(
        self,
        adm: Iscsiadm,
        settings: Settings,
        target: Target,
        iface: str,
        discovery: Chap | None,
        session: Chap | None,
    ) -> list[str]:
        """Log in on every portal (reusing sessions); returns the portals with a session.

        :raises VolumeError: no portal could be logged in (every portal's error, scrubbed).
        """
        existing = {s.portal for s in self.sysfs.sessions_of(target.iqn, iface)}
        logged: list[str] = []
        errors: list[str] = []
        pending: list[Portal] = []
        for portal in target.portals:
            if str(portal) in existing:
                LOG.info("iscsi: reusing the session to %s on %s", target.iqn, portal)
                logged.append(str(portal))
            else:
                pending.append(portal)

        def login(portal: Portal) -> str | None:
            # Each portal on its own: a dead one costs its own bounds, not the others'.
            try:
                self._portal_records(adm, settings, portal, target, iface, discovery, session)
                adm.run(
                    ["-m", "node", "-T", target.iqn, "-p", str(portal), "-I", iface, "--login"],
                    what=f"log in to {target.iqn} on {portal}",
                    ok=(0, ERR_SESS_EXISTS),
                    timeout=settings.login_timeout,
                )
            except VolumeError as exc:
                LOG.warning("iscsi: portal %s of %s failed: %s", portal, target.iqn, exc.message)
                return exc.message
            return None

        if len(pending) > 1:
            with ThreadPoolExecutor(max_workers=min(len(pending), 8)) as pool:
                outcomes = list(pool.map(login, pending))
        else:
            outcomes = [login(p) for p in pending]
        for portal, error in zip(pending, outcomes, strict=True):
            if error is None:
                logged.append(str(portal))
            else:
                errors.append(error)
        if not logged:
            raise VolumeError(
                f"iscsi: could not log in to {target.iqn} on any portal: " + "; ".join(errors)
            )
        if errors:
            LOG.warning(
                "iscsi: %s: %d of %d portal(s) failed, going on with %s",
                target.iqn,
                len(errors),
                len(target.portals),
                ", ".join(logged),
            )
        return logged

    def _lun_paths(self, iqn: str, iface: str, lun: int) -> dict[Session, list[str]]:
        """The sessions to ``iqn`` through ``iface`` that hold a disk of LUN ``lun``, with
        those disks."""
        return {
            session: disks
            for session in self.sysfs.sessions_of(iqn, iface)
            if (disks := self.sysfs.lun_disks(session, lun))
        }

    def _lun_disks(self, iqn: str, iface: str, lun: int) -> list[str]:
        return [disk for disks in self._lun_paths(iqn, iface, lun).values() for disk in disks]

    def _wait_disks(self, target: Target, iface: str, timeout: float) -> list[str]:
        """Scan the LUN on every logged-in session; wait for its disks (all paths, bounded).

        :raises VolumeError: no disk appeared within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        scanned: dict[int, float] = {}
        disks: list[str] = []
        while True:
            sessions = [s for s in self.sysfs.sessions_of(target.iqn, iface) if s.logged_in]
            disks = []
            missing: list[Session] = []
            for session in sessions:
                found = [
                    d
                    for d in self.sysfs.lun_disks(session, target.lun)
                    if self.sysfs.node_exists(d)
                ]
                disks.extend(found)
                if not found:
                    missing.append(session)
            now = time.monotonic()
            if (disks and not missing) or now >= deadline:
                break
            for session in missing:
                if now - scanned.get(session.sid, -_RESCAN) >= _RESCAN:
                    scanned[session.sid] = now
                    try:
                        self.sysfs.scan(session, target.lun)
                    except OSError as exc:
                        LOG.warning("iscsi: cannot scan session %d: %s", session.sid, exc)
            time.sleep(_POLL)
        if not disks:
            raise VolumeError(
                f"iscsi: LUN {target.lun} of {target.iqn} did not appear within {timeout:g}s "
                "(does the target export this LUN to this initiator?)"
            )
        if missing:
            LOG.warning(
                "iscsi: LUN %d of %s: %d of %d path(s) appeared within %gs",
                target.lun,
                target.iqn,
                len(disks),
                len(disks) + len(missing),
                timeout,
            )
        return disks

    def _multipathd_running(self) -> bool:
        try:
            result = self.node.runner(["multipathd", "show", "daemon"], timeout=5, check=False)
        except CommandError:
            return False
        return result.returncode == 0 and "pid" in result.stdout

    def _pick_device(self, adm: Iscsiadm, disks: list[str], timeout: float) -> tuple[str, str]:
        """The device to use: the multipath map over ``disks`` if there is one, else a disk."""
        first = str(self.sysfs.dev / disks[0])
        if len(disks) == 1:
            mpath = self._holder_map(disks)
            if mpath is None:
                return first, ""
            return self._map_device(*mpath), mpath[1]
        if not self._multipathd_running():
            LOG.warning(
                "iscsi: %d paths (%s) but multipathd is not running: using %s only",
                len(disks),
                ", ".join(disks),
                first,
            )
            return first, ""
        deadline = time.monotonic() + timeout
        while True:
            found = self._holder_map(disks)
            if found is not None and set(disks) <= set(self.sysfs.slaves(found[0])):
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL)
        if found is None:
            LOG.warning(
                "iscsi: multipathd made no map over %s within %gs: using %s only",
                ", ".join(disks),
                timeout,
                first,
            )
            return first, ""
        return self._map_device(*found), found[1]

    def _holder_map(self, disks: list[str]) -> tuple[str, str] | None:
        """``(dm-N, map name)`` of a multipath map holding one of ``disks``."""
        for disk in disks:
            for holder in self.sysfs.holders(disk):
                name = self.sysfs.multipath_map(holder)
                if name:
                    return holder, name
        return None

    def _map_device(self, dm: str, name: str) -> str:
        mapper = self.sysfs.dev / "mapper" / name
        return str(mapper) if mapper.exists() else str(self.sysfs.dev / dm)

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

    # --------------------------------------------------------------------------- detach steps

    def _flush_lun(self, adm: Iscsiadm, iqn: str, iface: str, lun: int, mpath: str) -> list[str]:
        """Flush and remove the LUN's multipath map, then flush its SCSI disks (found in
        sysfs); returns the disks.

        :raises ReleaseDeferred: a flush did not finish (nothing was removed after it).
        """
        disks = self._lun_disks(iqn, iface, lun)
        dm = self.sysfs.find_map(mpath) if mpath else None
        if dm is not None:
            self._flush(str(self.sysfs.dev / dm))
            for attempt in range(1, _FLUSH_ATTEMPTS + 1):
                result = self.node.runner(
                    ["multipath", "-f", mpath], timeout=adm.timeout, check=False
                )
                if result.returncode == 0 or self.sysfs.find_map(mpath) is None:
                    break
                if attempt == _FLUSH_ATTEMPTS:
                    raise VolumeError(
                        f"iscsi: cannot remove multipath map {mpath}: "
                        f"{' '.join((result.stderr or result.stdout).split())[:300]}"
                    )
                time.sleep(1.0)
        elif mpath:
            LOG.info("iscsi: multipath map %s is already gone", mpath)
        paths = self._lun_paths(iqn, iface, lun)
        down = {disk for session, held in paths.items() if not session.logged_in for disk in held}
        for disk in disks:
            if disk in down:
                # A dead path holds nothing to write (the map was flushed through the live
                # ones, or the release waited): a flush would only block on its queue.
                LOG.info("iscsi: not flushing %s: its session is down", disk)
            else:
                self._flush(str(self.sysfs.dev / disk))
        return disks

    def _delete_disks(self, iqn: str, iface: str, lun: int, disks: list[str], device: str) -> None:
        """Delete the LUN's SCSI disks (flushed) and wait until the kernel dropped them."""
        for disk in disks:
            self.sysfs.delete(disk)
        deadline = time.monotonic() + _GONE_TIMEOUT
        while self._lun_disks(iqn, iface, lun) and time.monotonic() < deadline:
            time.sleep(_POLL)
        left = self._lun_disks(iqn, iface, lun)
        if left:
            raise VolumeError(f"iscsi: the disks {', '.join(left)} of LUN {lun} of {iqn} stay")
        if disks:
            LOG.info("iscsi: removed %s (LUN %d of %s)", ", ".join(disks), lun, iqn)
        elif device:
            LOG.info("iscsi: LUN %d of %s had no disk left (%s)", lun, iqn, device)

    def _defer_if_unreachable(
        self, iqn: str, iface: str, lun: int, device: str, mpath: str
    ) -> None:
        """Keep the LUN while the sessions it was used through are all down (the target is
        unreachable): flushing would block until open-iscsi gives up, and removing the disks
        or logging out would throw away the writes still queued for the target. With a
        multipath map, any path up will do; without, the session of the one disk used.

        :raises ReleaseDeferred: naming the sessions' states; the core retries later.
        """
        why = self._unreachable(iqn, iface, lun, device, mpath)
        if why:
            raise ReleaseDeferred(why)

    def _unreachable(self, iqn: str, iface: str, lun: int, device: str, mpath: str) -> str:
        """Why the LUN's release must wait for the target (see above), or ``""``."""
        holding = self._lun_paths(iqn, iface, lun)
        name = self.sysfs.block_name(device) if device and not mpath else None
        used = [s for s, disks in holding.items() if name in disks] or list(holding)
        if used and not any(s.logged_in for s in used):
            states = ", ".join(sorted({f"{s.portal} {s.state.lower()}" for s in used}))
            return (
                f"iscsi: the target {iqn} is unreachable ({states}): LUN {lun} stays attached "
                "so that writes still queued reach it when it returns; the node's next unmount "
                "after that releases it"
            )
        return ""

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

    def _flush(self, device: str) -> None:
        """Write the device's buffers out; a flush that cannot finish in its bound means the
        storage stopped answering: the release waits (:class:`ReleaseDeferred`)."""
        if not os.path.exists(device):
            return
        try:
            result = self.node.runner(
                ["blockdev", "--flushbufs", device], timeout=_FLUSH_TIMEOUT, check=False
            )
        except CommandTimeout as exc:
            raise ReleaseDeferred(
                f"iscsi: {device} does not take its buffered writes ({exc.message}): it stays "
                "attached; the node's next unmount releases it"
            ) from None
        if result.returncode != 0:
            LOG.warning("iscsi: flushing %s failed: %s", device, result.stderr.strip()[:200])

    def _users(self, iqn: str, iface: str, lun: int) -> list[str]:
        """What still uses the target's sessions through ``iface``, besides LUN ``lun``.

        Live disks of other LUNs in the sessions (whoever scanned them), and flexhub's staged
        volumes of the same target whose staging directory is still mounted.
        """
        users: set[str] = set()
        for session in self.sysfs.sessions_of(iqn, iface):
            for other, disks in self.sysfs.luns_in_use(session).items():
                if other != lun:
                    users.add(f"LUN {other} ({', '.join(disks)})")
        for record in self.node.journal.volumes():
            details = record.details
            if record.backend != _BACKEND or details.get("iqn") != iqn:
                continue
            if (details.get("iface") or "default") != iface or details.get("lun") == str(lun):
                continue
            if os.path.ismount(record.staging):
                users.add(f"LUN {details.get('lun')} (staged on {record.staging})")
        return sorted(users)

    def _logout_if_unused(
        self, adm: Iscsiadm, iqn: str, iface: str, lun: int, portals: list[str]
    ) -> None:
        users = self._users(iqn, iface, lun)
        if users:
            LOG.info(
                "iscsi: %s stays logged in through %s: used by %s", iqn, iface, "; ".join(users)
            )
            return
        sessions = self.sysfs.sessions_of(iqn, iface)
        to_logout = list(dict.fromkeys([*portals, *(s.portal for s in sessions)]))
        failures: list[str] = []
        for portal in to_logout:
            try:
                parse_portal(portal)
                adm.run(
                    ["-m", "node", "-T", iqn, "-p", portal, "-I", iface, "--logout"],
                    what=f"log out of {iqn} on {portal}",
                    ok=(0, ERR_SESS_NOT_FOUND, ERR_NO_OBJS),
                )
            except (VolumeError, InvalidOptions) as exc:
                failures.append(exc.message)
        left = self.sysfs.sessions_of(iqn, iface)
        if left:
            raise VolumeError(
                f"iscsi: {iqn} is still logged in on {', '.join(s.portal for s in left)} "
                f"after the logout: {'; '.join(failures) or 'no error reported'}"
            )
        adm.run(
            ["-m", "node", "-T", iqn, "-I", iface, "-o", "delete"],
            what=f"delete the node records of {iqn}",
            ok=(0, ERR_NO_OBJS),
        )
        LOG.info("iscsi: logged out of %s (%s) and deleted its node records", iqn, iface)

    def _delete_iface_if_unused(self, adm: Iscsiadm, iface: str, exclude: str) -> None:
        """Delete a flexhub-made iface once no session and no staged volume uses it."""
        if any(s.iface == iface for s in self.sysfs.sessions()):
            return
        for record in self.node.journal.volumes():
            if (
                record.backend == _BACKEND
                and record.details.get("iface") == iface
                and record.volume_id != exclude
                and os.path.ismount(record.staging)
            ):
                return
        adm.run(
            ["-m", "iface", "-I", iface, "-o", "delete"],
            what=f"delete iface {iface}",
            ok=(0, ERR_NO_OBJS, 1, 6),
        )
        LOG.info("iscsi: deleted iface %s", iface)


def _iface_params(text: str) -> dict[str, str]:
    """``iscsiadm -m iface -o show`` output as ``{name: value}``, unset values left out."""
    params: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(" = ")
        name, value = name.strip(), value.strip()
        if not sep or not name.startswith("iface.") or value in ("", "<empty>"):
            continue
        params[name] = value
    return params
