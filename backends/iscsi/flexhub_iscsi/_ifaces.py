"""open-iscsi ifaces: check that a named iface exists, or make the dedicated iface that carries
a volume's ``initiatorName`` (a copy of its base iface).
"""

from __future__ import annotations

import logging

from flexhub.backend import BlockBackend, InvalidOptions
from flexhub_iscsi._iscsiadm import Iscsiadm, IscsiadmError

LOG = logging.getLogger(__name__)

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


class _Ifaces(BlockBackend):
    """The iface of an attach (the connector's iface helpers)."""

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
