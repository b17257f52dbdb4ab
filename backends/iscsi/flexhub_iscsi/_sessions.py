"""Sessions to a target: who owns them, the locks around them, login on every portal,
logout (and the dedicated iface's deletion) once nothing uses them.

Locks: an attach holds the target's *use* lock shared; a release takes the target lock and
logs out only if it can take the use lock exclusively at once, so an unmount never waits for
a mount in flight. The owner lock covers the check of who owns the target's sessions, and
a detach from the deletion of its disks through its logout: a detaching volume owns the
session until it logged out.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping

from flexhub.backend import InvalidOptions, LockTimeout, VolumeError
from flexhub_iscsi._chap import session_part
from flexhub_iscsi._devices import _Devices
from flexhub_iscsi._discovery import _Discovery
from flexhub_iscsi._ifaces import _Ifaces
from flexhub_iscsi._iscsiadm import ERR_NO_OBJS, ERR_SESS_EXISTS, ERR_SESS_NOT_FOUND, Iscsiadm
from flexhub_iscsi._options import IFACE_PREFIX, Chap, Portal, Settings, Target, parse_portal

LOG = logging.getLogger(__name__)

_BACKEND = "iscsi"


class _Sessions(_Discovery, _Ifaces, _Devices):
    """The target's sessions: ownership, locks, login, logout (the connector's session helpers)."""

    def _check_sessions_owner(
        self, target: Target, iface: str, identity: Mapping[str, str]
    ) -> None:
        """Refuse to reuse the target's sessions through ``iface`` that another volume has
        (or may soon have) with another session identity (iface, session CHAP): reusing
        one skips the login.

        Every journalled volume of the target through ``iface`` counts, whatever its
        stage: an attach in flight or interrupted (an intent: the target only in its
        options or in what the attach reported), a LUN attached but not staged yet, staged,
        being detached (its disks already deleted) or whose release waits. Ownership ends at
        the logout, not at the deletion of the disks: a record owns nothing only once the
        target has no session through ``iface`` left (and nothing is staged or waiting: a
        crash right after the detach). The caller holds the target's owner lock, which a
        detach also holds from deleting its disks through its logout decision, so that
        neither two attaches nor an attach and a detach check and act in between.
        """
        mine = session_part(identity)
        waiting = set(self.node.journal.deferred())
        logged_in = bool(self.sysfs.sessions_of(target.iqn, iface))
        for record in self.node.journal.volumes():
            if record.backend != _BACKEND:
                continue
            details = record.details or record.partial
            iqn = details.get("iqn") or record.partial.get("iqn") or record.options.get("iqn")
            theirs_iface = details.get("iface") or record.access.get("iface") or "default"
            if iqn != target.iqn or theirs_iface != iface:
                continue
            owns = record.pending or record.volume_id in waiting or logged_in
            if not (owns or os.path.ismount(record.staging)):
                continue  # released (logged out): a leftover record
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
        one of them (short: no command runs under it), and while a detach deletes its LUN's
        disks and decides whether to log out (bounded: the deletion's wait, the logout)."""
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

        if len(pending) > 1:  # multipath only: its thread pool is imported then
            from concurrent.futures import ThreadPoolExecutor

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
