"""The provisioner's side of the iscsi backend (a mixin of
:class:`~flexhub_iscsi.IscsiBackend`): LUNs made, grown and reclaimed on a Linux LIO target
host over SSH (:mod:`flexhub_iscsi._lio`), and the CSI controller's snapshots, restores and
clones of them (:mod:`flexhub_iscsi._snapshots`, :mod:`flexhub_iscsi._lio_snap`).

Everything that reaches the target host is imported inside the methods: the kubelet's
FlexVolume calls import this module (for the class) but never run them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from flexhub.backend import InvalidOptions, Node, Secrets
from flexhub.provisioning import Claim, Provisioned, Provisioning
from flexhub_iscsi._options import SESSION

if TYPE_CHECKING:
    from flexhub_iscsi._lio import LioClass

__all__ = ["_LioProvisioning"]

LOG = logging.getLogger(__name__)


def _node(self: object) -> Node:
    node: Node = getattr(self, "node")  # noqa: B009 (the backend's, set by its __init__)
    return node


class _LioProvisioning(Provisioning):
    """``provision``, ``reclaim``, ``expand_storage`` and the snapshot methods."""

    #: Provisioning: the LUN is grown on the target host, then the node's ``expandfs``
    #: rescans it and grows the filesystem.
    expands_storage = True
    on_delete = frozenset({"delete", "retain"})
    snapshots = True

    @classmethod
    def check_parameters(cls, parameters: Mapping[str, str]) -> None:
        """The class's parameters, beyond what the schema checks (see :mod:`~._lio`)."""
        from flexhub_iscsi import _lio  # the provisioner's only: not on the kubelet path

        _lio.parse_class(parameters)

    def provision(
        self, claim: Claim, parameters: Mapping[str, str], secrets: Secrets
    ) -> Provisioned:
        """Make (or find) the claim's target, LUN 0 and its backing file or logical volume
        on the target host."""
        from flexhub_iscsi import _lio_ssh  # the provisioner's only: not on the kubelet path

        lio, spec, chap = self._claim_spec(claim, parameters, secrets)
        masked = list(chap.values()) if chap else []
        done = _lio_ssh.Lio(_node(self).runner, lio.ssh, secrets).call("provision", spec, masked)
        return self._provisioned(lio, claim, chap, done)

    @staticmethod
    def _claim_spec(
        claim: Claim, parameters: Mapping[str, str], secrets: Secrets
    ) -> tuple[LioClass, dict[str, Any], dict[str, str] | None]:
        """The class checked, the target host's request for ``claim`` and the CHAP values
        (the same rules for a new, a restored and a cloned LUN)."""
        from flexhub_iscsi import _lio

        lio = _lio.parse_class(parameters)
        if _lio.UID.fullmatch(claim.uid) is None:
            raise InvalidOptions(f"claim {claim.namespace}/{claim.name}: uid is not a UUID")
        chap = _lio.chap_from(secrets)
        if chap is not None and lio.node_secret is None:
            raise InvalidOptions(
                "parameter 'nodeSecretName' is required with CHAP: the PV's secretRef must "
                "name a Secret with only the CHAP keys, never the one holding the SSH key"
            )
        if chap is None and lio.node_secret is not None:
            raise InvalidOptions(
                f"parameter 'nodeSecretName': the class's Secret holds no CHAP keys "
                f"({SESSION}username, {SESSION}password)"
            )
        if chap is None and not lio.initiators:
            raise InvalidOptions(
                "parameter 'initiators' is required without CHAP: otherwise any initiator "
                "that reaches the portal could use the LUN"
            )
        name = claim.volume_name
        store: dict[str, Any]
        if lio.backstore == "block":
            store = {"backstore": "block", "vg": lio.volume_group}
        else:
            store = {"directory": lio.directory, "file": f"{name}.img", "sparse": lio.sparse,
                     "overcommit": lio.overcommit}  # fmt: skip
        spec = {
            "name": name,
            "iqn": f"{lio.iqn_prefix}:{name}",
            **store,
            "size": _lio.size_of(claim.size),
            "portals": [[p.host, p.port] for p in lio.portals],
            "initiators": list(lio.initiators),
            "chap": chap,
        }
        return lio, spec, chap

    @staticmethod
    def _provisioned(
        lio: LioClass, claim: Claim, chap: dict[str, str] | None, done: Mapping[str, Any]
    ) -> Provisioned:
        """The PV of the LUN the target host answered ``done`` for."""
        iqn = f"{lio.iqn_prefix}:{claim.volume_name}"
        LOG.info(
            "iscsi: %s on %s: LUN 0 of %s, %s bytes (%s%s)",
            claim.volume_name,
            lio.ssh.host,
            iqn,
            done.get("size"),
            "made" if done.get("created") else "found",
            f", data: {done['how']}" if done.get("how") else "",
        )
        options = {"targetPortal": str(lio.portals[0]), "iqn": iqn, "lun": "0"}
        if len(lio.portals) > 1:
            options["portals"] = ",".join(str(p) for p in lio.portals[1:])
        if chap is not None:
            options["chapAuthSession"] = "true"
        record = {
            "targetHost": lio.ssh.host,
            "sshUser": lio.ssh.user,
            "sshPort": str(lio.ssh.port),
            "backstore": lio.backstore,
            # reclaim and expansion check that the iqn names this claim (the controller
            # checks that this uid is the PV's own)
            "claimUid": claim.uid,
        }
        if lio.backstore == "block":
            record["volumeGroup"] = lio.volume_group
        else:
            record["fileioDirectory"] = lio.directory
            record["sparse"] = "true" if lio.sparse else "false"
            # for expansion's room check (a record without it predates the check)
            record["overcommit"] = f"{lio.overcommit:.3f}".rstrip("0").rstrip(".")
        return Provisioned(
            options=options,
            size=int(done["size"]),
            reclaim=record,
            fs_type=lio.fs_type,
            secret=lio.node_secret if chap is not None else None,
        )

    def reclaim(
        self, options: Mapping[str, str], reclaim: Mapping[str, str], secrets: Secrets
    ) -> None:
        """``delete``: remove the target, the backstore and its file or logical volume (gone
        is success; an LV is zeroed before it is removed, within the SSH call's bound plus
        the zeroing's for the record's size); ``retain``: leave them all on the target host."""
        from flexhub_iscsi import _lio, _lio_ssh  # the provisioner's only: not on the kubelet path

        on_delete = reclaim.get("onDelete", "delete")
        if on_delete not in self.on_delete:
            raise InvalidOptions(f"onDelete {on_delete!r}: iscsi honours delete and retain")
        volume = _lio.parse_volume(options, reclaim)
        if on_delete == "retain":
            LOG.info("iscsi: %s kept on %s (onDelete: retain)", volume.iqn, volume.ssh.host)
            return
        spec = {"iqn": volume.iqn, **volume.spec()}
        timeout = _lio.CALL_TIMEOUT
        if volume.backstore == "block":  # the LV is zeroed before lvremove: its size's time
            size = reclaim.get("size", "")
            known = size.isascii() and size.isdigit() and len(size) < 20
            timeout += _lio.zero_seconds(int(size) if known else 0)
        lio = _lio_ssh.Lio(_node(self).runner, volume.ssh, secrets)
        done = lio.call("delete", spec, [], timeout)
        LOG.info(
            "iscsi: %s on %s deleted (%s)",
            volume.iqn,
            volume.ssh.host,
            ", ".join(done.get("deleted", [])) or "already gone",
        )

    def expand_storage(
        self,
        options: Mapping[str, str],
        reclaim: Mapping[str, str],
        new_size: int,
        secrets: Secrets,
    ) -> int:
        """Grow the backing file and the backstore, or the logical volume (``lvextend``), to
        ``new_size`` (rounded up to MiB, an LV to its extents; never shrinks; the range an LV
        gains is zeroed before the answer); return the LUN's size. The node's ``expandfs``
        then rescans the LUN and grows the filesystem."""
        from flexhub_iscsi import _lio, _lio_ssh  # the provisioner's only: not on the kubelet path

        volume = _lio.parse_volume(options, reclaim)
        spec = {**volume.spec(), "iqn": volume.iqn, "size": _lio.size_of(new_size)}
        timeout = _lio.CALL_TIMEOUT
        if volume.backstore == "fileio":
            spec["sparse"] = volume.sparse
            spec["overcommit"] = volume.overcommit
        else:  # the range lvextend adds (at most the new size) is zeroed before the answer
            timeout += _lio.zero_seconds(spec["size"])
        lio = _lio_ssh.Lio(_node(self).runner, volume.ssh, secrets)
        done = lio.call("expand", spec, [], timeout)
        return int(done["size"])

    def capacity(self, parameters: Mapping[str, str]) -> int:
        """CSI ``GetCapacity``: the room a new LUN of the class has on its target host, asked
        with the key of ``[iscsi] capacity_secret_dir`` (:mod:`flexhub_iscsi._capacity`)."""
        from flexhub_iscsi import _capacity
        from flexhub_iscsi._options import Settings

        directory = Settings.from_table(_node(self).settings).capacity_secret_dir
        return _capacity.capacity(_node(self), directory, parameters)

    # -- snapshots, restores and clones (the CSI controller's) ------------------------------

    def snapshot(
        self,
        options: Mapping[str, str],
        reclaim: Mapping[str, str],
        name: str,
        namespace: str,
        secrets: Secrets,
    ) -> dict[str, str]:
        """Copy the LUN's file (a reflink where the target's filesystem can, else a copy
        keeping holes) or its LV (a full copy into a new LV) to the snapshot ``name`` on the
        target host (:mod:`flexhub_iscsi._lio_snap`); ``secrets`` hold the SSH key (the
        VolumeSnapshotClass names the StorageClass's Secret)."""
        from flexhub_iscsi import _lio, _lio_ssh, _snapshots

        volume = _lio.parse_volume(options, reclaim)
        spec = _snapshots.snapshot_spec(volume, name)
        size = reclaim.get("size", "")
        known = int(size) if size.isascii() and size.isdigit() and len(size) < 20 else 0
        timeout = _snapshots.copy_timeout(volume.backstore, known)
        lio = _lio_ssh.Lio(_node(self).runner, volume.ssh, secrets)
        done = lio.call("snapshot", spec, [], timeout)
        LOG.info("iscsi: %s of %s on %s (%s)", name, volume.iqn, volume.ssh.host, done.get("how"))
        return _snapshots.snapshot_record(volume, name, done)

    def delete_snapshot(self, snapshot: Mapping[str, str], secrets: Secrets) -> None:
        """Remove the snapshot's file, or zero its LV whole and remove it; gone is success."""
        from flexhub_iscsi import _lio, _lio_ssh, _snapshots

        snap = _snapshots.parse_snapshot(snapshot)
        size = snapshot.get("size", "")
        known = int(size) if size.isascii() and size.isdigit() and len(size) < 20 else 0
        timeout = _lio.CALL_TIMEOUT
        if snap.backstore == "block":
            timeout += _lio.zero_seconds(known)
        done = _lio_ssh.Lio(_node(self).runner, snap.ssh, secrets).call(
            "delete_snapshot", snap.spec(), [], timeout
        )
        LOG.info(
            "iscsi: snapshot %s on %s %s",
            snap.name,
            snap.ssh.host,
            "deleted" if done.get("deleted") else "already gone",
        )

    def restore(
        self,
        claim: Claim,
        parameters: Mapping[str, str],
        snapshot: Mapping[str, str],
        secrets: Secrets,
    ) -> Provisioned:
        """``provision`` of a LUN whose file or LV is first made a copy of the snapshot's
        (grown to the claim's size): on the snapshot's target host, same backstore."""
        from flexhub_iscsi import _snapshots

        snap = _snapshots.parse_snapshot(snapshot)
        lio, spec, chap = self._claim_spec(claim, parameters, secrets)
        if (lio.ssh.host, lio.ssh.port) != (snap.ssh.host, snap.ssh.port):
            raise InvalidOptions(
                f"the snapshot is on target host {snap.ssh.host}:{snap.ssh.port}: restore it "
                "with a class of that host"
            )
        if lio.backstore != snap.backstore:
            raise InvalidOptions(
                f"the snapshot is of a {snap.backstore} LUN: restore it with a class of "
                f"backstore {snap.backstore}"
            )
        return self._copy(lio, spec, chap, claim, snap.source(), secrets)

    def clone(
        self,
        claim: Claim,
        parameters: Mapping[str, str],
        options: Mapping[str, str],
        namespace: str,
        secrets: Secrets,
    ) -> Provisioned:
        """``provision`` of a LUN whose file or LV is first made a copy of the source LUN's:
        the source is looked for where the class keeps its LUNs (its target host, and its
        ``fileioDirectory`` or ``volumeGroup``), as a clone's class is the source's."""
        from flexhub_iscsi import _lio

        lio, spec, chap = self._claim_spec(claim, parameters, secrets)
        iqn = options.get("iqn", "")
        prefix, _, name = iqn.rpartition(":")
        if not _lio._full(_lio._NAME, name) or not _lio._full(_lio._PREFIX, prefix):
            raise InvalidOptions("the source volume's 'iqn' is not one the iscsi provisioner made")
        if options.get("lun", "0") != "0":
            raise InvalidOptions("the source volume's 'lun' must be 0 on a provisioned target")
        source = {"name": name}
        if lio.backstore == "block":
            source["vg"] = lio.volume_group
        else:
            source["directory"] = lio.directory
        return self._copy(lio, spec, chap, claim, source, secrets)

    def _copy(
        self,
        lio: LioClass,
        spec: dict[str, Any],
        chap: dict[str, str] | None,
        claim: Claim,
        source: dict[str, str],
        secrets: Secrets,
    ) -> Provisioned:
        from flexhub_iscsi import _lio_ssh, _snapshots

        masked = list(chap.values()) if chap else []
        timeout = _snapshots.copy_timeout(lio.backstore, spec["size"])
        done = _lio_ssh.Lio(_node(self).runner, lio.ssh, secrets).call(
            "restore", {**spec, "source": source}, masked, timeout
        )
        return self._provisioned(lio, claim, chap, done)
