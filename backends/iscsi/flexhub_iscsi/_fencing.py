"""Write fencing: reserve the LUN for this node before a read-write mount, release it after.

The glue between the connector and :mod:`flexhub_iscsi._reservation` (SCSI-3 persistent
reservations through the LUN's disks).
"""

from __future__ import annotations

import logging

from flexhub.backend import FlexhubError, Volume, VolumeError
from flexhub_iscsi._devices import _Devices
from flexhub_iscsi._options import Settings, Target, dedicated_iface
from flexhub_iscsi._reservation import (
    Fence,
    FenceConflict,
    NoReservations,
    format_key,
    node_key,
    parse_key,
)

LOG = logging.getLogger(__name__)


class _Fencing(_Devices):
    """The reservation of a LUN mounted read-write (the connector's fencing helpers)."""

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
        # Journalled before the key is registered: an attach killed from here on is undone
        # by release() from what it reported, and that unregisters the key (ending its
        # reservation) instead of leaving the LUN held by this node.
        self.node.record_progress(reservation=format_key(key))
        try:
            fence.acquire(target.volume_id, self.node.state_dir)
        except FenceConflict:
            # refused before registering, or after unregistering again: nothing to release
            self.node.record_progress(reservation="")
            raise
        except NoReservations as exc:
            self.node.record_progress(reservation="")
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
