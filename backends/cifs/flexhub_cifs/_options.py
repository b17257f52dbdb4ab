"""Turn a CIFS volume's options into a mount plan: source, ``-o`` list, sub-directory.

Pure functions, no I/O: everything here runs in :meth:`CifsBackend.check_options` (and the
credentials check in :meth:`CifsBackend.check`), before any command, so a bad option is a
Failure that touched nothing.

The mount options allow-list (:data:`FLAGS` and :data:`VALUED`) is enforced here, not by the
schema's pattern: an option the allow-list refuses is named in the Failure by its *name* only
(``password=`` typed into ``mountOptions`` must never be echoed into a reply or a log), while a
schema pattern failure quotes the whole value.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence

from flexhub.backend import Frozen, InvalidOptions, Secrets, Volume

__all__ = [
    "CREDENTIAL_OPTIONS",
    "FLAGS",
    "OWNERSHIP_OPTIONS",
    "VALUED",
    "VERSIONS",
    "Credentials",
    "Plan",
    "build_plan",
    "credentials",
    "parse_server",
]

#: The values of ``vers``: SMB 2.1, "3" (3.0 or later, negotiated), 3.0, 3.02, 3.1.1.
VERSIONS = ("2.1", "3", "3.0", "3.02", "3.1.1")
#: What ``vers`` becomes when absent: the client negotiates SMB 2.1 or later. Passed
#: explicitly so that a kernel old enough to default to SMB1 fails the mount instead.
DEFAULT_VERSION = "default"
#: SMB1 spellings, refused with their own message.
_SMB1 = ("1", "1.0")

#: Default modes when the pod has an fsGroup: owner and group get everything, others nothing.
FS_GROUP_FILE_MODE = 0o770
FS_GROUP_DIR_MODE = 0o770
_MAX_ID = 4294967294  # (uid_t)-1 is "no id"

#: Allowed mount options without a value.
FLAGS: tuple[str, ...] = (
    "ro",
    "hard",
    "soft",
    "noatime",
    "relatime",
    "nosuid",
    "nodev",
    "noexec",
    "seal",
    "nobrl",
    "nostrictsync",
    "nohandlecache",
    "resilienthandles",
    "persistenthandles",
    "serverino",
    "noserverino",
    "mapposix",
    "nomapposix",
    "mapchars",
    "nomapchars",
    "forceuid",
    "forcegid",
    "mfsymlinks",
    "nosharesock",
    "multichannel",
)

#: Allowed ``name=value`` mount options and the regular expression of their value.
VALUED: dict[str, str] = {
    "cache": r"(strict|none)",
    "sec": r"(ntlmssp|ntlmsspi)",
    "actimeo": r"[0-9]{1,6}",
    "acregmax": r"[0-9]{1,6}",
    "acdirmax": r"[0-9]{1,6}",
    "rsize": r"[0-9]{1,8}",
    "wsize": r"[0-9]{1,8}",
    "echo_interval": r"[0-9]{1,3}",
    "port": r"[0-9]{1,5}",
    "handletimeout": r"[0-9]{1,6}",
    "max_channels": r"[0-9]{1,2}",
    "iocharset": r"utf8",
}

#: Numeric options and their inclusive bounds.
_RANGES: dict[str, tuple[int, int]] = {
    "rsize": (1024, 16 * 1024 * 1024),
    "wsize": (1024, 16 * 1024 * 1024),
    "echo_interval": (1, 600),
    "port": (1, 65535),
    "handletimeout": (0, 16 * 60 * 1000),
    "max_channels": (1, 16),
}

_OPPOSITES: tuple[tuple[str, str], ...] = (
    ("hard", "soft"),
    ("serverino", "noserverino"),
    ("mapposix", "nomapposix"),
    ("mapchars", "nomapchars"),
    ("mapposix", "mapchars"),
    ("noatime", "relatime"),
    ("resilienthandles", "persistenthandles"),
)

#: Options that would carry a credential: refused by name, their value never shown.
CREDENTIAL_OPTIONS = frozenset(
    {
        "username",
        "user",
        "password",
        "pass",
        "password2",
        "credentials",
        "cred",
        "domain",
        "dom",
        "workgroup",
        "domainauto",
        "guest",
        "cruid",
        "multiuser",
    }
)
#: Ownership and modes have options of their own.
OWNERSHIP_OPTIONS = ("uid", "gid", "file_mode", "dir_mode")

_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(\.{_LABEL})*")
_SHARE = re.compile(r"(?![.-])[A-Za-z0-9_.$-]{1,80}")
_SEGMENT = r"(?!\.\.?(/|$))[A-Za-z0-9_.+@~=-]+"
_SUBPATH = re.compile(rf"{_SEGMENT}(/{_SEGMENT})*")
_ID = re.compile(r"[0-9]{1,10}")
_MODE = re.compile(r"0?[0-7]{3}")
_OPTION = re.compile(r"([a-z0-9_]+)(=(.*))?", re.S)
#: A user name or domain in the credentials file: no control character (a newline would
#: start another line of the file), no comma (mount.cifs passes it on in a comma list).
_CRED_TEXT = re.compile(r"[^\x00-\x1f\x7f,]{1,256}")


class Plan(Frozen):
    """How one CIFS volume is mounted.

    ``options`` is the exact ``-o`` list of the pod's mount, without the credentials file
    (added for the one ``mount`` command only).
    """

    __slots__ = (  # noqa: RUF023 - the fields, in order
        "host",
        "share",
        "sub_path",
        "version",
        "options",
        "read_only",
    )
    host: str
    share: str
    sub_path: str
    version: str
    options: tuple[str, ...]
    read_only: bool

    def __init__(
        self,
        host: str,
        share: str,
        sub_path: str,
        version: str,
        options: tuple[str, ...],
        read_only: bool,
    ) -> None:
        self._set(
            host=host,
            share=share,
            sub_path=sub_path,
            version=version,
            options=options,
            read_only=read_only,
        )

    @property
    def root_source(self) -> str:
        """``//host/share``: the share's root, as given to mount and shown by mountinfo."""
        return f"//{self.host}/{self.share}"

    @property
    def source(self) -> str:
        """The mounted path: ``//host/share`` or ``//host/share/sub/path``."""
        if not self.sub_path:
            return self.root_source
        return f"{self.root_source}/{self.sub_path}"


class Credentials(Frozen):
    """What goes into the credentials file. ``repr`` never shows the password."""

    __slots__ = ("username", "password", "domain")  # noqa: RUF023 - the fields, in order
    username: str
    password: str
    domain: str

    def __init__(self, username: str, password: str, domain: str) -> None:
        self._set(username=username, password=password, domain=domain)

    def __repr__(self) -> str:
        return f"Credentials(username={self.username!r}, password='***', domain={self.domain!r})"

    def file_text(self) -> bytes:
        """The credentials file mount.cifs reads (``credentials=``)."""
        lines = [f"username={self.username}", f"password={self.password}"]
        if self.domain:
            lines.append(f"domain={self.domain}")
        return ("\n".join(lines) + "\n").encode("utf-8")


def parse_server(text: str) -> str:
    """Return the host of ``server``: an RFC 1123 host name (lower case) or an IPv4 address.

    :raises InvalidOptions: anything else (IPv6 is not supported in a UNC here).
    """
    bad = InvalidOptions(
        f"invalid option $['server']: {text[:80]!r} is not a host name or an IPv4 address"
    )
    if not text or len(text) > 253:
        raise bad
    if re.fullmatch(r"[0-9.]+", text):
        try:
            return str(ipaddress.IPv4Address(text))
        except ValueError:
            raise bad from None
    if not _HOSTNAME.fullmatch(text):
        raise bad
    return text.lower()


def _version(volume: Volume) -> str:
    wanted = volume.options.get("vers", "")
    if not wanted:
        return DEFAULT_VERSION
    if wanted in _SMB1:
        raise InvalidOptions(
            f"invalid option $['vers']: SMB1 (vers {wanted}) is refused: it is insecure and "
            "deprecated; use 2.1, 3.0, 3.02 or 3.1.1 (enable SMB2 or later on the server)"
        )
    if wanted not in VERSIONS:
        raise InvalidOptions(
            f"invalid option $['vers']: {wanted[:20]!r} is not one of {', '.join(VERSIONS)}"
        )
    return wanted


def _parse_option(option: str) -> tuple[str, str | None]:
    """Split one ``mountOptions`` entry and check it against the allow-list.

    Never quotes the value of an option that is refused by name (it may be a password).
    """
    match = _OPTION.fullmatch(option)
    if match is None:
        raise InvalidOptions("a mountOptions entry is not a lower-case option name[=value]")
    name, value = match.group(1), match.group(3)
    if name in CREDENTIAL_OPTIONS:
        raise InvalidOptions(
            f"mount option {name!r} is refused: credentials come only from the Secret "
            "(secretRef with the keys username, password and optional domain)"
        )
    if name in OWNERSHIP_OPTIONS:
        raise InvalidOptions(f"mount option {name!r} is refused: use the option {name!r}")
    if name in ("vers", "nfsvers"):
        if value in _SMB1:
            raise InvalidOptions(
                "mount option 'vers' is refused: SMB1 is insecure and deprecated; use the vers "
                "option with 2.1, 3.0, 3.02 or 3.1.1"
            )
        raise InvalidOptions("mount option 'vers' is refused: use the option 'vers'")
    if value is None:
        if name not in FLAGS:
            hint = f" (use {name}=...)" if name in VALUED else ""
            raise InvalidOptions(f"mount option {name!r} is not allowed{hint}")
        return name, None
    pattern = VALUED.get(name)
    if pattern is None:
        raise InvalidOptions(f"mount option {name!r} with a value is not allowed")
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


def _paths(options: Mapping[str, str]) -> tuple[str, str]:
    share = options.get("share", "")
    if not _SHARE.fullmatch(share):
        raise InvalidOptions(
            f"invalid option $['share']: {share[:80]!r} is not a share name (1 to 80 letters, "
            "digits and _ . $ -, not starting with . or -)"
        )
    sub_path = options.get("subPath", "")
    if sub_path and (len(sub_path) > 1024 or not _SUBPATH.fullmatch(sub_path)):
        raise InvalidOptions(
            f"invalid option $['subPath']: {sub_path[:80]!r} is not a relative path of letters, "
            "digits and _ . + @ ~ = - without '.', '..' or empty segments"
        )
    return share, sub_path


def _id(options: Mapping[str, str], key: str) -> int | None:
    text = options.get(key, "")
    if not text:
        return None
    if not _ID.fullmatch(text) or int(text) > _MAX_ID:
        raise InvalidOptions(f"invalid option $['{key}']: {text[:20]!r} is not an id 0..{_MAX_ID}")
    return int(text)


def _mode(options: Mapping[str, str], key: str) -> int | None:
    text = options.get(key, "")
    if not text:
        return None
    if not _MODE.fullmatch(text):
        raise InvalidOptions(
            f"invalid option $['{key}']: {text[:20]!r} is not an octal mode like 0770 "
            "(no setuid, setgid or sticky bit)"
        )
    return int(text, 8)


def build_plan(volume: Volume) -> Plan:
    """Check ``volume``'s options (not its secrets) and return how to mount it.

    With an fsGroup, ``gid`` defaults to it and ``file_mode``/``dir_mode`` to ``0770``.

    :raises InvalidOptions: a bad server, share, path, id, mode or version, SMB1, an option
        outside the allow-list, a credential in ``mountOptions``, an option given twice, or
        two options that contradict each other.
    """
    options = volume.options
    host = parse_server(options.get("server", ""))
    share, sub_path = _paths(options)
    version = _version(volume)
    if volume.fs_type not in ("", "cifs"):
        raise InvalidOptions(
            f"invalid option $['kubernetes.io/fsType']: {volume.fs_type[:40]!r} is not '' or 'cifs'"
        )
    user = tuple(volume.mount_options)
    parsed = _parse_options(user)
    uid, gid = _id(options, "uid"), _id(options, "gid")
    file_mode, dir_mode = _mode(options, "file_mode"), _mode(options, "dir_mode")
    if volume.fs_group is not None:
        gid = volume.fs_group if gid is None else gid
        file_mode = FS_GROUP_FILE_MODE if file_mode is None else file_mode
        dir_mode = FS_GROUP_DIR_MODE if dir_mode is None else dir_mode
    read_only = volume.read_only or "ro" in parsed

    final = [f"vers={version}"]
    final += [o for o in user if o != "ro"]
    if "hard" not in parsed and "soft" not in parsed:
        final.append("hard")
    if uid is not None:
        final.append(f"uid={uid}")
    if gid is not None:
        final.append(f"gid={gid}")
    if file_mode is not None:
        final.append(f"file_mode={file_mode:04o}")
    if dir_mode is not None:
        final.append(f"dir_mode={dir_mode:04o}")
    final.append("ro" if read_only else "rw")
    return Plan(
        host=host,
        share=share,
        sub_path=sub_path,
        version=version,
        options=tuple(final),
        read_only=read_only,
    )


def credentials(secrets: Secrets) -> Credentials:
    """The Secret's ``username``, ``password`` and optional ``domain``, checked.

    Errors name the key, never a value.

    :raises InvalidOptions: a key is missing, not base64 UTF-8 text, or holds a character
        the credentials file cannot carry.
    """
    missing = [key for key in ("username", "password") if key not in secrets]
    if missing:
        raise InvalidOptions(
            "the cifs backend needs a Secret (flexVolume.secretRef, type k8s/flexhub) with the "
            f"keys username and password (and optionally domain); missing: {', '.join(missing)}"
        )
    username = secrets["username"].reveal()
    password = secrets["password"].reveal()
    domain = secrets["domain"].reveal() if "domain" in secrets else ""
    for key, value in (("username", username), ("domain", domain)):
        if (value or key == "username") and not _CRED_TEXT.fullmatch(value):
            raise InvalidOptions(
                f"secret key {key!r} must be 1 to 256 characters without a comma or a control "
                "character"
            )
    if len(password) > 512 or any(c in password for c in "\x00\n\r"):
        raise InvalidOptions(
            "secret key 'password' must be at most 512 characters without a line break or NUL"
        )
    return Credentials(username=username, password=password, domain=domain)
