"""Turn an NFS volume's options into a mount plan: source, ``-o`` list, sub-directory.

Pure functions, no I/O: everything here runs in :meth:`NfsBackend.check`, before any command,
so a bad option is a Failure that touched nothing.

The mount options allow-list (:data:`FLAGS` and :data:`VALUED`) is the single source of truth;
``schemas/nfs.json`` carries the same list as a regular expression (:func:`schema_pattern`
renders it, and a unit test keeps the two identical).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence

from flexhub.backend import Frozen, InvalidOptions, Volume

__all__ = [
    "DEFAULT_SUBPATH_MODE",
    "FLAGS",
    "MAX_PATH",
    "VALUED",
    "VERSIONS",
    "Plan",
    "build_plan",
    "parse_server",
    "schema_pattern",
]

#: The values of ``nfsVersion`` (and of ``vers=`` / ``nfsvers=`` in ``mountOptions``).
VERSIONS = ("3", "4", "4.0", "4.1", "4.2")

#: Mode of a sub-directory created by ``createSubPath`` when ``subPathMode`` is absent.
DEFAULT_SUBPATH_MODE = 0o750

#: Longest export path (share plus subPath) accepted: NFSv3's MNTPATHLEN.
MAX_PATH = 1024

_VERS_RE = r"(3|4|4\.0|4\.1|4\.2)"
_SEC_RE = r"(sys|none|krb5|krb5i|krb5p)(:(sys|none|krb5|krb5i|krb5p)){0,4}"

#: Allowed mount options without a value.
FLAGS: tuple[str, ...] = (
    "hard",
    "soft",
    "ro",
    "noatime",
    "relatime",
    "nodiratime",
    "nosuid",
    "nodev",
    "noexec",
    "ac",
    "noac",
    "cto",
    "nocto",
    "lock",
    "nolock",
    "sharecache",
    "nosharecache",
    "resvport",
    "noresvport",
    "rdirplus",
    "nordirplus",
    "acl",
    "noacl",
)

#: Allowed ``name=value`` mount options and the regular expression of their value.
VALUED: dict[str, str] = {
    "vers": _VERS_RE,
    "nfsvers": _VERS_RE,
    "timeo": r"[0-9]{1,6}",
    "retrans": r"[0-9]{1,3}",
    "retry": r"[0-9]{1,5}",
    "rsize": r"[0-9]{1,8}",
    "wsize": r"[0-9]{1,8}",
    "nconnect": r"([1-9]|1[0-6])",
    "actimeo": r"[0-9]{1,6}",
    "acregmin": r"[0-9]{1,6}",
    "acregmax": r"[0-9]{1,6}",
    "acdirmin": r"[0-9]{1,6}",
    "acdirmax": r"[0-9]{1,6}",
    "sec": _SEC_RE,
    "proto": r"(tcp|tcp6|rdma|rdma6)",
    "port": r"[0-9]{1,5}",
    "lookupcache": r"(all|none|pos|positive)",
    "local_lock": r"(none|all|flock|posix)",
    "mountport": r"[0-9]{1,5}",
    "mountproto": r"(tcp|tcp6|udp|udp6)",
    "mountvers": r"[1-3]",
}

#: Numeric options and their inclusive bounds (the regex above already limits the digits).
_RANGES: dict[str, tuple[int, int]] = {
    "timeo": (1, 999999),
    "retrans": (0, 999),
    "retry": (0, 10000),
    "rsize": (1024, 16 * 1024 * 1024),
    "wsize": (1024, 16 * 1024 * 1024),
    "nconnect": (1, 16),
    "port": (0, 65535),
    "mountport": (0, 65535),
}

#: Pairs of options that contradict each other.
_OPPOSITES: tuple[tuple[str, str], ...] = (
    ("hard", "soft"),
    ("ac", "noac"),
    ("cto", "nocto"),
    ("lock", "nolock"),
    ("sharecache", "nosharecache"),
    ("resvport", "noresvport"),
    ("rdirplus", "nordirplus"),
    ("acl", "noacl"),
    ("noatime", "relatime"),
    ("vers", "nfsvers"),
    ("noac", "actimeo"),
    ("noac", "acregmin"),
    ("noac", "acregmax"),
    ("noac", "acdirmin"),
    ("noac", "acdirmax"),
)

#: Options that only mean something for NFSv3 (the MOUNT protocol, NLM, NFSACL).
_V3_ONLY = ("mountport", "mountproto", "mountvers", "local_lock", "acl", "noacl")

_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(\.{_LABEL})*")
_SEGMENT = r"(?!\.\.?(/|$))[A-Za-z0-9_.+@~=-]+"
_SHARE = re.compile(rf"/|(/{_SEGMENT})+")
_SUBPATH = re.compile(rf"{_SEGMENT}(/{_SEGMENT})*")
_MODE = re.compile(r"[0-3]?[0-7]{3}")
_OPTION = re.compile(r"([a-z_]+)(=(.*))?", re.S)


def _item_pattern() -> str:
    flags = "|".join(FLAGS)
    valued = "|".join(f"{name}={value}" for name, value in VALUED.items())
    return f"({flags}|{valued})"


def schema_pattern() -> str:
    """The ``mountOptions`` pattern of ``schemas/nfs.json``: the allow-list as one regex."""
    item = _item_pattern()
    # $(?!\n): Python's $ also matches before a final newline (jsonschema uses re.search)
    return f"^$(?!\\n)|^{item}(,{item})*$(?!\\n)"


class Plan(Frozen):
    """How one NFS volume is mounted.

    ``options`` is the exact ``-o`` list of the pod's mount; ``root_options`` the list used to
    mount the export's root read-write when ``createSubPath`` has to make the sub-directory.
    """

    __slots__ = (  # noqa: RUF023 - the fields, in order
        "host",
        "share",
        "sub_path",
        "version",
        "options",
        "root_options",
        "read_only",
        "create_sub_path",
        "sub_path_mode",
    )
    host: str
    share: str
    sub_path: str
    version: str | None
    options: tuple[str, ...]
    root_options: tuple[str, ...]
    read_only: bool
    create_sub_path: bool
    sub_path_mode: int

    def __init__(
        self,
        host: str,
        share: str,
        sub_path: str,
        version: str | None,
        options: tuple[str, ...],
        root_options: tuple[str, ...],
        read_only: bool,
        create_sub_path: bool,
        sub_path_mode: int,
    ) -> None:
        self._set(
            host=host,
            share=share,
            sub_path=sub_path,
            version=version,
            options=options,
            root_options=root_options,
            read_only=read_only,
            create_sub_path=create_sub_path,
            sub_path_mode=sub_path_mode,
        )

    @property
    def path(self) -> str:
        """The exported path that is mounted: the share, or its sub-directory."""
        if not self.sub_path:
            return self.share
        return self.share.rstrip("/") + "/" + self.sub_path

    @property
    def source(self) -> str:
        """``host:/path`` as given to mount (and shown by mountinfo)."""
        return f"{self.host}:{self.path}"

    @property
    def root_source(self) -> str:
        """``host:/share``: the export's root."""
        return f"{self.host}:{self.share}"


def parse_server(text: str) -> str:
    """Return the host part of a mount source for ``server``.

    IPv6 addresses (bare or in brackets) come back compressed and in brackets, IPv4
    addresses as dotted quads, host names in lower case.

    :raises InvalidOptions: not an RFC 1123 host name, an IPv4 or an IPv6 address.
    """
    bad = InvalidOptions(
        f"invalid option $['server']: {text[:80]!r} is not a host name, an IPv4 address or an "
        "IPv6 address"
    )
    if not text or len(text) > 253:
        raise bad
    if ":" in text or text.startswith("["):
        inner = text
        if text.startswith("[") or text.endswith("]"):
            if not (text.startswith("[") and text.endswith("]")):
                raise bad
            inner = text[1:-1]
        if "%" in inner:  # a zone index cannot travel in a mount source
            raise bad
        try:
            address = ipaddress.IPv6Address(inner)
        except ValueError:
            raise bad from None
        return f"[{address.compressed}]"
    if re.fullmatch(r"[0-9.]+", text):
        try:
            return str(ipaddress.IPv4Address(text))
        except ValueError:
            raise bad from None
    if not _HOSTNAME.fullmatch(text):
        raise bad
    return text.lower()


def _parse_option(option: str) -> tuple[str, str | None]:
    """Split one ``mountOptions`` entry and check it against the allow-list."""
    match = _OPTION.fullmatch(option)
    if match is None:
        raise InvalidOptions(f"mount option {option[:80]!r} is not allowed")
    name, value = match.group(1), match.group(3)
    if value is None:
        if name not in FLAGS:
            hint = f" (use {name}=...)" if name in VALUED else ""
            raise InvalidOptions(f"mount option {option[:80]!r} is not allowed{hint}")
        return name, None
    pattern = VALUED.get(name)
    if pattern is None:
        raise InvalidOptions(f"mount option {option[:80]!r} is not allowed")
    if not re.fullmatch(pattern, value):
        raise InvalidOptions(f"mount option {option[:80]!r} has an invalid value")
    bounds = _RANGES.get(name)
    if bounds is not None and not bounds[0] <= int(value) <= bounds[1]:
        raise InvalidOptions(
            f"mount option {option[:80]!r} is out of range ({bounds[0]}..{bounds[1]})"
        )
    return name, value


def _parse_options(options: Sequence[str]) -> dict[str, str | None]:
    parsed: dict[str, str | None] = {}
    for option in options:
        name, value = _parse_option(option)
        if name in parsed:
            raise InvalidOptions(f"mount option {name!r} is given twice in mountOptions")
        parsed[name] = value
    for first, second in _OPPOSITES:
        if first in parsed and second in parsed:
            raise InvalidOptions(f"mount options {first!r} and {second!r} contradict each other")
    return parsed


def _version(volume: Volume, parsed: Mapping[str, str | None]) -> str | None:
    """The NFS version asked for, from nfsVersion, vers=/nfsvers= and the fsType."""
    wanted = volume.options.get("nfsVersion") or None
    if wanted is not None and wanted not in VERSIONS:
        raise InvalidOptions(f"invalid option $['nfsVersion']: must be one of {VERSIONS}")
    in_options = parsed.get("vers") or parsed.get("nfsvers")
    if in_options is not None:
        if wanted is not None and wanted != in_options:
            key = "vers" if "vers" in parsed else "nfsvers"
            raise InvalidOptions(
                f"mount option {key}={in_options} contradicts nfsVersion {wanted!r}"
            )
        wanted = in_options
    fs_type = volume.fs_type
    if fs_type not in ("", "nfs", "nfs4"):
        raise InvalidOptions(
            f"invalid option $['kubernetes.io/fsType']: {fs_type[:40]!r} is not '', 'nfs' or 'nfs4'"
        )
    if fs_type == "nfs4":
        if wanted == "3":
            raise InvalidOptions("fsType 'nfs4' contradicts NFS version 3")
        wanted = wanted or "4"
    if wanted is not None and wanted != "3":
        v3_only = [name for name in _V3_ONLY if name in parsed]
        if v3_only:
            raise InvalidOptions(
                f"mount option {v3_only[0]!r} applies to NFSv3 only, not to NFS {wanted}"
            )
    return wanted


def _check_paths(volume: Volume) -> tuple[str, str]:
    share = volume.options.get("share", "")
    if not share:
        raise InvalidOptions("invalid options: missing required option 'share'")
    if len(share) > MAX_PATH or not _SHARE.fullmatch(share):
        raise InvalidOptions(
            f"invalid option $['share']: {share[:80]!r} is not an absolute path of letters, "
            "digits and _ . + @ ~ = - without '.', '..' or empty segments"
        )
    sub_path = volume.options.get("subPath", "")
    if sub_path and (len(sub_path) > 255 or not _SUBPATH.fullmatch(sub_path)):
        raise InvalidOptions(
            f"invalid option $['subPath']: {sub_path[:80]!r} is not a relative path of letters, "
            "digits and _ . + @ ~ = - without '.', '..' or empty segments"
        )
    if len(share) + 1 + len(sub_path) > MAX_PATH:
        raise InvalidOptions(f"share and subPath together are longer than {MAX_PATH} characters")
    return share, sub_path


def _sub_path_mode(volume: Volume, create: bool) -> int:
    text = volume.options.get("subPathMode", "")
    if not text:
        return DEFAULT_SUBPATH_MODE
    if not _MODE.fullmatch(text):
        raise InvalidOptions(
            f"invalid option $['subPathMode']: {text[:20]!r} is not an octal mode like 0750"
        )
    if not create:
        raise InvalidOptions("option 'subPathMode' needs createSubPath: \"true\"")
    return int(text, 8)


def build_plan(volume: Volume) -> Plan:
    """Check ``volume``'s options and return how to mount it.

    :raises InvalidOptions: a bad server, path or mode, an option outside the allow-list, an
        option given twice, or two options that contradict each other.
    """
    options = volume.options
    host = parse_server(options.get("server", ""))
    share, sub_path = _check_paths(volume)
    create = options.get("createSubPath", "false")
    if create not in ("true", "false"):
        raise InvalidOptions("invalid option $['createSubPath']: must be 'true' or 'false'")
    create_sub_path = create == "true"
    if create_sub_path and not sub_path:
        raise InvalidOptions("option 'createSubPath' needs a 'subPath'")
    mode = _sub_path_mode(volume, create_sub_path)
    user = tuple(volume.mount_options)
    parsed = _parse_options(user)
    version = _version(volume, parsed)
    read_only = volume.read_only or "ro" in parsed

    final: list[str] = []
    if version is not None:
        final.append(f"vers={version}")
    final += [o for o in user if _parse_option(o)[0] not in ("vers", "nfsvers", "ro")]
    if "hard" not in parsed and "soft" not in parsed:
        final.append("hard")
    if "retry" not in parsed:
        final.append("retry=0")
    root_options = tuple(final)
    if read_only:
        final.append("ro")
    return Plan(
        host=host,
        share=share,
        sub_path=sub_path,
        version=version,
        options=tuple(final),
        root_options=root_options,
        read_only=read_only,
        create_sub_path=create_sub_path,
        sub_path_mode=mode,
    )
