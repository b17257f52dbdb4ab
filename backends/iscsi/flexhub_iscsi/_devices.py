"""The LUN's block devices: scan its SCSI disks, wait for them, pick the multipath map
or a disk; flush, remove, and tell when the target is unreachable (a release must wait).

Everything here reads or writes sysfs (:mod:`flexhub_iscsi._sysfs`) and runs ``multipath``,
``multipathd`` or ``blockdev``; nothing logs in or out.
"""

from __future__ import annotations

import logging
import os
import time

from flexhub.backend import BlockBackend, CommandError, CommandTimeout, ReleaseDeferred, VolumeError
from flexhub_iscsi._iscsiadm import Iscsiadm
from flexhub_iscsi._options import Target
from flexhub_iscsi._sysfs import Session, Sysfs

LOG = logging.getLogger(__name__)

#: Seconds between two looks at sysfs while waiting for a device.
_POLL = 0.1

#: Seconds between two scans of a LUN that has not appeared yet.
_RESCAN = 2.0

#: Seconds to wait for the kernel to drop deleted disks.
_GONE_TIMEOUT = 10.0

#: Attempts to flush a multipath map that is still busy.
_FLUSH_ATTEMPTS = 3

#: Seconds a device may take to write its buffers out before its release waits.
_FLUSH_TIMEOUT = 60


class _Devices(BlockBackend):
    """The LUN's disks and multipath map, through sysfs (the connector's device helpers)."""

    #: Where sysfs and device nodes are; tests point this at a fake tree.
    sysfs: Sysfs = Sysfs()

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

    def _flush_lun(self, adm: Iscsiadm, iqn: str, iface: str, lun: int, mpath: str) -> list[str]:
        """Flush and remove the LUN's multipath map, then flush its SCSI disks (found in
        sysfs); returns the disks.

        :raises ReleaseDeferred: a flush did not finish (nothing was removed after it).
        """
        disks = self._lun_disks(iqn, iface, lun)
        dm = self.sysfs.find_map(mpath) if mpath else None
        slaves = set(self.sysfs.slaves(dm)) if dm is not None else set()
        if dm is not None and slaves and not slaves & set(disks):
            # The name now belongs to another LUN's map (friendly names are reused after a
            # reboot): not this LUN's to flush or remove.
            LOG.info("iscsi: multipath map %s holds none of LUN %d's disks: left alone", mpath, lun)
        elif dm is not None:
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
