"""The iSCSI options of a volume, its CHAP credentials and the node's ``[iscsi]`` settings.

The schema already checked every value's shape; this module turns them into typed values and
checks what a schema cannot (duplicate portals, credentials that come in pairs, the node
config). Error messages name option and secret *keys*, never a secret value.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import total_ordering
from typing import Any

from flexhub.backend import FlexhubError, Frozen, InvalidOptions, Volume
from flexhub_iscsi._keys import parse_key, sha256

__all__ = [
    "DEFAULT_IFACE",
    "DEFAULT_PORT",
    "DISCOVERY",
    "IFACE_PREFIX",
    "MAX_PORTALS",
    "SESSION",
    "SETTINGS_KEYS",
    "Chap",
    "Portal",
    "Settings",
    "Target",
    "chap_for",
    "dedicated_iface",
    "parse_portal",
    "parse_target",
]

DEFAULT_PORT = 3260
DEFAULT_IFACE = "default"
#: Ifaces whose name starts with this were made by flexhub (for ``initiatorName``).
IFACE_PREFIX = "flexhub-"
MAX_PORTALS = 16

#: Secret key prefixes, the in-tree plugin's names (they are also the iscsiadm setting names).
DISCOVERY = "discovery.sendtargets.auth."
SESSION = "node.session.auth."


@total_ordering
class Portal(Frozen):
    """One ``host:port`` of a target; ``host`` has no brackets (IPv6 is bare here).

    Ordered by ``(host, port)``.
    """

    __slots__ = ("host", "port")
    host: str
    port: int

    def __init__(self, host: str, port: int = DEFAULT_PORT) -> None:
        self._set(host=host, port=port)

    def __lt__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, Portal)
        return (self.host, self.port) < (other.host, other.port)

    def __str__(self) -> str:
        """The form iscsiadm and ``/dev/disk/by-path`` use: ``[v6]:port`` or ``host:port``."""
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"


def parse_portal(text: str) -> Portal:
    """Parse ``host[:port]`` (IPv6 in brackets, port 3260 by default).

    :raises InvalidOptions: the text is not a portal.
    """
    raw = text.strip()
    if raw.startswith("["):
        host, sep, rest = raw[1:].partition("]")
        if not sep or not host or (rest and not rest.startswith(":")):
            raise InvalidOptions(f"portal {text!r} is not [IPv6]:port")
        port_text = rest[1:] if rest else ""
    else:
        if raw.count(":") > 1:
            raise InvalidOptions(f"portal {text!r}: write an IPv6 address in brackets")
        host, _, port_text = raw.partition(":")
        if not host:
            raise InvalidOptions(f"portal {text!r} has no host")
    if port_text == "":
        port = DEFAULT_PORT
    elif port_text.isdigit() and 0 < int(port_text) < 65536:
        port = int(port_text)
    else:
        raise InvalidOptions(f"portal {text!r} has an invalid port")
    return Portal(host.lower() if ":" in host else host, port)


class Target(Frozen):
    """The options of one iSCSI volume."""

    __slots__ = (  # noqa: RUF023 - the fields, in order
        "iqn",
        "lun",
        "portals",
        "iface",
        "initiator_name",
        "chap_discovery",
        "chap_session",
    )
    iqn: str
    lun: int
    portals: tuple[Portal, ...]
    iface: str
    initiator_name: str
    chap_discovery: bool
    chap_session: bool

    def __init__(
        self,
        iqn: str,
        lun: int,
        portals: tuple[Portal, ...],
        iface: str = DEFAULT_IFACE,
        initiator_name: str = "",
        chap_discovery: bool = False,
        chap_session: bool = False,
    ) -> None:
        self._set(
            iqn=iqn,
            lun=lun,
            portals=portals,
            iface=iface,
            initiator_name=initiator_name,
            chap_discovery=chap_discovery,
            chap_session=chap_session,
        )

    @property
    def volume_id(self) -> str:
        return f"iscsi:{self.iqn}:{self.lun}"


def parse_target(options: Mapping[str, str]) -> Target:
    """Build the :class:`Target` of a schema-valid options object.

    :raises InvalidOptions: a required option is missing or a cross-field rule is broken.
    """
    for key in ("targetPortal", "iqn", "lun"):
        if not options.get(key):
            raise InvalidOptions(f"option {key!r} is required")
    portals: list[Portal] = []
    extra = [p for p in options.get("portals", "").split(",") if p.strip()]
    for text in [options["targetPortal"], *extra]:
        portal = parse_portal(text)
        if portal not in portals:
            portals.append(portal)
    if len(portals) > MAX_PORTALS:
        raise InvalidOptions(f"option 'portals': at most {MAX_PORTALS} portals")
    lun_text = options["lun"]
    if not lun_text.isdigit() or int(lun_text) > 16383:
        raise InvalidOptions("option 'lun' must be a number from 0 to 16383")
    return Target(
        iqn=options["iqn"],
        lun=int(lun_text),
        portals=tuple(portals),
        iface=options.get("iscsiInterface") or DEFAULT_IFACE,
        initiator_name=options.get("initiatorName", ""),
        chap_discovery=options.get("chapAuthDiscovery") == "true",
        chap_session=options.get("chapAuthSession") == "true",
    )


def dedicated_iface(base: str, initiator_name: str) -> str:
    """The name of the iface flexhub makes for ``initiator_name`` (a copy of ``base``)."""
    digest = sha256(f"{base}\0{initiator_name}".encode()).hexdigest()[:16]
    return f"{IFACE_PREFIX}{digest}"


class Chap(Frozen):
    """CHAP credentials for discovery or for the session (mutual CHAP when ``*_in`` set).

    ``repr`` shows only which parts are present.
    """

    __slots__ = ("prefix", "username", "password", "username_in", "password_in")  # noqa: RUF023
    prefix: str
    username: str
    password: str
    username_in: str
    password_in: str

    def __init__(
        self,
        prefix: str,
        username: str,
        password: str,
        username_in: str = "",
        password_in: str = "",
    ) -> None:
        self._set(
            prefix=prefix,
            username=username,
            password=password,
            username_in=username_in,
            password_in=password_in,
        )

    def __repr__(self) -> str:
        mutual = "mutual" if self.username_in else "one-way"
        return f"Chap({self.prefix}*, {mutual})"

    def settings(self) -> list[tuple[str, str]]:
        """The iscsiadm ``(name, value)`` pairs, ``authmethod`` first."""
        pairs = [
            (self.prefix + "authmethod", "CHAP"),
            (self.prefix + "username", self.username),
            (self.prefix + "password", self.password),
        ]
        if self.username_in:
            pairs += [
                (self.prefix + "username_in", self.username_in),
                (self.prefix + "password_in", self.password_in),
            ]
        return pairs

    def values(self) -> list[str]:
        """Every credential, usernames included, for masking."""
        return [v for v in (self.username, self.password, self.username_in, self.password_in) if v]


def chap_for(volume: Volume, prefix: str) -> Chap:
    """The CHAP credentials under ``prefix`` from the volume's secrets.

    :raises InvalidOptions: a needed key is missing or empty (named, its value never shown).
    """
    kind = "discovery" if prefix == DISCOVERY else "session"
    flag = "chapAuthDiscovery" if prefix == DISCOVERY else "chapAuthSession"

    def get(name: str) -> str:
        secret = volume.secrets.get(prefix + name)
        return secret.reveal() if secret is not None else ""

    for name in ("username", "password"):
        if not get(name):
            raise InvalidOptions(
                f"{flag} is 'true' but the secret has no {prefix}{name}: "
                f"{kind} CHAP needs the PV's secretRef to hold it"
            )
    username_in, password_in = get("username_in"), get("password_in")
    if bool(username_in) != bool(password_in):
        missing = "password_in" if username_in else "username_in"
        raise InvalidOptions(
            f"mutual {kind} CHAP needs both {prefix}username_in and {prefix}password_in: "
            f"the secret has no {prefix}{missing}"
        )
    return Chap(prefix, get("username"), get("password"), username_in, password_in)


def _number(table: Mapping[str, Any], key: str, default: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise FlexhubError(f"node config: [iscsi] {key} must be a positive number")
    return float(value)


def _key(table: Mapping[str, Any]) -> str:
    value = table.get("reservation_key", "")
    if not isinstance(value, str):
        raise FlexhubError("node config: [iscsi] reservation_key must be a string of hex digits")
    if value:
        try:
            parse_key(value)
        except FlexhubError as exc:
            raise FlexhubError(f"node config: [iscsi] {exc.message}") from None
    return value


def _directory(table: Mapping[str, Any], key: str) -> str:
    value = table.get(key, "")
    if not isinstance(value, str) or (
        value and (not value.startswith("/") or any(c in value for c in "\0\n"))
    ):
        raise FlexhubError(f"node config: [iscsi] {key} must be an absolute path")
    return value


#: The keys of the node config's ``[iscsi]`` table.
SETTINGS_KEYS = (
    "device_timeout",
    "multipath_timeout",
    "login_timeout",
    "command_timeout",
    "reservation_key",
    "capacity_secret_dir",
)


class Settings(Frozen):
    """The node config's ``[iscsi]`` table.

    ``device_timeout``: seconds to wait for the LUN's block device after login (20).
    ``multipath_timeout``: seconds to wait for multipathd's map over several paths (10).
    ``login_timeout``: bound of one ``iscsiadm`` login or discovery (60).
    ``command_timeout``: bound of any other ``iscsiadm`` (and ``sg_persist``) call (30).
    ``reservation_key``: this node's SCSI-3 reservation key, hex; empty: derived from
    ``/etc/machine-id`` and the state directory.
    ``capacity_secret_dir``: the CSI controller's only: a directory holding the files
    ``ssh-privatekey`` and ``ssh-knownhosts`` (the class's Secret, mounted), the SSH key its
    ``GetCapacity`` reaches the target host with (CSI sends that call no secrets); empty:
    the iSCSI backend does not answer ``GetCapacity``.
    """

    __slots__ = SETTINGS_KEYS  # the fields, in order
    device_timeout: float
    multipath_timeout: float
    login_timeout: float
    command_timeout: float
    reservation_key: str
    capacity_secret_dir: str

    def __init__(
        self,
        device_timeout: float = 20.0,
        multipath_timeout: float = 10.0,
        login_timeout: float = 60.0,
        command_timeout: float = 30.0,
        reservation_key: str = "",
        capacity_secret_dir: str = "",
    ) -> None:
        self._set(
            device_timeout=device_timeout,
            multipath_timeout=multipath_timeout,
            login_timeout=login_timeout,
            command_timeout=command_timeout,
            reservation_key=reservation_key,
            capacity_secret_dir=capacity_secret_dir,
        )

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> Settings:
        """Read ``[iscsi]``; unknown keys are refused so that typos show.

        :raises FlexhubError: a value is not a positive number, or a key is unknown.
        """
        from flexhub.backend import check_keys

        check_keys(None, "iscsi", table, SETTINGS_KEYS)
        default = cls()
        return cls(
            device_timeout=_number(table, "device_timeout", default.device_timeout),
            multipath_timeout=_number(table, "multipath_timeout", default.multipath_timeout),
            login_timeout=_number(table, "login_timeout", default.login_timeout),
            command_timeout=_number(table, "command_timeout", default.command_timeout),
            reservation_key=_key(table),
            capacity_secret_dir=_directory(table, "capacity_secret_dir"),
        )
