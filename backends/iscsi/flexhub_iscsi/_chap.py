"""CHAP values: what open-iscsi can hold, and a volume's connection identity.

open-iscsi keeps CHAP values in its record files as ``name = value`` lines, in fixed
``AUTH_STR_MAX_LEN`` (256) byte fields ending in NUL, and strips whitespace around a value
when it reads a record. So a value may hold at most 255 UTF-8 bytes, none of the characters
the core refuses in any option (:data:`flexhub.volume.CONTROL_CHARACTERS`: C0 and C1
controls, DEL, U+2028 and U+2029; a newline would add settings to the record, and a line
separator would do the same to any reader that splits lines as Python does) and no leading
or trailing whitespace (it would be lost silently).

The connection identity (:func:`access`) is what a second volume must match to share a LUN
that is already staged on the node: portals, iface, initiator name, and each CHAP user
name and password as an HMAC-SHA256 under a node-local random key
(``<state_dir>/iscsi-access.key``, 0600; user names count as secrets in flexhub), so the
journal never holds a credential, nor a digest that can be checked offline against guesses
without that key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from flexhub.backend import InvalidOptions, StateError, has_control_character
from flexhub_iscsi._options import DISCOVERY, SESSION, Chap, Target

__all__ = ["MAX_BYTES", "access", "check_value", "node_key"]

#: open-iscsi's ``AUTH_STR_MAX_LEN`` (256) minus the terminating NUL.
MAX_BYTES = 255
KEY_FILE = "iscsi-access.key"
_KEY_BYTES = 32


def check_value(key: str, value: str) -> None:
    """Refuse a CHAP value open-iscsi cannot hold as given (named by key, never shown).

    :raises InvalidOptions: a control character or line separator, surrounding whitespace,
        or too long.
    """
    if has_control_character(value):
        raise InvalidOptions(
            f"secret key {key}: control characters (newline, tab, U+0085, U+2028, ...) "
            "are not allowed"
        )
    if value != value.strip():
        raise InvalidOptions(
            f"secret key {key}: leading or trailing whitespace is not allowed "
            "(open-iscsi strips it)"
        )
    if len(value.encode("utf-8", "surrogateescape")) > MAX_BYTES:
        raise InvalidOptions(f"secret key {key}: longer than open-iscsi's {MAX_BYTES} bytes")


def check_chap(chap: Chap) -> None:
    """:func:`check_value` on every credential of ``chap``."""
    for name, value in chap.settings()[1:]:
        check_value(name, value)


def node_key(state_dir: Path) -> bytes:
    """The node's HMAC key: created once (0600, atomically), then read back.

    :raises StateError: the key cannot be created or read.
    """
    path = Path(state_dir) / KEY_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = -1
    except OSError as exc:
        raise StateError(f"cannot read {path}: {exc.strerror}") from None
    if fd < 0:
        tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}")
        try:
            Path(state_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
            wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                import secrets  # once per node: kept off every other call's imports

                os.write(wfd, secrets.token_bytes(_KEY_BYTES))
                os.fsync(wfd)
            finally:
                os.close(wfd)
            try:
                os.link(tmp, path)  # the first writer wins; the others read its key
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise StateError(f"cannot create {path}: {exc.strerror}") from None
    try:
        key = os.read(fd, _KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != _KEY_BYTES:
        raise StateError(f"{path} is not a {_KEY_BYTES}-byte key: delete it to make a new one")
    return key


def _digest(key: bytes, name: str, value: str) -> str:
    if not value:
        return ""
    import hashlib  # CHAP volumes only: hmac and OpenSSL stay off the other calls' imports
    import hmac

    message = f"{name}\0{value}".encode("utf-8", "surrogateescape")
    return hmac.new(key, message, hashlib.sha256).hexdigest()


#: The names of the identity's parts: the Failure names them, never a value.
_KINDS = {DISCOVERY: "discovery", SESSION: "session"}


def access(
    target: Target,
    iface: str,
    discovery: Chap | None,
    session: Chap | None,
    key: bytes,
) -> Mapping[str, str]:
    """The connection identity of a volume, safe to journal."""
    identity = {
        "portals": ",".join(sorted(str(p) for p in target.portals)),
        "iface": iface,
        "initiator name": target.initiator_name,
    }
    for prefix, chap in ((DISCOVERY, discovery), (SESSION, session)):
        kind = _KINDS[prefix]
        values = dict(chap.settings()[1:]) if chap else {}
        for field, label in (
            ("username", "CHAP user name"),
            ("password", "CHAP password"),
            ("username_in", "mutual CHAP user name"),
            ("password_in", "mutual CHAP password"),
        ):
            name = prefix + field
            identity[f"{kind} {label}"] = _digest(key, name, values.get(name, ""))
    return identity


def session_part(identity: Mapping[str, str]) -> dict[str, str]:
    """What a session carries: reusing one needs the same iface and session CHAP."""
    return {k: v for k, v in identity.items() if k == "iface" or k.startswith("session ")}
