"""The operator's one-shot permission to preempt a dead holder's reservation.

``flexhub fence preempt`` writes it under ``<state_dir>/fence/`` (0600, no secret in it); the
next read-write attach of that LUN on this node uses it once (see
:mod:`flexhub_iscsi._reservation`). It is bound to the holder's key and the reservation's
PR generation, and it expires.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from flexhub.backend import FlexhubError, Frozen, write_atomically
from flexhub_iscsi._keys import format_key, parse_key, sha256

__all__ = [
    "DEFAULT_TTL",
    "MAX_TTL",
    "Authorization",
    "authorize_preempt",
    "cancel_preempt",
    "forget_preempt",
    "parse_generation",
    "pending_preempt",
    "pending_preempts",
    "preempt_refusal",
]

LOG = logging.getLogger(__name__)

#: How long a ``fence preempt`` authorization lasts unless told (seconds), and at most.
DEFAULT_TTL = 15 * 60
MAX_TTL = 24 * 3600
_PREEMPT_DIR = "fence"


class Authorization(Frozen):
    """An operator's permission for this node to preempt ``key`` on ``volume`` once, while
    the reservation is still at ``generation`` and before ``expires`` (a Unix time)."""

    __slots__ = (  # noqa: RUF023 - the fields, in order
        "volume",
        "key",
        "generation",
        "granted",
        "expires",
    )
    volume: str
    key: int
    generation: int
    granted: float
    expires: float

    def __init__(
        self,
        volume: str,
        key: int,
        generation: int,
        granted: float,
        expires: float,
    ) -> None:
        self._set(volume=volume, key=key, generation=generation, granted=granted, expires=expires)

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires

    def to_json(self) -> dict[str, object]:
        return {
            "volume": self.volume,
            "key": format_key(self.key),
            "generation": f"{self.generation:#x}",
            "granted": self.granted,
            "expires": self.expires,
        }

    @classmethod
    def from_json(cls, data: object) -> Authorization:
        """:raises ValueError: not an authorization record."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        try:
            return cls(
                volume=str(data["volume"]),
                key=parse_key(str(data["key"])),
                generation=parse_generation(str(data["generation"])),
                granted=float(data["granted"]),
                expires=float(data["expires"]),
            )
        except (KeyError, TypeError, FlexhubError) as exc:
            raise ValueError(f"not an authorization record ({exc})") from None


def parse_generation(text: str) -> int:
    """A PR generation as ``sg_persist`` prints it (``0x1c``) or as a decimal number.

    :raises FlexhubError: it is not one.
    """
    value = text.strip().lower()
    try:
        number = int(value, 16) if value.startswith("0x") else int(value, 10)
    except ValueError:
        number = -1
    if not 0 <= number < 2**32:
        raise FlexhubError(f"PR generation {text!r} is not a number from 0 to 0xffffffff")
    return number


def _preempt_dir(state_dir: Path) -> Path:
    return Path(state_dir) / _PREEMPT_DIR


def _preempt_file(state_dir: Path, volume_id: str) -> Path:
    digest = sha256(volume_id.encode()).hexdigest()[:32]
    return _preempt_dir(state_dir) / digest


def authorize_preempt(
    state_dir: Path,
    volume_id: str,
    key: int,
    generation: int,
    ttl: float = DEFAULT_TTL,
    now: float | None = None,
) -> Authorization:
    """Let the next read-write attach of ``volume_id`` on this node preempt ``key``, while
    the reservation is at ``generation`` and for ``ttl`` seconds; replaces an earlier one."""
    granted = time.time() if now is None else now
    grant = Authorization(volume_id, key, generation, granted, granted + ttl)
    path = _preempt_file(state_dir, volume_id)
    payload = (json.dumps(grant.to_json(), sort_keys=True) + "\n").encode()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomically(path, payload, sync_directory=False)
    except OSError as exc:
        raise FlexhubError(
            f"cannot record the permission in {path.parent}: {exc.strerror}"
        ) from None
    return grant


def _read_grant(path: Path) -> Authorization | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as handle:
            return Authorization.from_json(json.loads(handle.read(64 * 1024)))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        LOG.warning("iscsi: ignoring the unreadable preemption record %s: %s", path, exc)
        return None


def pending_preempt(state_dir: Path, volume_id: str) -> Authorization | None:
    """The operator's permission to preempt a key of ``volume_id`` here, expired or not."""
    grant = _read_grant(_preempt_file(state_dir, volume_id))
    return grant if grant is not None and grant.volume == volume_id else None


def pending_preempts(state_dir: Path) -> list[Authorization]:
    """Every permission recorded on this node (expired ones too), by volume."""
    try:
        names = sorted(os.listdir(_preempt_dir(state_dir)))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise FlexhubError(f"cannot read {_preempt_dir(state_dir)}: {exc.strerror}") from None
    found = []
    for name in names:
        if name.startswith("."):
            continue
        grant = _read_grant(_preempt_dir(state_dir) / name)
        if grant is not None and _preempt_file(state_dir, grant.volume).name == name:
            found.append(grant)
    return sorted(found, key=lambda g: g.volume)


def cancel_preempt(state_dir: Path, volume_id: str) -> Authorization | None:
    """Remove the permission of ``volume_id``; returns what it was (``None``: there was none)."""
    grant = pending_preempt(state_dir, volume_id)
    _consume_preempt(state_dir, volume_id)
    return grant


def _consume_preempt(state_dir: Path, volume_id: str) -> None:
    path = _preempt_file(state_dir, volume_id)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise FlexhubError(f"cannot remove the permission {path}: {exc.strerror}") from None


def forget_preempt(state_dir: Path, volume_id: str, why: str) -> None:
    """Delete a permission that is used up or void; one that cannot be deleted stays void
    anyway (the preemption, or the change it missed, moved the generation on)."""
    try:
        _consume_preempt(state_dir, volume_id)
    except FlexhubError as exc:
        LOG.error("iscsi: %s: the preemption permission (%s) stays: %s", volume_id, why, exc)
    else:
        LOG.warning("iscsi: %s: preemption permission deleted (%s)", volume_id, why)


def _when(moment: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(moment))


def preempt_refusal(grant: Authorization | None, holder: int, generation: int, now: float) -> str:
    """Why ``grant`` does not allow preempting ``holder`` at ``generation`` ("" if it does)."""
    if grant is None:
        return "no preemption allowed on this node"
    if grant.key != holder:
        return f"the preemption allowed on this node is for key {format_key(grant.key)}"
    if grant.expired(now):
        return (
            f"the preemption of key {format_key(holder)} allowed on this node expired at "
            f"{_when(grant.expires)}"
        )
    if grant.generation != generation:
        return (
            f"the reservation changed since the preemption was allowed (PR generation "
            f"{grant.generation:#x} then, {generation:#x} now: the holder registered again, "
            "so it may be alive)"
        )
    return ""
