"""This node's SCSI-3 persistent-reservation key: parsed, printed and derived.

A node's key is ``[iscsi] reservation_key`` of the node config, or else 8 bytes of
``sha256("flexhub", /etc/machine-id, the node's initiator name, realpath(state_dir))``
(:mod:`flexhub_iscsi._reservation` says how the key is used).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from flexhub.backend import FlexhubError

if TYPE_CHECKING:
    from hashlib import sha256
else:
    try:  # CPython's built-in SHA-256: the same digest without loading OpenSSL, which costs
        # an emulated or small node tens of milliseconds on every driver call (_sha2 from
        # Python 3.12, _sha256 before)
        from _sha2 import sha256
    except ImportError:
        try:
            from _sha256 import sha256
        except ImportError:  # pragma: no cover - other interpreters
            from hashlib import sha256

__all__ = [
    "INITIATOR_FILE",
    "MACHINE_ID",
    "format_key",
    "initiator_name",
    "machine_id_problem",
    "node_key",
    "parse_key",
    "sha256",
]

MACHINE_ID = Path("/etc/machine-id")
#: open-iscsi's default initiator name (``InitiatorName=...``).
INITIATOR_FILE = Path("/etc/iscsi/initiatorname.iscsi")
_KEY_RE = re.compile(r"^(0x)?[0-9a-fA-F]{1,16}$")


def parse_key(text: str) -> int:
    """A reservation key written as hex (``0x`` optional, 1-16 digits, not zero).

    :raises FlexhubError: it is not one.
    """
    value = text.strip()
    if not _KEY_RE.fullmatch(value) or int(value, 16) == 0:
        raise FlexhubError(
            f"reservation key {text!r} is not 1 to 16 hex digits (0x optional), or is zero"
        )
    return int(value, 16)


def format_key(key: int) -> str:
    return f"0x{key:016x}"


#: ``/etc/machine-id`` values that tell no machine apart: systemd's placeholder of an image
#: prepared for its first boot, and an id of zeros; an empty file is refused as well.
_PLACEHOLDER_IDS = frozenset({"uninitialized", "0" * 32})


def machine_id_problem(machine_id: Path = MACHINE_ID) -> str:
    """Why ``machine_id`` cannot tell this machine apart from its clones ("" when it can)."""
    try:
        ident = machine_id.read_text("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot read {machine_id} ({exc})"
    if not ident:
        return f"{machine_id} is empty"
    if ident.lower() in _PLACEHOLDER_IDS:
        return f"{machine_id} is {ident!r}, the placeholder of an image not yet booted"
    return ""


def initiator_name(path: Path = INITIATOR_FILE) -> str:
    """The node's default iSCSI initiator name (``InitiatorName=`` of ``path``; "" if none)."""
    try:
        text = path.read_text("utf-8", "replace")
    except OSError:
        return ""
    for line in text.split("\n"):
        name, sep, value = line.strip().partition("=")
        if sep and name.strip() == "InitiatorName":
            return value.strip()
    return ""


def node_key(
    state_dir: Path,
    override: str = "",
    machine_id: Path = MACHINE_ID,
    initiator_file: Path = INITIATOR_FILE,
) -> int:
    """This node's reservation key: ``override`` if set, else derived from the machine id,
    the node's initiator name and the state directory (stable across reboots, different for
    two installations, and for clones of one image once their initiator names differ).

    :raises FlexhubError: the override is invalid, or the machine id cannot tell this
        machine apart (unreadable, empty, a placeholder).
    """
    if override:
        return parse_key(override)
    problem = machine_id_problem(machine_id)
    if problem:
        raise FlexhubError(
            f"{problem}: it cannot derive a reservation key of this node; "
            "set [iscsi] reservation_key in the node config"
        )
    ident = machine_id.read_text("ascii").strip()
    initiator = initiator_name(initiator_file)
    seed = f"flexhub\0{ident}\0{initiator}\0{os.path.realpath(state_dir)}".encode()
    key = int.from_bytes(sha256(seed).digest()[:8], "big")
    return key or 1
