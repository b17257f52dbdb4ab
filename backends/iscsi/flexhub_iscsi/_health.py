"""What an attached LUN lacks on this node, from sysfs alone (CSI ``NodeGetVolumeHealth``).

A path is a portal's session and the LUN's disk in it. A session that is not ``LOGGED_IN``
(``FAILED`` while open-iscsi reconnects, ``FREE``) or gone, and a disk whose SCSI state is
not ``running`` (``blocked`` during a reconnect, ``transport-offline`` past
``replacement_timeout``, ``offline``) or gone, is a path down. A portal written as a host
name has the session the kernel shows by address: a session of the target on no journalled
portal's address stands for such a portal. Some down: ``degraded``
(``PathDown``: multipath serves the volume through the others); all down: ``inaccessible``
(``PathsDown``: reads and writes wait or fail). The attachment's journalled details name the
portals it logged in to and its disks (:meth:`flexhub_iscsi.IscsiBackend.attach`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from flexhub.backend import VolumeTrouble
from flexhub_iscsi._sysfs import Sysfs

__all__ = ["troubles"]


def _names(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def _is_address(portal: str) -> bool:
    """Whether ``portal`` (``host:port``, ``[v6]:port``) names an IP address, not a host."""
    host = portal.rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def troubles(sysfs: Sysfs, details: Mapping[str, str]) -> list[VolumeTrouble]:
    """The attachment's paths that are down, as one trouble (none when all are up)."""
    iqn = details.get("iqn", "")
    portals = _names(details.get("portals", ""))
    disks = _names(details.get("devices", ""))
    if not iqn or not (portals or disks):
        return []  # a record from before the details named them: nothing to compare
    found = sysfs.sessions_of(iqn, details.get("iface") or "default")
    sessions = {s.portal: s for s in found}
    # a portal written as a host name: the kernel's session shows the address it resolved to
    others = [s for s in found if s.portal not in portals]
    down: list[str] = []
    up = 0
    for portal in portals:
        session = sessions.get(portal)
        if session is None and others and not _is_address(portal):
            session = others.pop(0)
        if session is None:
            down.append(f"{portal} has no session")
        elif not session.logged_in:
            down.append(f"the session on {session.portal} is {session.state}")
        else:
            up += 1
    bad_disks = 0
    for disk in disks:
        state = sysfs.device_state(disk)
        if state != "running":
            bad_disks += 1
            down.append(f"disk {disk} is {state or 'gone'}")
    if not down:
        return []
    lun = details.get("lun", "?")
    what = f"iSCSI {iqn} lun {lun}"
    if (portals and not up) or (disks and bad_disks == len(disks)):
        return [VolumeTrouble("inaccessible", "PathsDown", f"{what}: no path: {'; '.join(down)}")]
    return [
        VolumeTrouble(
            "degraded",
            "PathDown",
            f"{what}: {'; '.join(down)} (served by the other path(s))",
        )
    ]
