"""The cheap answer to the most common ``unmount``: a directory flexhub has nothing on.

kubelet calls ``unmount`` for every pod volume it tears down, also after a reboot or a failed
``mount``, when nothing is mounted and flexhub keeps no record. This module answers that case
with one ``stat`` and one read of ``/proc/self/mountinfo``, before the node services, the
backends or the ``logging`` module are imported (:mod:`flexhub.driver.quick`). Anything else
goes the full way. It imports nothing but ``os`` (paths are strings here, not ``pathlib``).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # not typing's, which would import re and enum (see flexhub.node)
if TYPE_CHECKING:
    from pathlib import Path

if TYPE_CHECKING:
    from hashlib import sha256
else:
    try:  # CPython's built-in SHA-256: the same digest, without loading OpenSSL (a few ms);
        # every digest of the kubelet path (journal, locks, staging, memo) uses this one
        # (_sha2 from Python 3.12, _sha256 before)
        from _sha2 import sha256
    except ImportError:
        try:
            from _sha256 import sha256
        except ImportError:  # pragma: no cover - other interpreters and versions
            from hashlib import sha256

__all__ = [
    "escape_mount_path",
    "nothing_to_unmount",
    "pod_record_name",
    "pod_record_path",
    "sha256",
]

MOUNTINFO = "/proc/self/mountinfo"


def pod_record_name(state_dir: str | os.PathLike[str], target: str) -> str:
    """The journal file of the pod directory ``target``, as :class:`~flexhub.node.journal.Journal`
    names it."""
    digest = sha256(target.encode("utf-8", "surrogateescape")).hexdigest()
    return os.path.join(state_dir, "pods", f"{digest}.json")


def pod_record_path(state_dir: Path, target: str) -> Path:
    """:func:`pod_record_name` as a :class:`~pathlib.Path`."""
    from pathlib import Path

    return Path(pod_record_name(state_dir, target))


def escape_mount_path(path: str) -> str:
    """A path as ``/proc/self/mountinfo`` writes it (space, tab, newline and backslash as
    ``\\ooo``), so that its lines can be matched without decoding them."""
    for char in ("\\", " ", "\t", "\n"):
        path = path.replace(char, f"\\{ord(char):03o}")
    return path


def nothing_to_unmount(state_dir: str | os.PathLike[str], target: str | os.PathLike[str]) -> bool:
    """Whether flexhub has neither a record of ``target`` nor anything mounted on or under it,
    and no release of another volume waits for its storage (``deferred/``).

    ``target`` is checked as given and with its parent resolved (kubelet's root may be a
    symlink, and mountinfo shows resolved paths). Any doubt (an unreadable mountinfo, a
    record that exists in any form) answers ``False``.
    """
    try:
        if any(
            not name.startswith(".") for name in os.listdir(os.path.join(state_dir, "deferred"))
        ):
            return False  # a release waits for its storage: the full unmount retries it
    except FileNotFoundError:
        pass
    except OSError:
        return False
    given = os.fspath(target)
    parent, name = os.path.split(given)
    resolved = os.path.join(os.path.realpath(parent), name)
    for name in {given, resolved}:
        if os.path.lexists(pod_record_name(state_dir, name)):
            return False
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as handle:
            text = handle.read()
    except OSError:
        return False
    points = {escape_mount_path(given), escape_mount_path(resolved)}
    prefixes = tuple(p + "/" for p in points)
    for line in text.splitlines():
        fields = line.split(" ", 5)
        if len(fields) < 5:
            return False
        if fields[4] in points or fields[4].startswith(prefixes):
            return False
    return True
