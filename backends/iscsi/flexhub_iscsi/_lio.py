"""Dynamic provisioning of iSCSI volumes: one LIO target and LUN per claim, over SSH.

A StorageClass of ``backend: iscsi`` names a Linux target host (LIO) that the provisioner
reaches with SSH. For a claim it makes, on that host:

* a **backstore** ``pvc-<uid>``: with ``backstore: fileio`` (the default) the file
  ``<fileioDirectory>/pvc-<uid>.img`` of the claim's size (rounded up to MiB; sparse unless
  ``sparse: "false"``); with ``backstore: block`` an LVM logical volume ``pvc-<uid>`` in the
  class's ``volumeGroup`` (the claim's size rounded up to the group's extent size), tagged
  ``flexhub:<uid>`` so that an LV of that name someone else made is never taken or removed,
  served by an iblock backstore on ``/dev/<volumeGroup>/pvc-<uid>``;
* a **target** ``<iqnPrefix>:pvc-<uid>`` with TPG 1 on the class's portals and the backstore
  as **LUN 0**. One target per claim, not one per class: a node logging in sees only the
  LUN of the volume it mounts, each volume has its own ACLs and its own sessions (the node
  logs out when its last pod of *that* volume goes), and deleting a claim deletes a whole
  target without touching a neighbour;
* **access**: with ``initiators`` one ACL per initiator name (only those nodes may log in),
  else any initiator that passes CHAP (LIO's demo mode with TPG-level CHAP). A class with
  neither is refused: it would give the LUN to anyone who can reach the portal.

The SSH command is fixed (:data:`REMOTE_COMMAND`); the program (:mod:`flexhub_iscsi._lio_remote`
after its parts, :data:`REMOTE_PARTS`) and the requests, CHAP values included, go on its stdin
(:mod:`flexhub_iscsi._lio_ssh`, which also keeps a connection open across requests). The
private key and the known host key come from the class's Secret and are written to 0600 files
in a private temporary directory while ssh connects; ssh runs with no config file, no agent,
batch mode and strict host key checking, each request bounded.

Secrets: the class's Secret (``secretName``) is the **provisioner's**: it holds the SSH key,
which must never reach a node. The PV's ``secretRef`` therefore names another Secret,
``nodeSecretName`` / ``nodeSecretNamespace``, holding only the CHAP keys the node driver
reads (``node.session.auth.username``, ``.password``, optionally ``.username_in`` and
``.password_in``), the same values as in the class's Secret.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from flexhub.backend import (
    Frozen,
    InvalidOptions,
    Secrets,
)
from flexhub_iscsi._chap import check_value
from flexhub_iscsi._options import SESSION, Portal, parse_portal

__all__ = [
    "KNOWN_HOSTS_KEY",
    "PRIVATE_KEY",
    "REMOTE_PARTS",
    "UID",
    "LioClass",
    "LioVolume",
    "Ssh",
    "chap_from",
    "parse_class",
    "parse_volume",
    "size_of",
    "zero_seconds",
]

LOG = logging.getLogger(__name__)

#: Keys of the class's (the provisioner's) Secret.
PRIVATE_KEY = "ssh-privatekey"
KNOWN_HOSTS_KEY = "ssh-knownhosts"

MiB = 1024 * 1024
#: Bound of one SSH call (connect, the LIO work, a non-sparse file's allocation); a call that
#: zeroes part of an LV gets that zeroing's bound on top (:func:`zero_seconds`).
CALL_TIMEOUT = 120.0
#: Of a call's bound, what the remote program may not spend waiting for the target host's
#: lock (the connection, and the start of the work): past the rest it refuses and does
#: nothing, so that no request runs after its caller gave up.
LOCK_MARGIN = 30.0
#: The remote program's bound of a zeroing (``ZERO_BASE``, ``ZERO_RATE`` there): 60 s plus the
#: bytes at 20 MiB/s.
ZERO_BASE = 60
ZERO_RATE = 20 * 1024 * 1024
CONNECT_TIMEOUT = 10
#: The system python3, where the distribution installs rtslib-fb (targetcli's library), and
#: the loader it runs: the program's length (a line), the program (which then reads the
#: requests from the same stdin). One argument to the target host's shell, quoted for it.
REMOTE_COMMAND = (
    "/usr/bin/python3",
    "-I",
    "-c",
    "'import sys;b=sys.stdin.buffer;exec(b.read(int(b.readline())))'",
)
#: The remote program's files, sent in this order as one text: the last (the actions and
#: ``main``) uses what the others define (standard library only, each with one job).
REMOTE_PARTS = (
    "_lio_errors.py",
    "_lio_room.py",
    "_lio_save.py",
    "_lio_lvm.py",
    "_lio_files.py",
    "_lio_snap.py",
    "_lio_capacity.py",
    "_lio_remote.py",
)
_FUTURE = "from __future__ import annotations\n"
#: ``overcommit``: a number >= 1 (at most six digits, three decimals).
_RATIO = re.compile(r"[0-9]{1,6}(\.[0-9]{1,3})?", re.ASCII)

_HOST = re.compile(r"[0-9A-Za-z]([0-9A-Za-z.-]{0,251}[0-9A-Za-z])?|[0-9A-Fa-f:.]{2,45}", re.ASCII)
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}", re.ASCII)
_PREFIX = re.compile(
    r"iqn\.[0-9]{4}-(0[1-9]|1[0-2])\.[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[a-z0-9][a-z0-9.:-]*)?",
    re.ASCII,
)
_INITIATOR = re.compile(
    r"iqn\.[0-9]{4}-(0[1-9]|1[0-2])\.[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?"
    r"(:[A-Za-z0-9.:_-]+)?|eui\.[0-9A-Fa-f]{16}",
    re.ASCII,
)
_DIRECTORY = re.compile(r"(/[A-Za-z0-9._+-]+)+", re.ASCII)
#: An LVM volume group name, stricter than LVM's rules: no leading '-' or '.', so never an
#: option nor '.'/'..'; short enough that the device-mapper name of ``<vg>-pvc-<uid>`` (its
#: hyphens doubled) stays within the kernel's 127 characters.
_VOLUME_GROUP = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,39}", re.ASCII)
BACKSTORES = ("fileio", "block")
UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.ASCII)
_NAME = re.compile(r"pvc-" + UID.pattern, re.ASCII)
_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", re.ASCII)
_IPV4 = re.compile(r"(25[0-5]|2[0-4][0-9]|1?[0-9]{1,2})(\.(25[0-5]|2[0-4][0-9]|1?[0-9]{1,2})){3}")
#: The longest IQN (RFC 3720: 223 bytes) minus ``:pvc-<uid>``.
_PREFIX_MAX = 223 - len(":pvc-") - 36
MAX_INITIATORS = 64
FS_TYPES = ("", "ext4", "ext3", "xfs")


def zero_seconds(length: int) -> int:
    """How long the target host may take to zero ``length`` bytes of an LV."""
    return ZERO_BASE + length // ZERO_RATE


def _full(pattern: re.Pattern[str], text: str) -> bool:
    return pattern.fullmatch(text) is not None and "\n" not in text


class Ssh(Frozen):
    """How the provisioner reaches the target host."""

    __slots__ = ("host", "user", "port")  # noqa: RUF023 - the fields, in order
    host: str
    user: str
    port: int

    def __init__(self, host: str, user: str = "root", port: int = 22) -> None:
        self._set(host=host, user=user, port=port)


class LioClass(Frozen):
    """A StorageClass's parameters, checked."""

    __slots__ = (  # noqa: RUF023 - the fields, in order
        "ssh",
        "portals",
        "iqn_prefix",
        "directory",
        "sparse",
        "backstore",
        "volume_group",
        "initiators",
        "node_secret",
        "fs_type",
        "overcommit",
    )
    ssh: Ssh
    portals: tuple[Portal, ...]
    iqn_prefix: str
    directory: str
    sparse: bool
    backstore: str
    volume_group: str
    initiators: tuple[str, ...]
    node_secret: tuple[str, str] | None
    fs_type: str
    overcommit: float

    def __init__(
        self,
        ssh: Ssh,
        portals: tuple[Portal, ...],
        iqn_prefix: str,
        directory: str,
        sparse: bool = True,
        backstore: str = "fileio",
        volume_group: str = "",
        initiators: tuple[str, ...] = (),
        node_secret: tuple[str, str] | None = None,
        fs_type: str = "ext4",
        overcommit: float = 1.0,
    ) -> None:
        self._set(
            ssh=ssh,
            portals=portals,
            iqn_prefix=iqn_prefix,
            directory=directory,
            sparse=sparse,
            backstore=backstore,
            volume_group=volume_group,
            initiators=initiators,
            node_secret=node_secret,
            fs_type=fs_type,
            overcommit=overcommit,
        )


class LioVolume(Frozen):
    """What reclaim and expand need of one volume: from the PV's options and its record."""

    __slots__ = (  # noqa: RUF023 - the fields, in order
        "ssh",
        "iqn",
        "name",
        "directory",
        "sparse",
        "backstore",
        "volume_group",
        "overcommit",
    )
    ssh: Ssh
    iqn: str
    name: str
    directory: str
    sparse: bool
    backstore: str
    volume_group: str
    overcommit: float

    def __init__(
        self,
        ssh: Ssh,
        iqn: str,
        name: str,
        directory: str,
        sparse: bool,
        backstore: str = "fileio",
        volume_group: str = "",
        overcommit: float = 1.0,
    ) -> None:
        self._set(
            ssh=ssh,
            iqn=iqn,
            name=name,
            directory=directory,
            sparse=sparse,
            backstore=backstore,
            volume_group=volume_group,
            overcommit=overcommit,
        )

    @property
    def file(self) -> str:
        return f"{self.name}.img"

    def spec(self) -> dict[str, Any]:
        """What the remote program needs to find this volume's backstore."""
        if self.backstore == "block":
            return {"name": self.name, "backstore": "block", "vg": self.volume_group}
        return {"name": self.name, "directory": self.directory, "file": self.file}


def _ssh(host: str, user: str, port: str, what: str = "parameter") -> Ssh:
    if not host or not _full(_HOST, host) or host.startswith("-"):
        raise InvalidOptions(f"{what} 'targetHost' must be a host name or an IP address")
    if not _full(_USER, user):
        raise InvalidOptions(f"{what} 'sshUser' must be a user name ([a-z_][a-z0-9_-]*)")
    if not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidOptions(f"{what} 'sshPort' must be a port number (1-65535)")
    return Ssh(host, user, int(port))


def _bool(parameters: Mapping[str, str], key: str, default: bool) -> bool:
    value = parameters.get(key, "")
    if value == "":
        return default
    if value not in ("true", "false"):
        raise InvalidOptions(f'parameter {key!r} must be "true" or "false"')
    return value == "true"


def _directory(value: str, what: str = "parameter") -> str:
    parts = value.split("/")
    if not _full(_DIRECTORY, value) or any(p in (".", "..") for p in parts) or len(value) > 1024:
        raise InvalidOptions(
            f"{what} 'fileioDirectory' must be an absolute path without '.', '..', "
            "spaces or special characters"
        )
    return value


def _volume_group(value: str, what: str = "parameter") -> str:
    if not _full(_VOLUME_GROUP, value):
        raise InvalidOptions(
            f"{what} 'volumeGroup' must be an LVM volume group name: at most 40 of "
            "A-Z a-z 0-9 _ . + -, not starting with '-' or '.'"
        )
    return value


def _overcommit(value: str, what: str = "parameter") -> float:
    if value == "":
        return 1.0
    if not _full(_RATIO, value) or float(value) < 1:
        raise InvalidOptions(
            f"{what} 'overcommit' must be a number >= 1 (how many times what the fileio "
            "directory's filesystem holds its LUN files may promise)"
        )
    return float(value)


def parse_class(parameters: Mapping[str, str]) -> LioClass:
    """Check a StorageClass's parameters (the schema has checked their shape).

    :raises InvalidOptions: one line naming the parameter.
    """
    ssh = _ssh(
        parameters.get("targetHost", ""),
        parameters.get("sshUser", "") or "root",
        parameters.get("sshPort", "") or "22",
    )
    texts = [p.strip() for p in parameters.get("portals", "").split(",") if p.strip()]
    if not texts:
        raise InvalidOptions("parameter 'portals' is required: the target's ip:port list")
    portals: list[Portal] = []
    for text in texts:
        try:
            portal = parse_portal(text)
        except InvalidOptions as exc:
            raise InvalidOptions(f"parameter 'portals': {exc.message}") from None
        if not (_full(_IPV4, portal.host) or ":" in portal.host):
            raise InvalidOptions(
                f"parameter 'portals': {text!r} is not an IP address (LIO listens on addresses)"
            )
        if portal not in portals:
            portals.append(portal)
    if len(portals) > 16:
        raise InvalidOptions("parameter 'portals': at most 16 portals")
    prefix = parameters.get("iqnPrefix", "")
    if not _full(_PREFIX, prefix) or len(prefix) > _PREFIX_MAX:
        raise InvalidOptions(
            "parameter 'iqnPrefix' must be a lower-case iqn.YYYY-MM.reverse.domain[:name] "
            f"of at most {_PREFIX_MAX} characters"
        )
    backstore = parameters.get("backstore", "") or "fileio"
    if backstore not in BACKSTORES:
        raise InvalidOptions('parameter \'backstore\' must be "fileio" or "block"')
    directory = volume_group = ""
    if backstore == "fileio":
        if parameters.get("volumeGroup", ""):
            raise InvalidOptions("parameter 'volumeGroup' is for backstore \"block\" only")
        directory = _directory(parameters.get("fileioDirectory", ""))
    else:
        for key in ("fileioDirectory", "sparse", "overcommit"):
            if parameters.get(key, ""):
                raise InvalidOptions(f'parameter {key!r} is for backstore "fileio" only')
        if not parameters.get("volumeGroup", ""):
            raise InvalidOptions(
                "parameter 'volumeGroup' is required with backstore \"block\": the LVM "
                "volume group on the target host that holds the claims' logical volumes"
            )
        volume_group = _volume_group(parameters["volumeGroup"])
    initiators = tuple(
        dict.fromkeys(i.strip() for i in parameters.get("initiators", "").split(",") if i.strip())
    )
    for name in initiators:
        if not _full(_INITIATOR, name) or len(name) > 223:
            raise InvalidOptions(f"parameter 'initiators': {name!r} is not an initiator name")
    if len(initiators) > MAX_INITIATORS:
        raise InvalidOptions(f"parameter 'initiators': at most {MAX_INITIATORS} names")
    node_secret = None
    name = parameters.get("nodeSecretName", "")
    namespace = parameters.get("nodeSecretNamespace", "")
    if bool(name) != bool(namespace):
        missing = "nodeSecretNamespace" if name else "nodeSecretName"
        raise InvalidOptions(f"parameter {missing!r} is required with the other one")
    if name:
        for key, value in (("nodeSecretName", name), ("nodeSecretNamespace", namespace)):
            if not _full(_K8S_NAME, value) or (key.endswith("Namespace") and len(value) > 63):
                raise InvalidOptions(f"parameter {key!r} is not a Kubernetes object name")
        node_secret = (namespace, name)
    fs_type = parameters.get("fsType", "") or "ext4"
    if fs_type not in FS_TYPES:
        raise InvalidOptions("parameter 'fsType' must be ext4, ext3 or xfs")
    return LioClass(
        ssh=ssh,
        portals=tuple(portals),
        iqn_prefix=prefix,
        directory=directory,
        sparse=_bool(parameters, "sparse", True),
        backstore=backstore,
        volume_group=volume_group,
        initiators=initiators,
        node_secret=node_secret,
        fs_type=fs_type,
        overcommit=_overcommit(parameters.get("overcommit", "")),
    )


def chap_from(secrets: Secrets) -> dict[str, str] | None:
    """The session CHAP credentials of the class's Secret (node driver key names), checked;
    ``None`` when it holds none.

    :raises InvalidOptions: a half pair, or a value open-iscsi cannot hold (named by key).
    """

    def get(field: str) -> str:
        secret = secrets.get(SESSION + field)
        return secret.reveal() if secret is not None else ""

    values = {f: get(f) for f in ("username", "password", "username_in", "password_in")}
    for field, value in values.items():
        if value:
            check_value(SESSION + field, value)
    for user, password in (("username", "password"), ("username_in", "password_in")):
        if bool(values[user]) != bool(values[password]):
            missing = password if values[user] else user
            raise InvalidOptions(f"the class's Secret has no {SESSION}{missing}")
    if not values["username"]:
        if values["username_in"]:
            raise InvalidOptions(f"mutual CHAP needs {SESSION}username and .password too")
        return None
    chap = {"userid": values["username"], "password": values["password"]}
    if values["username_in"]:
        chap["mutual_userid"] = values["username_in"]
        chap["mutual_password"] = values["password_in"]
    return chap


def parse_volume(options: Mapping[str, str], record: Mapping[str, str]) -> LioVolume:
    """The volume a PV's options and its reclaim record name, checked again (a PV can be
    edited: nothing from it reaches the target host unchecked).

    :raises InvalidOptions: a value is missing or malformed.
    """
    ssh = _ssh(
        record.get("targetHost", ""),
        record.get("sshUser", ""),
        record.get("sshPort", ""),
        what="reclaim record",
    )
    iqn = options.get("iqn", "")
    prefix, _, name = iqn.rpartition(":")
    if not _full(_NAME, name) or not _full(_PREFIX, prefix):
        raise InvalidOptions("option 'iqn' is not one the iscsi provisioner made")
    if options.get("lun", "0") != "0":
        raise InvalidOptions("option 'lun' must be 0 on a provisioned target")
    claim_uid = record.get("claimUid")
    if claim_uid is not None and name != f"pvc-{claim_uid}":
        # the provisioner checked claimUid against the PV's name (and gives a record without
        # one the uid that name holds); the iqn can be edited too, and would point this PV's
        # reclaim at another claim's target and LV
        raise InvalidOptions("option 'iqn' names another claim than this PV's (claimUid)")
    backstore = record.get("backstore", "")
    if backstore == "block" and claim_uid is None:
        # provision writes claimUid in every block record: one without it was edited
        raise InvalidOptions("reclaim record has no claimUid (every block record has one)")
    if backstore == "block":
        volume_group = _volume_group(record.get("volumeGroup", ""), what="reclaim record")
        return LioVolume(ssh, iqn, name, "", False, "block", volume_group)
    if backstore != "fileio":
        raise InvalidOptions('reclaim record \'backstore\' must be "fileio" or "block"')
    directory = _directory(record.get("fileioDirectory", ""), what="reclaim record")
    sparse = record.get("sparse", "true")
    if sparse not in ("true", "false"):
        raise InvalidOptions('reclaim record \'sparse\' must be "true" or "false"')
    # a record written before room accounting has none: its growth is not counted (0), as
    # it was not then (the class it came from may have promised more than the disk holds)
    found = record.get("overcommit")
    overcommit = 0.0 if found is None else _overcommit(found, what="reclaim record")
    return LioVolume(ssh, iqn, name, directory, sparse == "true", overcommit=overcommit)


def size_of(size: int) -> int:
    """A LUN's size for ``size`` bytes: rounded up to MiB (at least 1 MiB)."""
    return max(MiB, -(-size // MiB) * MiB)
