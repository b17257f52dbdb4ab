"""SendTargets discovery and node records: one discovery at a time on the node, the node
records discovery made for other targets deleted, each node record set up (manual startup
and scan, session CHAP written into the record file, never on a command line).
"""

from __future__ import annotations

import logging
from pathlib import Path

from flexhub.backend import BlockBackend, VolumeError
from flexhub_iscsi._iscsiadm import ERR_NO_OBJS, Iscsiadm, IscsiadmError
from flexhub_iscsi._options import DISCOVERY, SESSION, Chap, Portal, Settings, Target
from flexhub_iscsi._records import NodeRecord, RecordFiles, shown

LOG = logging.getLogger(__name__)


class _Discovery(BlockBackend):
    """Discovery and open-iscsi's node records (the connector's discovery helpers)."""

    #: open-iscsi's record files; tests point this at a fake tree.
    _records: RecordFiles | None = None

    @property
    def records(self) -> RecordFiles:
        """open-iscsi's record files (tests point ``_records`` at a fake tree)."""
        if self._records is None:
            self._records = RecordFiles()
        return self._records

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
